#!/bin/sh
# Time from a `kill -9` to the survivors' next commit: a sidecar's death,
# a trainer's, the broker's (restarted at once), and a stopped sidecar
# (silence, for contrast), with the default 1 s heartbeat and 5 s member
# timeout; median and p90 over TRIALS trials each, against torchrun's
# documented detection (3 x 5 s) as the reference row. See
# bench/failover.py. Uses the release build and the Python package it
# builds; /usr/bin/python3 has torch.
#
#   bench/failover.sh
#   TRIALS=10 MEMBERS=4 bench/failover.sh
set -eu
cd "$(dirname "$0")/.."
[ -x build/cohort-sidecar ] && [ -d build/python/cohort ] || make -j2 all >/dev/null
exec /usr/bin/python3 bench/failover.py --bin build --trials "${TRIALS:-5}" \
    --members "${MEMBERS:-3}" "$@"
