#!/bin/sh
# bench/allreduce.sh: cohort's all-reduce against Gloo (torch.distributed,
# backend gloo) and Open MPI's MPI_Allreduce over loopback TCP, and against
# B, the single-stream loopback TCP throughput, on the same sizes and peer
# counts, in the same run. Every system runs REPS times, interleaved, so
# that a noisy neighbour slows all of them alike; the table shows medians.
#
#   bench/allreduce.sh                        # peers 2 4; sizes 4K 64K 1M 16M 64M
#   PEERS="2 4 8" SIZES="4K 64M" REPS=5 bench/allreduce.sh
#   OTHERS= INTEGRITY="none mac" SIZES="64K 4M 64M" bench/allreduce.sh
#                                             # the cost of --integrity mac alone
#
# Environment: PEERS, SIZES, REPS (default 3), DTYPE (default f32),
# INTEGRITY (cohort's --integrity settings, each run in every repetition;
# default none), OTHERS (the systems to compare with; default "gloo mpi",
# empty for cohort alone), COHORTCTL (default build/cohortctl),
# SKIP_INSTALL=1 to never apt-get.
#
# busbw = algbw * 2(N-1)/N and algbw = bytes / time, as in nccl-tests; GB/s
# of 10^9 bytes. Gloo and Open MPI each get N processes on 127.0.0.1; Open MPI
# is limited to its TCP transport (--mca pml ob1 --mca btl tcp,self), so no
# one uses shared memory.
set -eu

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PEERS=${PEERS:-"2 4"}
SIZES=${SIZES:-"4K 64K 1M 16M 64M"}
REPS=${REPS:-3}
DTYPE=${DTYPE:-f32}
INTEGRITY=${INTEGRITY:-none}
OTHERS=${OTHERS-gloo mpi}
COHORTCTL=${COHORTCTL:-$ROOT/build/cohortctl}
PYTHON=/usr/bin/python3         # Debian's, which python3-torch installs into
OUT=$ROOT/build/bench
mkdir -p "$OUT"

# --- dependencies -----------------------------------------------------------
need=""
pkgs=""
case " $OTHERS " in *" gloo "*) pkgs="python3-torch" ;; esac
case " $OTHERS " in *" mpi "*) pkgs="$pkgs openmpi-bin libopenmpi-dev" ;; esac
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        need="$need $p"
done
if [ -n "$need" ]; then
    if [ "${SKIP_INSTALL:-0}" = 1 ]; then
        echo "allreduce.sh: missing:$need (SKIP_INSTALL=1)" >&2
        exit 1
    fi
    echo "allreduce.sh: installing$need" >&2
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -qq --no-install-recommends $need
fi

# --- builds -----------------------------------------------------------------
if [ "$COHORTCTL" = "$ROOT/build/cohortctl" ]; then
    make -j2 all >&2
fi
case " $OTHERS " in *" mpi "*) mpicc -O2 -o "$OUT/allreduce_mpi" bench/allreduce_mpi.c ;; esac
cc -O2 -Wall -o "$OUT/loopback_tcp" bench/loopback_tcp.c

MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl tcp,self"
comma=$(echo "$SIZES" | tr ' ' ',')
RAW="$OUT/allreduce-raw.jsonl"
: >"$RAW"

# Tags each JSON line of a command's output with the system and repetition.
tag() {
    sys=$1
    rep=$2
    shift 2
    "$@" | sed -n "s/^{\(.*\)}\$/{\"system\":\"$sys\",\"rep\":$rep,\1}/p" >>"$RAW"
}

echo "allreduce.sh: $REPS repetitions of: B, then for N in $PEERS: cohort ($INTEGRITY) $OTHERS" >&2
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
r=1
while [ "$r" -le "$REPS" ]; do
    for chunk in 65536 262144 1048576 4194304; do
        tag loopback "$r" "$OUT/loopback_tcp" --total 2147483648 --chunk "$chunk" --reps 1
    done
    for n in $PEERS; do
        echo "allreduce.sh: rep $r, $n peers" >&2
        for integrity in $INTEGRITY; do
            sys=cohort
            [ "$integrity" = none ] || sys=cohort-$integrity
            tag "$sys" "$r" "$COHORTCTL" bench allreduce --peers "$n" --bytes "$comma" \
                --dtype "$DTYPE" --integrity "$integrity" -o json
        done
        case " $OTHERS " in *" gloo "*)
            tag gloo "$r" env GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 \
                "$PYTHON" bench/allreduce_gloo.py --peers "$n" --dtype "$DTYPE" $SIZES ;;
        esac
        case " $OTHERS " in *" mpi "*)
            # shellcheck disable=SC2086
            tag mpi "$r" $MPIRUN -np "$n" "$OUT/allreduce_mpi" --dtype "$DTYPE" $SIZES ;;
        esac
    done
    r=$((r + 1))
done

LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

# --- the table --------------------------------------------------------------
echo "Machine: $(nproc) CPUs, $(uname -r); load average at start $LOAD_START, at end $LOAD_END"
"$PYTHON" - "$RAW" "$DTYPE" <<'EOF'
import json, statistics, sys
from collections import defaultdict

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
dtype = sys.argv[2]
med = lambda xs: statistics.median(xs) if xs else float("nan")
# B: the best chunk size in each repetition (the highest B is the hardest
# target), then the median over repetitions.
per_rep = defaultdict(list)
for r in rows:
    if r["system"] == "loopback":
        per_rep[r["rep"]].append(r["gbs"])
best = [max(v) for v in per_rep.values()]
B = med(best)
data = defaultdict(list)
for r in rows:
    if r["system"] != "loopback":
        data[(r["system"], r["peers"], r["bytes"])].append(r)
keys = sorted({(p, b) for (_, p, b) in data}, key=lambda k: (k[1], k[0]))

def get(sys_, p, b, field):
    return med([r[field] for r in data.get((sys_, p, b), [])])

def fmt(x, d=3):
    return "n/a" if x != x else f"{x:.{d}f}"

def size(b):
    for unit, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s and b % s == 0:
            return f"{b // s} {unit}"
    return str(b)

print(f"\nB (single-stream loopback TCP, best of 64K/256K/1M/4M chunks): median {B:.3f} GB/s, "
      f"min {min(best):.3f}, max {max(best):.3f} over {len(best)} repetitions; dtype {dtype}\n")
print("| size | peers | cohort busbw | gloo busbw | mpi busbw | cohort/gloo | cohort/mpi | cohort/(B/N) |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
for p, b in keys:
    c, g, m = (get(s, p, b, "busbw_gbs") for s in ("cohort", "gloo", "mpi"))
    print(f"| {size(b)} | {p} | {fmt(c)} | {fmt(g)} | {fmt(m)} | {fmt(c / g, 2)} | {fmt(c / m, 2)} "
          f"| {fmt(c / (B / p), 2)} |")
if any(s == "cohort-mac" for (s, _, _) in data):
    print("\nThe cost of --integrity mac (a tag on every frame), same runs, medians; both "
          "ratios say how many times slower mac is:\n")
    print("| size | peers | busbw none | busbw mac | none/mac busbw | ms none | ms mac | mac/none time |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p, b in keys:
        bn, bm = get("cohort", p, b, "busbw_gbs"), get("cohort-mac", p, b, "busbw_gbs")
        tn, tm = get("cohort", p, b, "time_ms"), get("cohort-mac", p, b, "time_ms")
        print(f"| {size(b)} | {p} | {fmt(bn)} | {fmt(bm)} | {fmt(bn / bm, 2)} | {fmt(tn, 4)} "
              f"| {fmt(tm, 4)} | {fmt(tm / tn, 2)} |")
print("\nLatency (time per all-reduce, ms; median):\n")
print("| size | peers | cohort | gloo | mpi |")
print("|---:|---:|---:|---:|---:|")
for p, b in keys:
    if b <= 65536:
        print(f"| {size(b)} | {p} | " + " | ".join(fmt(get(s, p, b, "time_ms"), 4)
                                              for s in ("cohort", "gloo", "mpi")) + " |")
print(f"\nRaw results: {sys.argv[1]}")
EOF
