#!/usr/bin/env python3
"""bench/avlink.py: hivemind's averager through the pod's sidecar against
the same averager in process, in the same run, on loopback.

--peers processes (4) each hold two averagers of --mib MiB of float32
(16): one in its own process (DHT(initial_peers=[broker])) and one hosted
by a cohort-sidecar of its own (DHT(initial_peers=["unix:PATH"]), as a
Kubernetes cohort's trainer reaches it). All of them average in one group
of --peers per round, the two kinds taking turns at a barrier, so one
kind runs alone. The sidecar's rounds add what the link costs: the copy
of the vector into the shared memfd and back, and a round trip on the
socket (no tensor byte crosses it).

Prints one JSON object per kind: the median over --reps of the slowest
process's milliseconds per round (the first round, which connects, is
left out), then the ratio sidecar/in-process.

    make -j2 all python
    /usr/bin/python3 bench/avlink.py --peers 4 --mib 16 --reps 5
"""
import argparse
import json
import multiprocessing
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import BUILD, start_broker

sys.path.insert(0, os.path.join(BUILD, "python"))
KINDS = ("in_process", "sidecar")


def child(a, broker, sock, k, turns, out):
    import torch
    import cohort.hivemind as hivemind
    torch.set_num_threads(1)
    n = a.mib * (1 << 20) // 4
    avs = {}
    for kind, route in (("in_process", broker), ("sidecar", "unix:" + sock)):
        dht = hivemind.DHT(initial_peers=[route], start=True, cohort="bench-avl",
                           peer_id="avl-%d" % k)
        avs[kind] = hivemind.DecentralizedAverager(
            [torch.full((n,), float(k))], dht, start=True, prefix="bench-" + kind,
            target_group_size=a.peers, min_group_size=a.peers, min_matchmaking_time=1.0,
            request_timeout=0.5, allreduce_timeout=60)
    times = {kind: [] for kind in KINDS}
    for rep in range(a.reps + 1):
        for kind in KINDS:
            turns.wait()
            t0 = time.perf_counter()
            got = avs[kind].step(timeout=120)
            ms = (time.perf_counter() - t0) * 1000
            if got is None or len(got) != a.peers:
                raise SystemExit("%s round %d: %s" % (kind, rep, got))
            if rep:
                times[kind].append(ms)
    out.put((k, times))
    for av in avs.values():
        av.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--log-dir", default=os.path.join(BUILD, "bench"))
    a = ap.parse_args()
    if a.peers < 2 or a.mib < 1 or a.reps < 1:
        ap.error("need --peers >= 2, --mib >= 1, --reps >= 1")
    os.makedirs(a.log_dir, exist_ok=True)
    broker, address = start_broker(os.path.join(a.log_dir, "avlink-broker.log"))
    tmp = tempfile.mkdtemp(prefix="cohort-avl-", dir="/tmp")
    sidecars, procs = [], []
    ctx = multiprocessing.get_context("spawn")
    turns = ctx.Barrier(a.peers)
    out = ctx.Queue()
    try:
        for k in range(a.peers):
            sock = os.path.join(tmp, "s%d" % k)
            log = open(os.path.join(a.log_dir, "avlink-sidecar-%d.log" % k), "w")
            sidecars.append(subprocess.Popen(
                [os.path.join(BUILD, "cohort-sidecar"), "--broker", address, "--cohort",
                 "bench-avl", "--id", "pod-%d" % k, "--socket", sock, "--log-format", "json"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log))
            end = time.monotonic() + 60
            while not os.path.exists(sock):
                if time.monotonic() > end or sidecars[-1].poll() is not None:
                    raise SystemExit("sidecar %d did not start" % k)
                time.sleep(0.02)
            procs.append(ctx.Process(target=child, args=(a, address, sock, k, turns, out)))
        for p in procs:
            p.start()
        got, end = [], time.monotonic() + 1800
        while len(got) < a.peers:
            try:
                got.append(out.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode for p in procs) or time.monotonic() > end:
                    raise SystemExit("a process failed or the run took too long") from None
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for s in sidecars:
            s.terminate()
            s.wait()
        broker.terminate()
        broker.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    res = {}
    for kind in KINDS:
        slowest = [max(t[kind][i] for _, t in got) for i in range(a.reps)]
        res[kind] = statistics.median(slowest)
        print(json.dumps({"system": "averager", "via": kind, "peers": a.peers, "mib": a.mib,
                          "ms_per_round": round(res[kind], 1)}), flush=True)
    print(json.dumps({"sidecar/in_process": round(res["sidecar"] / res["in_process"], 2)}))


if __name__ == "__main__":
    main()
