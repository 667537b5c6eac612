"""hivemind's DecentralizedAverager on a cohort broker: N peers, each in a
process of its own, average their tensors for a few rounds in groups of
two whose group bits mix them, and print what they hold and whom they
averaged with. After log2(N) rounds every peer holds the global mean.
Then a newcomer joins and loads that state from the peers
(load_state_from_peers; a state of many 64 KiB parts would be split
among them, since they share it at equal priority).

    hivemind_average.py BROKER [--peers 4] [--rounds 2]

The cohort's key is $COHORT_SECRET_FILE when the broker has one.
"""
import argparse
import math
import multiprocessing
import os
import sys

import torch

try:
    import cohort.hivemind as hivemind
except ImportError:     # not installed: the package built by `make python`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "build", "python"))
    import cohort.hivemind as hivemind


def peer(broker, k, n, rounds, barrier, out, loaded):
    bits_len = max(1, int(math.log2(n)) - 1)
    bits = format(k >> 1, "0%db" % bits_len)[-bits_len:]
    dht = hivemind.DHT(initial_peers=[broker], start=True, cohort="avg-demo",
                       peer_id="peer-%d" % k)
    tensors = [torch.full((3,), float(k))]
    averager = hivemind.DecentralizedAverager(
        tensors, dht, start=True, prefix="demo", target_group_size=2, min_group_size=2,
        initial_group_bits=bits, min_matchmaking_time=1.0, request_timeout=0.5)
    groups = []
    for _ in range(rounds):
        barrier.wait()      # every peer's round r meets round r
        got = averager.step(gather={"peer": k}, timeout=60)
        groups.append(sorted(got) if got else None)
    with averager.get_tensors() as t:
        out.put((k, t[0].tolist(), groups))
    loaded.wait(timeout=300)    # the newcomer has loaded from us
    averager.shutdown()


def newcomer(broker, out, loaded):
    dht = hivemind.DHT(initial_peers=[broker], start=True, cohort="avg-demo",
                       peer_id="newcomer")
    averager = hivemind.DecentralizedAverager(
        [torch.zeros(3)], dht, start=True, prefix="demo", target_group_size=2,
        min_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5)
    state = averager.load_state_from_peers(timeout=60)
    out.put(None if state is None else state[1][0].tolist())
    loaded.set()
    averager.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("broker")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.peers < 2 or a.peers & (a.peers - 1):
        sys.exit("--peers must be a power of two, at least 2")
    ctx = multiprocessing.get_context("spawn")
    barrier, out, loaded = ctx.Barrier(a.peers), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=peer, args=(a.broker, k, a.peers, a.rounds, barrier, out,
                                            loaded))
             for k in range(a.peers)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=300) for _ in procs)
    for k, values, groups in results:
        print("peer-%d holds %s; groups: %s" % (k, values, groups))
    late = ctx.Process(target=newcomer, args=(a.broker, out, loaded))
    late.start()
    state = out.get(timeout=300)
    print("the newcomer loaded %s" % state)
    for p in procs + [late]:
        p.join()
    if any(p.exitcode != 0 for p in procs + [late]) or any(None in g for _, _, g in results) \
            or state is None:
        sys.exit(1)


if __name__ == "__main__":
    main()
