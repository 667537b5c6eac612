#!/bin/sh
# The training demo: `cohortctl run` starts an embedded broker, four
# sidecars and four trainers (examples/c/logreg.c: logistic regression on
# synthetic data), and while they train kills one trainer with SIGKILL,
# then one sidecar, then adds a fifth peer. Training goes on through all
# of it; at the end the surviving trainers must agree on the final model
# version and digest, and the loss has gone down. Everything runs on
# loopback with free ports and is stopped at the end.
set -eu
cd "$(dirname "$0")/.."
BIN=${COHORT_BIN:-build}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
trap 'exit 130' INT TERM

say() { printf '\n== %s\n' "$*"; }

for b in cohortctl cohort-sidecar examples/logreg; do
    if [ ! -x "$BIN/$b" ]; then
        echo "demo-run: $BIN/$b is missing; run make first" >&2
        exit 1
    fi
done

STEPS=300
SCHEDULE=kill-trainer@v=60:1,kill-sidecar@v=120:2,add@v=160

say "Training on 4 peers, ${STEPS} rounds of 256 samples: $SCHEDULE"
echo "(kill-trainer: SIGKILL to peer-1's trainer at model version 60;"
echo " kill-sidecar: SIGKILL to peer-2's sidecar at 120, so its trainer stops;"
echo " add: peer-4 joins at 160 and receives the leader's state)"
status=0
"$BIN/cohortctl" run -n 4 --run-dir "$DIR/run" --schedule "$SCHEDULE" -- \
    "$BIN/examples/logreg" --steps "$STEPS" --wait-for 4 --delay 15ms --log-every 20 || status=$?

say "peer-0's loss as the cohort trained (its stderr):"
grep -E '^logreg: (model_version=|epoch|done)' "$DIR/run/0.err" | sed 's/^logreg: /  /' || true

say "peer-4, added late:"
grep -E '^logreg: (epoch|received|done)' "$DIR/run/4.err" | sed 's/^logreg: /  /' || true

say "peer-2, whose sidecar was killed:"
tail -n 1 "$DIR/run/2.err" | sed 's/^logreg: /  /' || true

if [ "$status" -eq 0 ]; then
    say "Done: the run completed and the survivors agree."
else
    say "The run FAILED (status $status); its logs were in $DIR/run."
fi
exit "$status"
