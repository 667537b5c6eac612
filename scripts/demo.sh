#!/bin/sh
# `make demo`: a local cohort with no Kubernetes. Starts a broker and four
# sidecars, shows the cohort, kills one sidecar with SIGKILL and shows the
# broker evicting it, then starts a member with a higher model version and
# shows the leadership move to it. Everything runs on loopback with free
# ports and is stopped at the end. The cohort has a key, made here: every
# call of a sidecar, and every status, proves it.
set -eu
cd "$(dirname "$0")/.."
BIN=${COHORT_BIN:-build}
DIR=$(mktemp -d)
PIDS=""

cleanup() {
    for p in $PIDS; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT INT TERM

say() { printf '\n== %s\n' "$*"; }

# Waits up to 30 s for the cohort to have $1 members led by $2 (any if empty).
wait_for() {
    i=0
    while [ $i -lt 300 ]; do
        if "$BIN/cohortctl" status --broker "$BROKER" --cohort demo -o json 2>/dev/null |
            python3 -c 'import json,sys; c=json.load(sys.stdin)["cohorts"][0]; n,l=int(sys.argv[1]),sys.argv[2]; sys.exit(0 if len(c["members"])==n and c["epoch"]>0 and (not l or c["leader"]==l) else 1)' "$1" "${2:-}"
        then return 0; fi
        sleep 0.1
        i=$((i + 1))
    done
    echo "demo: the cohort did not reach $1 members in 30 s; logs are in $DIR" >&2
    trap - EXIT
    exit 1
}

say "Making the cohort's key and starting a broker (cohort-operator --standalone) on a free port"
(umask 077; openssl rand -hex 32 >"$DIR/demo.key")
export COHORT_SECRET_FILE="$DIR/demo.key"     # for the sidecars and cohortctl status
"$BIN/cohort-operator" --standalone --listen 127.0.0.1:0 --cohort demo \
    --secret-file "$DIR/demo.key" 2>"$DIR/broker.log" &
PIDS="$PIDS $!"
i=0
until BROKER=$(sed -n 's/.*Broker is listening\. address=\([^ ]*\).*/\1/p' "$DIR/broker.log") && [ -n "$BROKER" ]; do
    i=$((i + 1)); [ $i -lt 300 ] || { cat "$DIR/broker.log" >&2; exit 1; }
    sleep 0.1
done
echo "broker at $BROKER"

say "Starting four sidecars: demo-0 .. demo-3"
for n in 0 1 2 3; do
    "$BIN/cohort-sidecar" --broker "$BROKER" --cohort demo --id "demo-$n" 2>"$DIR/demo-$n.log" &
    eval "PID$n=$!"
    PIDS="$PIDS $!"
done
wait_for 4
"$BIN/cohortctl" status --broker "$BROKER" --cohort demo

say "kill -9 demo-2: the broker evicts it after the member timeout (5 s)"
kill -9 "$PID2"
start=$(date +%s%N)
wait_for 3
echo "evicted after $(( ($(date +%s%N) - start) / 1000000 )) ms"
"$BIN/cohortctl" status --broker "$BROKER" --cohort demo

say "demo-9 joins with model version 42: it becomes the leader"
"$BIN/cohort-sidecar" --broker "$BROKER" --cohort demo --id demo-9 --model-version 42 2>"$DIR/demo-9.log" &
PIDS="$PIDS $!"
wait_for 4 demo-9
"$BIN/cohortctl" status --broker "$BROKER" --cohort demo

say "What demo-0 saw (its log):"
grep "Adopted a new epoch" "$DIR/demo-0.log" | sed 's/^[^ ]* //'
say "Done; stopping everything."
