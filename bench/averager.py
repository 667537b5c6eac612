#!/usr/bin/env python3
"""bench/averager.py: hivemind's DecentralizedAverager on cohort against
cohort's plain all-reduce, in the same run, on loopback.

- averager: --peers processes (8) average --mib MiB of float32 each in
  groups of --group (4), matchmade by the broker every round
  (cohort.hivemind, group bits that keep groups of --group).
  With --compression A,B,... (hivemind's class names: NoCompression,
  Float16Compression, ScaledFloat16Compression, BlockwiseQuantization,
  Uniform8BitQuantization, Quantile8BitQuantization, or PerTensor: the
  vector as two tensors, the first half under NoCompression and the
  second under Float16Compression, by PerTensorCompression, so a codec
  per tensor in one step; its exact half runs as a butterfly, as a call
  that another follows must, and its fp16 half on the ring) the
  averagers run a set of rounds with each in turn, a row each. With --butterfly each
  codec runs a further set with bandwidth=1 on every peer, which puts
  the round on the butterfly all-reduce (equal parts; with a codec each
  contribution and each part's result encoded once) instead of the
  ring: rows "algorithm": "butterfly", and each one's ratio to the ring's
  row of the same codec.
- allreduce: --group processes (4) all-reduce the same size with the
  group collective (the engine the Accumulator runs, through
  cohort._cohort.Group; no matchmaking).

Both sets of processes live through the whole run and take turns: every
process waits at a barrier before each turn, so one set runs alone.
Prints one JSON object per system: the median over --reps of the slowest
process's milliseconds per round, and, for the averager, the median
matchmaking time (from the request to the broker until the group
formed, as the averager measures it); then the ratio of the two.
hivemind itself is not installed here, so it is not in the table.

    make -j2 all python
    /usr/bin/python3 bench/averager.py --peers 8 --group 4 --mib 16 --reps 5
    /usr/bin/python3 bench/averager.py --compression \
        NoCompression,Float16Compression,BlockwiseQuantization
    /usr/bin/python3 bench/averager.py --butterfly
"""
import argparse
import json
import math
import multiprocessing
import os
import queue
import statistics
import sys
import time

from benchlib import BUILD, start_broker, wait_members

sys.path.insert(0, os.path.join(BUILD, "python"))
BUTTERFLY = "butterfly:"        # a variant's prefix: the codec on the butterfly
PER_TENSOR = "PerTensor"        # half the vector exact, half fp16, in one step


def averager_child(a, broker, k, turns, out):
    import torch
    import cohort.hivemind as hivemind
    torch.set_num_threads(1)
    n = a.mib * (1 << 20) // 4
    nbits = int(math.log2(a.peers // a.group))
    bits = format(k // a.group, "0%db" % nbits) if nbits else ""
    for codec in a.variants:
        # One averager per variant, each its own peer and prefix.
        dht = hivemind.DHT(initial_peers=[broker], start=True, cohort="bench-avg",
                           peer_id="avg-%d-%s" % (k, codec.replace(":", "-")))
        butterfly = codec.startswith(BUTTERFLY)
        name = codec[len(BUTTERFLY):] if butterfly else codec
        if name == PER_TENSOR:
            tensors = [torch.full((n // 2,), float(k)), torch.full((n - n // 2,), float(k))]
            compression = hivemind.PerTensorCompression(
                [hivemind.NoCompression(), hivemind.Float16Compression()])
        else:
            tensors = [torch.full((n,), float(k))]
            compression = getattr(hivemind, name)()
        av = hivemind.DecentralizedAverager(
            tensors, dht, start=True,
            prefix="bench-" + codec.replace(":", "-"),
            target_group_size=a.group, min_group_size=a.group, initial_group_bits=bits,
            min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=60,
            compression=compression, bandwidth=1.0 if butterfly else None)
        times = []
        for rep in range(a.reps + 1):
            turns.wait()                # the averagers' turn
            t0 = time.perf_counter()
            got = av.step(timeout=120)
            ms = (time.perf_counter() - t0) * 1000
            if got is None or len(got) != a.group:
                raise SystemExit("round %d: %s" % (rep, got))
            if rep:                     # the first round warms connections up
                times.append((ms, av.last_group[3] * 1000))
            turns.wait()                # the all-reduce's turn
        out.put(("averager", k, codec, times))
        av.shutdown()
        dht.shutdown()


def allreduce_child(a, broker, k, turns, out):
    import torch
    from cohort import _cohort
    torch.set_num_threads(1)
    n = a.mib * (1 << 20) // 4
    g = _cohort.Group(broker, "bench-ar", "ar-%d" % k)
    wait_members(lambda: (g.position() or (0, 0))[1], a.group)
    t = torch.full((n,), float(k))
    buf = memoryview(t.view(torch.uint8).numpy())
    times = []
    for rep in range(len(a.variants) * (a.reps + 1)):
        turns.wait()
        turns.wait()
        t0 = time.perf_counter()
        g.allreduce(buf, n, _cohort.G_F32, _cohort.OP_AVG, 0.0, 0, 300000)
        ms = (time.perf_counter() - t0) * 1000
        if rep % (a.reps + 1):
            times.append((ms, 0.0))
    out.put(("allreduce", k, None, times))
    g.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--operator", default=os.path.join(BUILD, "cohort-operator"),
                    help="the cohort-operator binary that serves the broker")
    ap.add_argument("--log-dir", default=os.path.join(BUILD, "bench"))
    ap.add_argument("--compression", default="NoCompression",
                    help="comma-separated: NoCompression, Float16Compression, "
                         "ScaledFloat16Compression, BlockwiseQuantization, "
                         "Uniform8BitQuantization, Quantile8BitQuantization, PerTensor "
                         "(half NoCompression, half Float16Compression)")
    ap.add_argument("--butterfly", action="store_true",
                    help="one more set of rounds per codec on the butterfly (bandwidth=1 "
                         "everywhere)")
    a = ap.parse_args()
    a.compression = a.compression.split(",")
    known = ("NoCompression", "Float16Compression", "ScaledFloat16Compression",
             "BlockwiseQuantization", "Uniform8BitQuantization", "Quantile8BitQuantization",
             PER_TENSOR)
    if not all(c in known for c in a.compression) or len(set(a.compression)) != len(
            a.compression):
        ap.error("--compression takes distinct names among " + ", ".join(known))
    if a.group < 2 or a.peers < a.group or a.mib < 1 or a.reps < 1:
        ap.error("need --group >= 2, --peers >= --group, --mib >= 1, --reps >= 1")
    if a.peers % a.group or (a.peers // a.group) & (a.peers // a.group - 1):
        ap.error("--peers must be --group times a power of two")
    a.variants = a.compression + ([BUTTERFLY + c for c in a.compression] if a.butterfly else [])
    os.makedirs(a.log_dir, exist_ok=True)
    broker, address = start_broker(os.path.join(a.log_dir, "averager-broker.log"), a.operator)
    ctx = multiprocessing.get_context("spawn")
    turns = ctx.Barrier(a.peers + a.group)
    out = ctx.Queue()
    procs = [ctx.Process(target=averager_child, args=(a, address, k, turns, out))
             for k in range(a.peers)]
    procs += [ctx.Process(target=allreduce_child, args=(a, address, k, turns, out))
              for k in range(a.group)]
    try:
        for p in procs:
            p.start()
        got, end = [], time.monotonic() + 1800
        while len(got) < a.peers * len(a.variants) + a.group:
            try:
                got.append(out.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode for p in procs) or time.monotonic() > end:
                    raise SystemExit("a process failed or the run took too long") from None
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit("a process failed")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        broker.terminate()
        broker.wait()
    res = {}
    # The all-reduce ran reps rounds beside each codec's: all of them count.
    rounds = {"allreduce": a.reps * len(a.variants)}
    for system, codec in [("averager", c) for c in a.variants] + [("allreduce", None)]:
        runs = [times for s, _, c, times in got if s == system and c == codec]
        n = rounds.get(system, a.reps)
        slowest = [max(r[i][0] for r in runs) for i in range(n)]
        mm = [max(r[i][1] for r in runs) for i in range(n)]
        res[codec] = statistics.median(slowest)
        row = {"system": system, "peers": len(runs),
               "group": a.group, "mib": a.mib, "ms_per_round": round(res[codec], 1)}
        if system == "averager":
            butterfly = codec.startswith(BUTTERFLY)
            row["compression"] = codec[len(BUTTERFLY):] if butterfly else codec
            row["algorithm"] = "butterfly" if butterfly else "ring"
            row["matchmaking_ms"] = round(statistics.median(mm), 1)
        print(json.dumps(row), flush=True)
    for codec in a.compression:
        print(json.dumps({"averager/allreduce": round(res[codec] / res[None], 2),
                          "compression": codec}))
    for codec in a.compression if a.butterfly else []:
        print(json.dumps({"averager/allreduce": round(res[BUTTERFLY + codec] / res[None], 2),
                          "compression": codec, "algorithm": "butterfly"}))
    for codec in a.compression if a.butterfly else []:
        print(json.dumps({"butterfly/ring": round(res[BUTTERFLY + codec] / res[codec], 2),
                          "compression": codec}))


if __name__ == "__main__":
    main()
