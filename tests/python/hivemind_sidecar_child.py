"""One peer of tests/python/test_py_hivemind_sidecar.py: a cohort.hivemind
averager reached in one of three ways, running a scenario and printing
one JSON line per result.

    hivemind_sidecar_child.py ROUTE PEER_ID SCENARIO [ARGS...]

ROUTE: a broker's host:port (in process, with $COHORT_SECRET_FILE),
"unix:PATH" (the sidecar at PATH), or "env" (DHT() with no peers, in a
cohort trainer's environment: $COHORT_SOCKET and no key).
"""
import json
import sys
import time

import cohort.hivemind as hivemind
from hivemind_child import adaptive_tensors_of, state_tensors_of, tensors_of


def out(**kw):
    print(json.dumps(kw), flush=True)


def main():
    route, peer, scenario = sys.argv[1:4]
    rest = sys.argv[4:]
    if route == "env":
        dht = hivemind.DHT(start=True, cohort="hm", peer_id=peer)
    else:
        dht = hivemind.DHT(initial_peers=[route], start=True, cohort="hm", peer_id=peer)
    if scenario == "weighted":
        # ARGS: k, n, weight[, timeout]. One round in a group of n (the
        # step's timeout 60 s unless given); gathers its k.
        k, n, weight = int(rest[0]), int(rest[1]), float(rest[2])
        timeout = float(rest[3]) if len(rest) > 3 else 60.0
        a = hivemind.DecentralizedAverager(
            tensors_of(k), dht, start=True, prefix="test/side", target_group_size=n,
            min_group_size=n, min_matchmaking_time=1.0, request_timeout=0.5,
            allreduce_timeout=5.0)
        out(stepping=a.peer_id)
        control = a.step(gather={"k": k}, weight=weight, timeout=timeout, wait=False)
        try:
            got = control.result(timeout=120)
        except hivemind.AllreduceException as e:
            out(error=str(e))
            a.shutdown()
            return
        with a.get_tensors() as t:
            out(me=a.peer_id, gathered=got, tensors=[x.tolist() for x in t],
                last=a.last_group[2], bits=a.get_group_bits())
        a.shutdown()
    elif scenario == "refused":
        # An averager whose prefix the matchmaker refuses: what create raises.
        try:
            hivemind.DecentralizedAverager(
                tensors_of(0), dht, start=True, prefix="not a prefix!",
                min_matchmaking_time=1.0, request_timeout=0.5)
        except (ValueError, RuntimeError) as e:
            out(type=type(e).__name__, error=str(e), free=dht._averager is None)
            return
        out(error=None)
    elif scenario == "create":
        # An averager of a valid configuration: what create raises, if
        # anything (the environment may refuse it: COHORT_INTEGRITY).
        try:
            a = hivemind.DecentralizedAverager(
                tensors_of(0), dht, start=True, prefix="test/side",
                min_matchmaking_time=1.0, request_timeout=0.5)
        except (ValueError, RuntimeError) as e:
            out(type=type(e).__name__, error=str(e), free=dht._averager is None)
            return
        out(me=a.peer_id)
        a.shutdown()
    elif scenario == "adaptive":
        # ARGS: k, weight. One round in a group of 2 under
        # SizeAdaptiveCompression(1000, NoCompression, Float16Compression)
        # over adaptive_tensors_of(k); prints the result's float32 bytes.
        k, weight = int(rest[0]), float(rest[1])
        size = hivemind.SizeAdaptiveCompression(1000, less=hivemind.NoCompression(),
                                                greater_equal=hivemind.Float16Compression())
        a = hivemind.DecentralizedAverager(
            adaptive_tensors_of(k), dht, start=True, prefix="test/sideplan",
            target_group_size=2, min_group_size=2, min_matchmaking_time=1.0,
            request_timeout=0.5, allreduce_timeout=5.0, compression=size)
        got = a.step(weight=weight, timeout=60)
        with a.get_tensors() as t:
            out(me=a.peer_id, ok=got is not None, tensors=[x.tolist() for x in t],
                raw=b"".join(x.contiguous().numpy().tobytes() for x in t).hex())
        a.shutdown()
    elif scenario == "donor":
        # ARGS: k, priority. Shares state_tensors_of(k) until killed; its
        # snapshot comes from get_current_state in this process.
        k, priority = int(rest[0]), float(rest[1])
        a = hivemind.DecentralizedAverager(
            state_tensors_of(k), dht, start=True, prefix="test/sidestate",
            min_matchmaking_time=5.0, request_timeout=2.0, declare_state_period=5)
        a.state_sharing_priority = priority
        out(ready=a.peer_id)
        while True:
            time.sleep(1)
    elif scenario == "loader":
        # Loads the state of the highest donor; prints its tensors' sums.
        a = hivemind.DecentralizedAverager(
            state_tensors_of(99), dht, start=True, prefix="test/sidestate",
            min_matchmaking_time=5.0, request_timeout=2.0, allow_state_sharing=False)
        deadline = time.monotonic() + 60
        got = None
        while got is None and time.monotonic() < deadline:
            got = a.load_state_from_peers(timeout=10)
        assert got is not None, a.last_load_error
        metadata, tensors = got
        out(me=a.peer_id, sums=[float(t.double().sum()) for t in tensors],
            shapes=[list(t.shape) for t in tensors])
        a.shutdown()
    else:
        raise SystemExit("unknown scenario " + scenario)


if __name__ == "__main__":
    main()
