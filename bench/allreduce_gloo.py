#!/usr/bin/env python3
"""bench/allreduce_gloo.py: Gloo's all-reduce (torch.distributed, backend
"gloo", CPU tensors, N processes on loopback) timed the way
`cohortctl bench allreduce` times cohort, for bench/allreduce.sh.

Prints one JSON object per size, as cohortctl does:
{"peers","bytes","time_ms","algbw_gbs","busbw_gbs"}; time_ms is the mean per
all-reduce of the slowest rank.

    /usr/bin/python3 bench/allreduce_gloo.py --peers 4 [--dtype f32] [--iters K] 4K 64M

With --rank R and --master HOST:PORT this process is rank R alone (each
rank in its own network namespace, say; rank 0 serves the rendezvous at
HOST:PORT, and prints the rows); set GLOO_SOCKET_IFNAME to the interface
the ranks share (default lo).
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


def member(rank, peers, master, sizes, dtype_name, iters, warmup, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dtypes = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16,
              "bf16": torch.bfloat16, "i32": torch.int32, "i64": torch.int64}
    dtype = dtypes[dtype_name]
    dist.init_process_group("gloo", init_method=f"tcp://{master}",
                            rank=rank, world_size=peers)
    esz = torch.tensor([], dtype=dtype).element_size()
    for nbytes in sizes:
        count = nbytes // esz
        k = iters or default_iters(nbytes)
        w = warmup or max(2, k // 10)
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
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--master", default=None, help="HOST:PORT of rank 0's rendezvous")
    ap.add_argument("sizes", nargs="+")
    args = ap.parse_args()
    sizes = [parse_size(x) for part in args.sizes for x in part.split(",") if x]
    if args.peers < 1 or args.iters < 0 or args.warmup < 0:
        ap.error("--peers must be positive, --iters and --warmup not negative")
    if (args.rank is None) != (args.master is None):
        ap.error("--rank and --master go together")
    if args.rank is not None and not 0 <= args.rank < args.peers:
        ap.error("--rank must be below --peers")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.rank is not None:
        member(args.rank, args.peers, args.master, sizes, args.dtype, args.iters, args.warmup,
               sys.stdout)
        return
    with socket.socket() as s:      # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(args.peers):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                member(rank, args.peers, f"127.0.0.1:{port}", sizes, args.dtype, args.iters,
                       args.warmup, sys.stdout)
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
