#!/usr/bin/env python3
"""bench/train_step.py: training steps per second of the PyTorch example's
MLP (examples/pytorch/train.py), through cohort's Accumulator or through
torch.distributed DDP with Gloo, for bench/train.sh.

    cohortctl run -n N -- python3 bench/train_step.py cohort [--hidden H] ...
    python3 bench/train_step.py ddp --peers N [--hidden H] ...

Both run the same model, the same data (each rank's share of --virtual-batch
samples per step), Adam, one torch thread per process, and time --steps
steps after --warmup. A cohort step is one committed round of moolib's loop
(the result applied); a DDP step is forward, backward (Gloo all-reduces the
gradient buckets) and opt.step(). Each prints one JSON line
{"system","peers","hidden","params","steps","seconds","steps_per_s"}: the
cohort trainer of rank 0 as its last stdout line, DDP's rank 0 with the
slowest rank's time.
"""
import argparse
import json
import os
import socket
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "pytorch"))
import train as example  # noqa: E402  (its model, data and cohort import)

moolib = example.moolib


def cohort_member(a):
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    data = example.Data(a.seed)
    model = example.make_model(a.hidden)
    acc = moolib.Accumulator("bench", model.parameters(), model.buffers())
    acc.connect()
    acc.set_virtual_batch_size(a.virtual_batch)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    total = a.warmup + a.steps
    t0 = None
    k = 0
    while True:
        acc.update()
        if not acc.connected():
            time.sleep(0.01)
            continue
        if acc.wants_state():
            acc.set_state({"optimizer": opt.state_dict()})
        if acc.has_new_state():
            opt.load_state_dict(acc.state()["optimizer"])
        v = acc.model_version()
        if acc.wants_gradients() and v < total and (v > 0 or acc.size() >= a.peers):
            n = example.share(a.virtual_batch, acc.rank(), acc.size(), 0)
            x, y = data.batch(v, acc.rank(), k, n)
            k += 1
            torch.nn.functional.cross_entropy(model(x), y).backward()
            acc.reduce_gradients(n)
        if acc.has_gradients():
            opt.step()
            acc.zero_gradients()
            v = acc.model_version()
            if v == a.warmup:
                t0 = time.perf_counter()
            if v == total:
                dt = time.perf_counter() - t0
                rank = acc.rank()
                break
        elif not acc.wants_gradients():
            # Waiting on the cohort: give the core to the sidecars and the
            # other trainers (the example's loop does the same).
            acc.wait(0.1)
    # Serve the others' last round before leaving.
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        acc.update()
        time.sleep(0.01)
    acc.close()
    if rank == 0:
        print(json.dumps(result("cohort", a.peers, a.hidden, model, a.steps, dt)), flush=True)
    else:
        print("rank %d: %.2f steps/s" % (rank, a.steps / dt), flush=True)
    return 0


def result(system, peers, hidden, model, steps, dt):
    return {"system": system, "peers": peers, "hidden": hidden,
            "params": sum(p.numel() for p in model.parameters()), "steps": steps,
            "seconds": round(dt, 4), "steps_per_s": round(steps / dt, 2)}


def ddp_member(rank, a, port):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=a.peers)
    data = example.Data(a.seed)
    model = DDP(example.make_model(a.hidden))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    n = example.share(a.virtual_batch, rank, a.peers, 0)
    for v in range(a.warmup + a.steps):
        if v == a.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        x, y = data.batch(v, rank, 0, n)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps(result("ddp", a.peers, a.hidden, model.module, a.steps, dt.item())),
              flush=True)
    dist.destroy_process_group()


def ddp(a):
    import multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=ddp_member, args=(r, a, port)) for r in range(a.peers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode for p in procs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("system", choices=["cohort", "ddp"])
    ap.add_argument("--peers", type=int, default=int(os.environ.get("BENCH_PEERS", "2")))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--virtual-batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    return cohort_member(a) if a.system == "cohort" else ddp(a)


if __name__ == "__main__":
    sys.exit(main())
