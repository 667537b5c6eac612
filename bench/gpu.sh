#!/bin/sh
# bench/gpu.sh: cohort's GPU path against torch.distributed in the same
# run, on this machine's GPUs: two trainers, each with SIZE bytes of
# float32 gradients on a GPU (cohort_use_gpu; bench/gpu_trainer.c) and a
# sidecar of its own under `cohortctl run`, reduced host-staged (device
# to pinned host, the TCP engine on loopback, host to device), against
# two torch.distributed ranks all-reducing the same size on CUDA tensors
# (bench/gpu_torch.py: NCCL with two GPUs or more, gloo's CUDA path with
# one). Each round is timed from the call to the result on the device;
# the table shows medians over REPS runs of ROUNDS rounds each and the
# ratio cohort / torch. Both cohort trainers use the first GPU, so their
# sidecars run with --gpu-reduce host (NCCL takes one GPU per rank): the
# NCCL path is make test-gpu's, with two GPUs.
#
# It skips, saying why and exiting 0, where there is no GPU, no GPU
# support in the build, or no CUDA in PyTorch. Nothing here has run on a
# GPU yet (docs/gpu.md).
#
#   bench/gpu.sh
#   SIZES="4M 64M" ROUNDS=50 REPS=3 bench/gpu.sh
#
# Environment: SIZES (default "4M 64M"), ROUNDS (default 30), WARMUP
# (default 5), REPS (default 3), PYTHON (default /usr/bin/python3).
set -eu

cd "$(dirname "$0")/.."
ROOT=$(pwd)
SIZES=${SIZES:-"4M 64M"}
ROUNDS=${ROUNDS:-30}
WARMUP=${WARMUP:-5}
REPS=${REPS:-3}
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=$ROOT/build/bench
mkdir -p "$OUT"

skip() {
    echo "gpu.sh: skipped: $1" >&2
    exit 0
}

command -v nvidia-smi >/dev/null 2>&1 || skip "no nvidia-smi: no NVIDIA driver on this machine"
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -n 1 || true)
[ -n "$UUID" ] || skip "nvidia-smi lists no GPU"
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null ||
    skip "PyTorch here has no CUDA (torch.cuda.is_available() is False)"
make -j2 all >&2
grep -q COHORT_GPU build/gpu-flags || skip "this build has no GPU support (no cuda.h and nccl.h under CUDA_HOME)"
cc -O2 -Iinclude -o "$OUT/gpu_trainer" bench/gpu_trainer.c build/libcohort.a \
    -lgrpc -lgpr -lprotobuf-c -lcjson -lcurl -lyaml -lcrypto -lpthread -lm

bytes() {
    case $1 in
        *K) echo $((${1%K} * 1024)) ;;
        *M) echo $((${1%M} * 1048576)) ;;
        *) echo "$1" ;;
    esac
}

# cohortctl run starts the sidecar it is given with its own flags: this one
# adds --gpu-reduce host.
printf '#!/bin/sh\nexec "%s" --gpu-reduce host "$@"\n' "$ROOT/build/cohort-sidecar" >"$OUT/sidecar"
chmod +x "$OUT/sidecar"

RAW="$OUT/gpu-raw.jsonl"
: >"$RAW"
rep=1
while [ "$rep" -le "$REPS" ]; do
    for s in $SIZES; do
        n=$(($(bytes "$s") / 4))
        echo "gpu.sh: rep $rep, $s" >&2
        COHORT_GPU_UUID=$UUID build/cohortctl run -n 2 --no-view -o json --sidecar "$OUT/sidecar" -- \
            "$OUT/gpu_trainer" "$n" "$ROUNDS" "$WARMUP" |
            "$PYTHON" -c 'import json, sys
s = json.loads(sys.stdin.read().strip().splitlines()[-1])
lines = [p["last_line"] for p in s["peers"] if p["last_line"].startswith("{")]
assert len(lines) == 2, s
print(lines[0])' >>"$RAW"
        "$PYTHON" bench/gpu_torch.py "$n" "$ROUNDS" "$WARMUP" | grep '^{' >>"$RAW"
    done
    rep=$((rep + 1))
done

echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) ($(nvidia-smi -L | wc -l) visible); median of $REPS runs of $ROUNDS rounds"
"$PYTHON" - "$RAW" <<'PYEOF'
import json, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r["bytes"], r["impl"])].append(r["median_ms"])
print("%10s  %-20s %10s  %s" % ("bytes", "impl", "median_ms", "cohort/torch"))
for b in sorted({k[0] for k in rows}):
    torch_impl = [k for k in rows if k[0] == b and k[1].startswith("torch")]
    base = statistics.median(rows[torch_impl[0]]) if torch_impl else None
    for k in sorted(k for k in rows if k[0] == b):
        m = statistics.median(rows[k])
        ratio = "%.2f" % (m / base) if base and k[1].startswith("cohort") else ""
        print("%10d  %-20s %10.3f  %s" % (b, k[1], m, ratio))
PYEOF
