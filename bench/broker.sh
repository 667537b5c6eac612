#!/bin/sh
# The broker under load: simulated members heartbeating at 1 Hz against a
# real cohort-operator process (see `cohortctl bench broker --help`), as
# UDP datagrams, and in a second row of each scenario, in the same run, up
# their session streams (--no-datagrams), with the ratio of broker CPU.
# Prints a markdown table for the README. Uses the release build.
#
#   bench/broker.sh            both scenarios
#   MEASURE=30s bench/broker.sh
#   BASELINE=/path/to/other/build BASELINE_LABEL="protocol 1" bench/broker.sh
#                              each scenario also with that build's
#                              cohortctl and cohort-operator (an older
#                              protocol, say), interleaved, with the ratio
#                              of broker CPU
set -eu
cd "$(dirname "$0")/.."
[ -x build/cohortctl ] || make -j2 all >/dev/null
MEASURE=${MEASURE:-10s}
CHANGES=${CHANGES:-5}
BASELINE=${BASELINE:-}
BASELINE_LABEL=${BASELINE_LABEL:-baseline}

# $1 build dir, $2 label, then cohortctl bench broker arguments; prints
# the row and leaves the broker CPU in $cpu.
row() {
    dir=$1
    label=$2
    shift 2
    out=$("$dir/cohortctl" bench broker --measure "$MEASURE" --changes "$CHANGES" -o json "$@") ||
        return 1
    line=$(python3 - "$label" "$out" <<'PY'
import json, sys
label, r = sys.argv[1], json.loads(sys.argv[2])
def ms(k):
    return "%.0f" % r[k] if k in r and r.get("send_samples") else "-"
print("%.3f||| %s | %d | %d | %d | %d | %.1f %% | %s | %s | %s | %.0f | %.0f | %.0f | %d |" % (
    r["broker_cpu_pct"], label, r["members"], r["cohorts"], r["connections"],
    r.get("members_on_datagrams", 0), r["broker_cpu_pct"], ms("send_p50_ms"),
    ms("send_p99_ms"), ms("send_max_ms"), r["epoch_first_ms"], r["epoch_p50_ms"],
    r["epoch_p99_ms"], r.get("rejoins_steady", 0)))
PY
) || return 1
    cpu=${line%%||*}
    echo "${line#*||}"
}

# The ratio of two CPU figures: $1 over $2, labelled $3.
ratio() {
    python3 -c "import sys; b, n = float(sys.argv[1]), float(sys.argv[2]); print('|  | broker CPU, %s: %.1fx |  |  |  |  |  |  |  |  |  |  |  |' % (sys.argv[3], b / n if n else float('inf')))" "$1" "$2" "$3"
}

scenario() {
    label=$1
    shift
    row build "$label" "$@"
    new=$cpu
    # The same build with every heartbeat on its member's stream, in the
    # same run: what the datagrams save.
    row build "$label, heartbeats on streams" --no-datagrams "$@"
    ratio "$cpu" "$new" "streams / datagrams"
    if [ -n "$BASELINE" ]; then
        row "$BASELINE" "$label, $BASELINE_LABEL" "$@" || {
            echo "|  | $BASELINE_LABEL: did not finish |  |  |  |  |  |  |  |  |  |  |  |"
            return 0
        }
        ratio "$cpu" "$new" "$BASELINE_LABEL / this build"
    fi
}

echo "| scenario | members | cohorts | connections | on datagrams | broker CPU (one core) | sent to all p50 ms | p99 ms | max ms | seen first ms | seen p50 ms | seen p99 ms | rejoins |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
scenario "1 cohort" --members 1000 --cohorts 1
scenario "100 cohorts" --members 10000 --cohorts 100 --connections 1000
