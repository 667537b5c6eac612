#!/usr/bin/env python3
"""bench/aggregation.py: mlbench's gradient aggregation, by model and by
layer, through cohort.aggregation against the same aggregation through
torch.distributed with Gloo (what mlbench itself runs on CPUs), with N
local processes on loopback, in the same run.

The model is `--layers` Linear(width, width) layers (float32); each
aggregation averages every gradient ("avg"). by_model packs the gradients
into one buffer and runs one all-reduce (mlbench's pack_tensors); by_layer
runs one all-reduce per tensor (weight and bias: 2 per layer) in Gloo,
and one call with the layers kept apart in cohort. Prints one
JSON object per (system, mode): the mean milliseconds per aggregation of
the slowest process. The compressed systems run mlbench's
SparsifiedAggregation (cohort-topk: top-k with error feedback, --ratio)
and PowerAggregation (cohort-power: PowerSGD with warm start, --rank) on
the same model; they are left out unless --compressed is given.

    make -j2 all python
    /usr/bin/python3 bench/aggregation.py --peers 2 --layers 8 --width 512
    BUILD=build /usr/bin/python3 bench/aggregation.py --peers 4 --iters 30
"""
import argparse
import json
import os
import subprocess
import time

from benchlib import BUILD, free_port, start_broker, wait_members

PYTHON = "/usr/bin/python3"


def model(layers, width):
    import torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    return m


def timed(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1000 / iters


def child_cohort(a):
    import cohort.aggregation as agg
    agg.init(a.broker, "bench", "b-%d" % a.rank)
    wait_members(agg.world_size, a.peers)
    m = model(a.layers, a.width)
    if a.child == "cohort-topk":
        ag = agg.SparsifiedAggregation(m, ratio=a.ratio)
    elif a.child == "cohort-power":
        ag = agg.PowerAggregation(m, reuse_query=True, world_size=a.peers, rank=a.power_rank)
    else:
        ag = agg.AllReduceAggregation(a.peers)
    out = {}
    for mode, by_layer in (("by_model", False), ("by_layer", True)):
        f = ag.agg_grad(by_layer)
        out[mode] = timed(lambda: f(m, "avg"), a.iters, a.warmup)
    print(json.dumps(out), flush=True)
    agg.shutdown()


def child_gloo(a):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % a.port, rank=a.rank,
                            world_size=a.peers)
    m = model(a.layers, a.width)
    grads = [p.grad for p in m.parameters()]

    def by_model():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(a.peers)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def by_layer():
        for g in grads:
            dist.all_reduce(g)
            g.div_(a.peers)

    out = {"by_model": timed(by_model, a.iters, a.warmup),
           "by_layer": timed(by_layer, a.iters, a.warmup)}
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def run(system, a, broker=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.path.join(BUILD, "python"))
    port = free_port()
    kids = []
    for r in range(a.peers):
        argv = [PYTHON, __file__, "--child", system, "--rank", str(r), "--peers", str(a.peers),
                "--layers", str(a.layers), "--width", str(a.width), "--iters", str(a.iters),
                "--warmup", str(a.warmup), "--port", str(port), "--ratio", str(a.ratio),
                "--rank-power", str(a.power_rank)]
        if broker:
            argv += ["--broker", broker]
        kids.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env))
    res = []
    for k in kids:
        out, _ = k.communicate(timeout=600)
        if k.returncode != 0:
            raise SystemExit("%s child failed" % system)
        res.append(json.loads(out.strip().splitlines()[-1]))
    for mode in ("by_model", "by_layer"):
        extra = {"ratio": a.ratio} if system == "cohort-topk" else \
            {"rank": a.power_rank} if system == "cohort-power" else {}
        print(json.dumps({"system": system, "mode": mode, "peers": a.peers, "layers": a.layers,
                          **extra,
                          "width": a.width,
                          "bytes": a.layers * (a.width * a.width + a.width) * 4,
                          "ms": round(max(r[mode] for r in res), 3)}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--child")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--broker")
    ap.add_argument("--compressed", action="store_true",
                    help="also run cohort-topk and cohort-power")
    ap.add_argument("--ratio", type=float, default=0.01, help="top-k: fraction sent")
    ap.add_argument("--rank-power", dest="power_rank", type=int, default=4,
                    help="PowerSGD's rank")
    a = ap.parse_args()
    if a.child in ("cohort", "cohort-topk", "cohort-power"):
        return child_cohort(a)
    if a.child == "gloo":
        return child_gloo(a)
    os.makedirs(os.path.join(BUILD, "bench"), exist_ok=True)
    broker, address = start_broker(os.path.join(BUILD, "bench", "aggregation-broker.log"))
    try:
        run("cohort", a, address)
        if a.compressed:
            run("cohort-topk", a, address)
            run("cohort-power", a, address)
        run("gloo", a)
    finally:
        broker.terminate()
        broker.wait()


if __name__ == "__main__":
    main()
