"""One peer of tests/python/test_py_hivemind.py: a cohort.hivemind
averager with real torch tensors, joined to the broker given, running a
scenario and printing one JSON line per result.

    hivemind_child.py BROKER PEER_ID SCENARIO [ARGS...]
"""
import json
import os
import sys
import threading
import time

import torch

import cohort.hivemind as hivemind


def tensors_of(k):
    """Integer-valued tensors of two shapes, distinct per peer k."""
    return [torch.arange(6, dtype=torch.float32) * (k + 1) + 10 * k,
            torch.full((2, 3), float(4 * k), dtype=torch.float32)]


def coded_tensors_of(k):
    """Tensors of two shapes with values no 16-bit float holds exactly."""
    g = torch.Generator().manual_seed(1000 + k)
    return [torch.randn(300, generator=g) * 7.3, torch.rand((4, 5), generator=g) - 0.5]


def adaptive_tensors_of(k):
    """A small integer-valued tensor and a large one of values no 16-bit
    float holds: a size-adaptive codec's two sides."""
    g = torch.Generator().manual_seed(500 + k)
    return [torch.arange(10, dtype=torch.float32) * (k + 2) - 7 * k,
            torch.randn(3000, generator=g) * (3.1 + k)]


def state_tensors_of(k, n=50000):
    """Integer-valued tensors (float16 holds them exactly), distinct per k:
    a state large enough for several 64 KiB parts."""
    return [torch.arange(n, dtype=torch.float32) % 1000 + k,
            torch.full((3, 7), float(k), dtype=torch.float64)]


def out(**kw):
    print(json.dumps(kw), flush=True)


def barrier(directory, name, k, n):
    """Waits until all n peers have reached `name` (a file each in
    directory), so that every peer's round r meets only round r."""
    open(os.path.join(directory, "%s-%d" % (name, k)), "w").close()
    deadline = time.monotonic() + 120
    while sum(f.startswith(name + "-") for f in os.listdir(directory)) < n:
        if time.monotonic() > deadline:
            raise SystemExit("peers never reached " + name)
        time.sleep(0.02)


def averager(dht, tensors, **kw):
    args = dict(start=True, prefix="test/avg", min_matchmaking_time=1.0, request_timeout=0.5,
                allreduce_timeout=5.0)
    args.update(kw)
    return hivemind.averaging.DecentralizedAverager(tensors, dht, **args)


def main():
    broker, peer, scenario = sys.argv[1:4]
    rest = sys.argv[4:]
    dht = hivemind.DHT(initial_peers=[broker], start=True, cohort="hm", peer_id=peer)
    assert dht.peer_id == peer
    if scenario == "weighted":
        # ARGS: k, n, weight, aux (0/1)
        k, n, weight, aux = int(rest[0]), int(rest[1]), float(rest[2]), rest[3] == "1"
        ts = tensors_of(k)
        a = averager(dht, ts, target_group_size=n, min_group_size=n, auxiliary=aux)
        got = a.step(gather={"peer": peer, "k": k}, weight=weight, timeout=60)
        with a.get_tensors() as t:
            out(gathered=got, tensors=[x.tolist() for x in t], last=a.last_group[2])
        a.shutdown()
    elif scenario == "mix":
        # ARGS: k, bits, rounds, barrier directory, peers
        k, bits, rounds, directory, n = int(rest[0]), rest[1], int(rest[2]), rest[3], int(rest[4])
        ts = [torch.full((4,), float(8 * k), dtype=torch.float32)]
        a = averager(dht, ts, target_group_size=2, min_group_size=2, initial_group_bits=bits)
        for r in range(rounds):
            barrier(directory, "round%d" % r, k, n)
            got = a.step(weight=1, timeout=60)
            out(round=r, group=sorted(got) if got else None, bits=a.get_group_bits())
        with a.get_tensors() as t:
            out(tensors=[x.tolist() for x in t])
        a.shutdown()
    elif scenario == "survivor":
        # ARGS: k. Steps once in a group of up to 3; prints who was averaged.
        k = int(rest[0])
        ts = tensors_of(k)
        a = averager(dht, ts, target_group_size=3, min_group_size=2, allreduce_timeout=3.0)
        control = a.step(gather=peer, weight=1, timeout=60, wait=False)
        got = control.result(timeout=90)
        with a.get_tensors() as t:
            out(gathered=got, tensors=[x.tolist() for x in t], attempts=a.last_group[1])
        a.shutdown()
    elif scenario == "victim":
        k = int(rest[0])
        a = averager(dht, tensors_of(k), target_group_size=3, min_group_size=2,
                     allreduce_timeout=3.0)
        a.step(gather=peer, weight=1, timeout=60)
        out(finished=True)
    elif scenario == "mismatch":
        # Two averagers of this process with different shapes: the second
        # is refused by the broker while the first waits.
        dht2 = hivemind.DHT(initial_peers=[broker], start=True, cohort="hm",
                            peer_id=peer + "-b")
        a = averager(dht, [torch.zeros(4)], target_group_size=2, min_group_size=2)
        b = averager(dht2, [torch.zeros(5)], target_group_size=2, min_group_size=2)
        first = a.step(weight=1, timeout=4, wait=False)
        threading.Event().wait(0.5)
        second = b.step(weight=1, timeout=4, wait=False)
        errors = []
        for c in (second, first):
            try:
                c.result(timeout=30)
                errors.append(None)
            except hivemind.AllreduceException as e:
                errors.append(str(e))
        with b.get_tensors() as t:
            out(errors=errors, untouched=t[0].tolist())
        a.shutdown()
        b.shutdown()
    elif scenario == "coded":
        # ARGS: k, n, compression class name, weight[, offset]. Tensors
        # that are not integers, plus offset; prints the result's float32
        # bytes so that the test compares them across peers.
        k, n, codec, weight = int(rest[0]), int(rest[1]), rest[2], float(rest[3])
        offset = float(rest[4]) if len(rest) > 4 else 0.0
        ts = [t + offset for t in coded_tensors_of(k)]
        a = averager(dht, ts, target_group_size=n, min_group_size=n,
                     compression=getattr(hivemind, codec)())
        got = a.step(gather={"peer": peer, "k": k}, weight=weight, timeout=60)
        with a.get_tensors() as t:
            out(gathered=got, tensors=[x.tolist() for x in t], last=a.last_group[2],
                raw=b"".join(x.contiguous().numpy().tobytes() for x in t).hex())
        a.shutdown()
    elif scenario == "codec_mismatch":
        # Two averagers of this process with the same tensors and different
        # compression, stepping at once: whichever asks second is refused.
        dht2 = hivemind.DHT(initial_peers=[broker], start=True, cohort="hm",
                            peer_id=peer + "-b")
        a = averager(dht, [torch.ones(4)], target_group_size=2, min_group_size=2,
                     compression=hivemind.NoCompression())
        b = averager(dht2, [torch.ones(4)], target_group_size=2, min_group_size=2,
                     compression=hivemind.Float16Compression())
        controls = [x.step(weight=1, timeout=4, wait=False) for x in (a, b)]
        errors = []
        for c in controls:
            try:
                c.result(timeout=30)
                errors.append(None)
            except hivemind.AllreduceException as e:
                errors.append(str(e))
        untouched = []
        for x in (a, b):
            with x.get_tensors() as t:
                untouched.append(t[0].tolist())
        out(errors=errors, untouched=untouched)
        a.shutdown()
        b.shutdown()
    elif scenario == "balanced":
        # ARGS: k, n, weight, aux (0/1), bandwidth ("none" or a number),
        # client (0/1)[, prefix]. One round in a group of n.
        k, n, weight, aux = int(rest[0]), int(rest[1]), float(rest[2]), rest[3] == "1"
        bandwidth = None if rest[4] == "none" else float(rest[4])
        client = rest[5] == "1"
        prefix = rest[6] if len(rest) > 6 else "test/bal"
        a = averager(dht, tensors_of(k), target_group_size=n, min_group_size=n, auxiliary=aux,
                     bandwidth=bandwidth, client_mode=client, prefix=prefix)
        control = a.step(gather=peer, weight=weight, timeout=30, wait=False)
        try:
            got, error = control.result(timeout=90), None
        except hivemind.AllreduceException as e:
            got, error = None, str(e)
        with a.get_tensors() as t:
            out(gathered=got, error=error, tensors=[x.tolist() for x in t],
                order=list(a.last_group[2]) if got else None,
                raw=b"".join(x.contiguous().numpy().tobytes() for x in t).hex())
        a.shutdown()
    elif scenario == "coded_balanced":
        # ARGS: k, n, compression class name, weight, aux (0/1), bandwidth
        # ("none" or a number), client (0/1). One round in a group of n,
        # prefix test/cbal, with tensors that are not integers.
        k, n, codec, weight, aux = int(rest[0]), int(rest[1]), rest[2], float(rest[3]), \
            rest[4] == "1"
        bandwidth = None if rest[5] == "none" else float(rest[5])
        client = rest[6] == "1"
        a = averager(dht, coded_tensors_of(k), target_group_size=n, min_group_size=n,
                     auxiliary=aux, bandwidth=bandwidth, client_mode=client,
                     compression=getattr(hivemind, codec)(), prefix="test/cbal")
        got = a.step(gather=peer, weight=weight, timeout=60)
        with a.get_tensors() as t:
            out(gathered=got, tensors=[x.tolist() for x in t],
                order=list(a.last_group[2]) if got else None,
                last=a.last_group[2] if got else None,
                raw=b"".join(x.contiguous().numpy().tobytes() for x in t).hex())
        a.shutdown()
    elif scenario == "bare":
        # ARGS: n, bandwidth ("none" or a number). An auxiliary peer
        # without tensors: one round in a group of n, with prefix
        # test/bare; prints what it gathered and its (empty) tensors.
        n, bandwidth = int(rest[0]), None if rest[1] == "none" else float(rest[1])
        a = averager(dht, None, target_group_size=n, min_group_size=n, auxiliary=True,
                     bandwidth=bandwidth, prefix="test/bare")
        got = a.step(gather=peer, timeout=30)
        with a.get_tensors() as t:
            out(gathered=got, tensors=list(t), last=a.last_group[2] if got else None)
        a.shutdown()
    elif scenario == "scheduled":
        # ARGS: k, barrier directory. Once both peers are ready, each
        # schedules its step 3 s ahead; prints the time it scheduled, when
        # the step began and ended, and how long its matchmaking took.
        k, directory = int(rest[0]), rest[1]
        a = averager(dht, tensors_of(k), target_group_size=2, min_group_size=2,
                     prefix="test/sched")
        barrier(directory, "ready", k, 2)
        began = time.time()
        when = began + 3.0
        got = a.step(gather=peer, weight=1, scheduled_time=when, timeout=30)
        ended = time.time()
        with a.get_tensors() as t:
            out(gathered=got, when=when, began=began, ended=ended,
                matchmaking=a.last_group[3] if got else None, tensors=[x.tolist() for x in t])
        a.shutdown()
    elif scenario == "donor":
        # ARGS: k, priority. Shares state_tensors_of(k) until killed.
        k, priority = int(rest[0]), float(rest[1])
        a = averager(dht, state_tensors_of(k), min_matchmaking_time=5.0, request_timeout=2.0)
        a.state_sharing_priority = priority
        out(ready=peer)
        while True:
            time.sleep(1)
    else:
        raise SystemExit("unknown scenario " + scenario)


if __name__ == "__main__":
    main()
