"""bench/gpu_torch.py: the peer bench/gpu.sh runs beside cohort's GPU path:
torch.distributed all_reduce of N float32 on CUDA tensors between two
processes, ROUNDS times after WARMUP, each round timed from the call to
the result on the device (torch.cuda.synchronize). With two GPUs or more,
NCCL (one GPU per rank); with one, NCCL cannot put two ranks on one device,
so gloo with CUDA tensors, which stages through host memory as cohort's
host-staged path does. Prints one JSON line from rank 0.

    python3 bench/gpu_torch.py N ROUNDS WARMUP
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, n, rounds, warmup, backend, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(backend, rank=rank, world_size=2)
    t = torch.zeros(n, dtype=torch.float32, device=dev)
    ms = []
    for i in range(rounds + warmup):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dist.all_reduce(t)
        t.div_(2)
        torch.cuda.synchronize(dev)
        if i >= warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        print(json.dumps({"impl": "torch-" + backend, "bytes": n * 4, "rounds": rounds,
                          "median_ms": round(statistics.median(ms), 3),
                          "best_ms": round(min(ms), 3)}), flush=True)
    dist.destroy_process_group()


def main():
    n, rounds, warmup = (int(a) for a in sys.argv[1:4])
    if not torch.cuda.is_available():
        print("gpu_torch.py: skipped: torch.cuda.is_available() is False", file=sys.stderr)
        sys.exit(3)
    backend = "nccl" if torch.cuda.device_count() >= 2 and dist.is_nccl_available() else "gloo"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(n, rounds, warmup, backend, port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
