#!/bin/sh
# bench/compression.sh: cohort's all-reduce with each codec against none,
# in the same run: 64 MiB of float32 (SIZES), 4 peers (PEERS), one process
# per member on loopback TCP, each codec run in turn inside every
# repetition so that a noisy neighbour slows all of them alike. The table
# shows medians: time per all-reduce, payload bytes one member sends per
# all-reduce (cohortctl's wire_bytes), and both as ratios to none. Then
# the codec kernels of this build (bench/codec_kernels.c), every
# instruction set this CPU has, checked byte for byte against the
# baseline (same_bytes), the vectorised code the sanitized unit tests do
# not run. topk and powersgd are timed per whole round (selection or
# matrix products, exchange, error feedback) on 4 processes sharing the
# machine's cores, so on a small machine their CPU work counts as it would
# on a loaded host; their wire_bytes are their exchanges' (cohortctl bench
# allreduce --help).
#
#   bench/compression.sh
#   PEERS="2 4" SIZES="4M 64M" REPS=7 bench/compression.sh
#
# Environment: PEERS (default 4), SIZES (default 64M), REPS (default 5),
# CODECS (default "none fp16 bf16 int8 topk powersgd"), TOPK_RATIO (default
# 0.01), RANK (PowerSGD's, default 4), COHORTCTL (default build/cohortctl,
# built here).
set -eu

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS=${PEERS:-4}
SIZES=${SIZES:-64M}
REPS=${REPS:-5}
CODECS=${CODECS:-"none fp16 bf16 int8 topk powersgd"}
TOPK_RATIO=${TOPK_RATIO:-0.01}
RANK=${RANK:-4}
COHORTCTL=${COHORTCTL:-$ROOT/build/cohortctl}
OUT=$ROOT/build/bench
mkdir -p "$OUT"

if [ "$COHORTCTL" = "$ROOT/build/cohortctl" ]; then
    make -j2 all >&2
fi
cc -O2 -Isrc -Iinclude -o "$OUT/codec_kernels" bench/codec_kernels.c build/lib/libcohort-core.a -lm

RAW="$OUT/compression-raw.jsonl"
: >"$RAW"
comma=$(echo "$SIZES" | tr ' ' ',')
echo "compression.sh: $REPS repetitions of: for N in $PEERS: $CODECS" >&2
rep=1
while [ "$rep" -le "$REPS" ]; do
    for n in $PEERS; do
        for codec in $CODECS; do
            "$COHORTCTL" bench allreduce --peers "$n" --bytes "$comma" --codec "$codec" \
                --topk-ratio "$TOPK_RATIO" --rank "$RANK" -o json |
                sed -n "s/^{\(.*\)}\$/{\"rep\":$rep,\1}/p" >>"$RAW"
        done
    done
    rep=$((rep + 1))
done

/usr/bin/python3 - "$RAW" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = sorted({(r["peers"], r["bytes"]) for r in rows})
codecs = []
for r in rows:
    if r["codec"] not in codecs:
        codecs.append(r["codec"])
print("| peers | bytes | codec | time_ms | wire_bytes | time / none | wire / none |")
print("|---:|---:|---|---:|---:|---:|---:|")
for peers, size in keys:
    med = {}
    for c in codecs:
        sel = [r for r in rows if r["peers"] == peers and r["bytes"] == size and r["codec"] == c]
        if sel:
            med[c] = (statistics.median(r["time_ms"] for r in sel), sel[0]["wire_bytes"])
    base = med.get("none")
    for c, (t, w) in med.items():
        rt = "%.2f" % (t / base[0]) if base else "-"
        rw = "%.3f" % (w / base[1]) if base else "-"
        print("| %d | %d | %s | %.2f | %d | %s | %s |" % (peers, size, c, t, w, rt, rw))
PY

echo >&2
echo "compression.sh: codec kernels of this build (GB/s of float32; same_bytes vs baseline)" >&2
"$OUT/codec_kernels" --reps 5 >"$OUT/codec-kernels.jsonl"
/usr/bin/python3 - "$OUT/codec-kernels.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print()
print("| codec | kernel | bytes | variant | GB/s | same_bytes |")
print("|---|---|---:|---|---:|---|")
for r in rows:
    print("| %s | %s | %d | %s | %.2f | %s |" % (r["codec"], r["kernel"], r["bytes"], r["variant"],
                                               r["gbs"], r["same_bytes"]))
bad = [r for r in rows if not r["same_bytes"]]
if bad:
    sys.exit("compression.sh: a kernel variant wrote other bytes than the baseline")
PY
