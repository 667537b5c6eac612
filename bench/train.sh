#!/bin/sh
# bench/train.sh: training steps per second of the PyTorch example's MLP
# (examples/pytorch/train.py) through cohort's Accumulator, against the same
# model, data and optimizer under torch.distributed DDP with Gloo, with 2 and
# 4 local peers, in the same run. Every configuration runs REPS times,
# interleaved, so that a noisy neighbour slows both alike; the table shows
# medians.
#
#   bench/train.sh
#   PEERS="2 4" HIDDEN="128 256" REPS=3 STEPS=200 bench/train.sh
#
# cohort runs under `cohortctl run` (a broker, one sidecar per trainer, the
# tensors in shared memory); DDP's processes meet on 127.0.0.1. One torch
# thread per process (Debian's torch uses a generic BLAS, so wide layers
# measure the BLAS, not the exchange). Environment: PEERS, HIDDEN (hidden
# widths, default "128 256"), REPS
# (default 3), STEPS (timed steps, default 200), WARMUP (default 20),
# VB (samples per step, shared by the peers, default 256), BUILD (the build
# directory, default build).
set -eu

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS=${PEERS:-"2 4"}
HIDDEN=${HIDDEN:-"128 256"}
REPS=${REPS:-3}
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-20}
VB=${VB:-256}
PYTHON=/usr/bin/python3         # Debian's, which python3-torch installs into
BUILD=${BUILD:-build}
case $BUILD in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
OUT=$BUILD/bench
mkdir -p "$OUT"

# The release build and the package (python/python.mk, which the Makefile
# includes; included here by hand where it does not yet).
if grep -q 'python/python.mk' Makefile; then
    make -j2 BUILD="$BUILD" all python >&2
else
    make -j2 BUILD="$BUILD" -f Makefile -f python/python.mk all python >&2
fi
export PYTHONPATH="$BUILD/python"
export OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo

RAW="$OUT/train-raw.jsonl"
: >"$RAW"
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
r=1
while [ "$r" -le "$REPS" ]; do
    for h in $HIDDEN; do
        for n in $PEERS; do
            echo "train.sh: rep $r, hidden $h, $n peers" >&2
            args="--hidden $h --steps $STEPS --warmup $WARMUP --virtual-batch $VB --peers $n"
            # shellcheck disable=SC2086
            "$BUILD/cohortctl" run -n "$n" --no-view -o json -- \
                "$PYTHON" bench/train_step.py cohort $args |
                "$PYTHON" -c 'import json,sys
s = json.loads(sys.stdin.read().strip().splitlines()[-1])
lines = [p["last_line"] for p in s["peers"] if p["last_line"].startswith("{")]
assert lines, s
print(lines[0])' | sed "s/^{/{\"rep\":$r,/" >>"$RAW"
            # shellcheck disable=SC2086
            "$PYTHON" bench/train_step.py ddp $args | sed -n "s/^{/{\"rep\":$r,/p" >>"$RAW"
        done
    done
    r=$((r + 1))
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

echo "Machine: $(nproc) CPUs, $(uname -r); load average at start $LOAD_START, at end $LOAD_END"
echo "MLP 32-H-H-10 with BatchNorm, Adam, $VB samples per step shared by the peers, $STEPS steps after $WARMUP, median of $REPS"
"$PYTHON" - "$RAW" <<'PYEOF'
import json, statistics, sys
from collections import defaultdict

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
data = defaultdict(list)
params = {}
for r in rows:
    data[(r["system"], r["hidden"], r["peers"])].append(r["steps_per_s"])
    params[r["hidden"]] = r["params"]
med = lambda xs: statistics.median(xs) if xs else float("nan")
print()
print("| hidden | params | peers | cohort steps/s | DDP (gloo) steps/s | cohort/DDP |")
print("|---:|---:|---:|---:|---:|---:|")
for h, n in sorted({(h, n) for (_, h, n) in data}):
    c, d = med(data[("cohort", h, n)]), med(data[("ddp", h, n)])
    print(f"| {h} | {params[h]:,} | {n} | {c:.1f} | {d:.1f} | {c / d:.2f} |")
print(f"\nRaw results: {sys.argv[1]}")
PYEOF
