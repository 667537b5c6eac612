#!/usr/bin/env python3
"""bench/allreduce_gloo.py: Gloo's all-reduce (torch.distributed, backend
"gloo", CPU tensors, N processes on loopback) timed the way
`cohortctl bench allreduce` times cohort, for bench/allreduce.sh.

Prints one JSON object per size, as cohortctl does:
{"peers","bytes","time_ms","algbw_gbs","busbw_gbs"}; time_ms is the mean per
all-reduce of the slowest rank.

    /usr/bin/python3 bench/allreduce_gloo.py --peers 4 [--dtype f32] [--iters K] 4K 64M
"""
import argparse
import json
import os
import socket
import sys
import time

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s):
    s = s.strip()
    if s and s[-1].upper() in SUFFIX:
        return int(s[:-1]) * SUFFIX[s[-1].upper()]
    return int(s)


def default_iters(nbytes):
    return max(10, min(1000, (1 << 30) // nbytes))


def member(rank, peers, port, sizes, dtype_name, iters, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dtypes = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
              "bf16": torch.bfloat16, "i32": torch.int32, "i64": torch.int64}
    dtype = dtypes[dtype_name]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=peers)
    esz = torch.tensor([], dtype=dtype).element_size()
    for nbytes in sizes:
        count = nbytes // esz
        k = iters or default_iters(nbytes)
        w = max(2, k // 10)
        t = torch.zeros(count, dtype=dtype)
        for _ in range(w):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(t)
        mine = torch.tensor([(time.perf_counter() - t0) * 1000.0 / k], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if rank == 0:
            ms = mine.item()
            algbw = count * esz / (ms / 1000.0) / 1e9
            out.write(json.dumps({"peers": peers, "bytes": count * esz, "time_ms": round(ms, 4),
                                  "algbw_gbs": round(algbw, 4),
                                  "busbw_gbs": round(algbw * 2 * (peers - 1) / peers, 4)}) + "\n")
            out.flush()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("sizes", nargs="+")
    args = ap.parse_args()
    sizes = [parse_size(x) for part in args.sizes for x in part.split(",") if x]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:      # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(args.peers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                member(rank, args.peers, port, sizes, args.dtype, args.iters, sys.stdout)
            except Exception as e:  # noqa: BLE001 - report and fail the child
                print(f"allreduce_gloo: rank {rank}: {e}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    status = 0
    for pid in pids:
        _, st = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(st) != 0:
            status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
