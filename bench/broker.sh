#!/bin/sh
# The broker under load: simulated members heartbeating at 1 Hz against a
# real cohort-operator process (see `cohortctl bench broker --help`).
# Prints a markdown table for the README. Uses the release build.
#
#   bench/broker.sh            both scenarios
#   MEASURE=30s bench/broker.sh
set -eu
cd "$(dirname "$0")/.."
[ -x build/cohortctl ] || make -j2 all >/dev/null
MEASURE=${MEASURE:-10s}
CHANGES=${CHANGES:-5}

row() {
    # $1 label, then cohortctl bench broker arguments
    label=$1
    shift
    out=$(build/cohortctl bench broker --measure "$MEASURE" --changes "$CHANGES" -o json "$@")
    python3 - "$label" "$out" <<'PY'
import json, sys
label, r = sys.argv[1], json.loads(sys.argv[2])
print("| %s | %d | %d | %d | %.1f %% | %.0f | %.0f | %.0f | %.0f |" % (
    label, r["members"], r["cohorts"], r["connections"], r["broker_cpu_pct"],
    r["epoch_first_ms"], r["epoch_p50_ms"], r["epoch_p99_ms"], r["epoch_max_ms"]))
PY
}

echo "| scenario | members | cohorts | connections | broker CPU (one core) | epoch first ms | p50 ms | p99 ms | max ms |"
echo "|---|---|---|---|---|---|---|---|---|"
row "1 cohort" --members 1000 --cohorts 1
row "100 cohorts" --members 10000 --cohorts 100 --connections 1000
