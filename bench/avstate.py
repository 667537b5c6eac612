#!/usr/bin/env python3
"""bench/avstate.py: load_state_from_peers with one top donor against equal
donors sharing the load, in the same run, on loopback.

--donors processes (3) each share the same --mib MiB state (float32)
through cohort.hivemind; --newcomers processes (3) then call
load_state_from_peers() at the same moment, --reps times in each of two
settings:
- one: the first donor has priority 2 and the others 1, so every
  newcomer downloads from that one donor, as every hivemind newcomer
  downloads from the single best peer (hivemind's issue 169);
- equal: every donor has priority 1, so each newcomer fetches a share of
  the parts from each.
Prints one JSON object per setting: the median over --reps of the
slowest newcomer's milliseconds per load and the parts served by the
busiest donor per round; then the ratios. hivemind itself is not
installed here, so it is not in the table; "one" is its policy run on
cohort's transport.

    make -j2 all
    /usr/bin/python3 bench/avstate.py --donors 3 --newcomers 3 --mib 64 --reps 5
"""
import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BUILD = os.path.abspath(os.environ.get("BUILD", os.path.join(ROOT, "build")))
sys.path.insert(0, os.path.join(BUILD, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import start_broker  # noqa: E402

SETTINGS = ("one", "equal")


def averager(broker, peer, tensors):
    import cohort.hivemind as hivemind
    dht = hivemind.DHT(initial_peers=[broker], start=True, cohort="bench-state", peer_id=peer)
    return hivemind.DecentralizedAverager(tensors, dht, start=True, prefix="bench-state",
                                          min_matchmaking_time=5.0, request_timeout=4.0,
                                          declare_state_period=2)


def donor_child(a, broker, k, turns, out):
    import torch
    torch.set_num_threads(1)
    av = averager(broker, "donor-%d" % k, [torch.arange(a.mib << 18, dtype=torch.float32)])
    served = []
    for setting in SETTINGS:
        av.state_sharing_priority = 2 if setting == "one" and k == 0 else 1
        turns.wait()                    # every donor has set its priority
        time.sleep(2 * 2 + 1)           # re-declared within one period (2 s)
        turns.wait()                    # the newcomers may start
        for rep in range(a.reps + 1):
            before = av.state_parts_served
            turns.wait()                # a round starts
            turns.wait()                # and ends
            if rep:
                served.append((setting, av.state_parts_served - before))
    out.put(("donor", k, served))
    turns.wait()
    av.shutdown()


def newcomer_child(a, broker, k, turns, out):
    import torch
    torch.set_num_threads(1)
    av = averager(broker, "new-%d" % k, [torch.zeros(1)])
    av.allow_state_sharing = False
    times = []
    for setting in SETTINGS:
        turns.wait()
        turns.wait()
        for rep in range(a.reps + 1):
            turns.wait()
            t0 = time.perf_counter()
            got = av.load_state_from_peers(timeout=300)
            ms = (time.perf_counter() - t0) * 1000
            if got is None or got[1][0].numel() != a.mib << 18:
                raise SystemExit("load %d failed: %s" % (rep, av.last_load_error))
            turns.wait()
            if rep:                     # the first load warms up
                times.append((setting, ms))
    out.put(("newcomer", k, times))
    turns.wait()
    av.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--donors", type=int, default=3)
    ap.add_argument("--newcomers", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--operator", default=os.path.join(BUILD, "cohort-operator"),
                    help="the cohort-operator binary that serves the broker")
    ap.add_argument("--log-dir", default=os.path.join(BUILD, "bench"))
    a = ap.parse_args()
    if a.donors < 2 or a.newcomers < 1 or not 1 <= a.mib <= 1000 or a.reps < 1:
        ap.error("need --donors >= 2, --newcomers >= 1, --mib in 1..1000, --reps >= 1")
    os.makedirs(a.log_dir, exist_ok=True)
    broker_proc, broker = start_broker(os.path.join(a.log_dir, "avstate-broker.log"), a.operator)
    ctx = multiprocessing.get_context("spawn")
    turns = ctx.Barrier(a.donors + a.newcomers, timeout=600)
    out = ctx.Queue()
    procs = [ctx.Process(target=donor_child, args=(a, broker, k, turns, out))
             for k in range(a.donors)]
    procs += [ctx.Process(target=newcomer_child, args=(a, broker, k, turns, out))
              for k in range(a.newcomers)]
    try:
        for p in procs:
            p.start()
        got = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit("a process failed (exit %s)" % p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        broker_proc.kill()
        broker_proc.wait()
    rows = {}
    for setting in SETTINGS:
        # Each child's list holds its rounds of each setting in order.
        loads = [[ms for s, ms in t if s == setting] for kind, _, t in got if kind == "newcomer"]
        parts = [[n for s, n in t if s == setting] for kind, _, t in got if kind == "donor"]
        slowest = [max(per[rep] for per in loads) for rep in range(a.reps)]
        busiest = [max(per[rep] for per in parts) for rep in range(a.reps)]
        rows[setting] = {"setting": setting, "donors": a.donors, "newcomers": a.newcomers,
                         "mib": a.mib, "load_ms": round(statistics.median(slowest), 1),
                         "busiest_donor_parts": statistics.median(busiest)}
        print(json.dumps(rows[setting]))
    print(json.dumps({"equal_vs_one_load_time": round(rows["equal"]["load_ms"] /
                                                      rows["one"]["load_ms"], 3),
                      "equal_vs_one_busiest_donor": round(
                          rows["equal"]["busiest_donor_parts"] /
                          rows["one"]["busiest_donor_parts"], 3)}))


if __name__ == "__main__":
    main()
