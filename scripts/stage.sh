#!/bin/sh
# One stage of `make test`, timed, so that a log says where the time went:
#
#   scripts/stage.sh NAME COMMAND [ARGS...]
#
# runs COMMAND and then prints "stage NAME: passed in N s" (or "failed
# (exit status) in N s"), and exits with COMMAND's status.
set -u
[ $# -ge 2 ] || { echo "usage: scripts/stage.sh NAME COMMAND [ARGS...]" >&2; exit 2; }
name=$1
shift
t0=$(date +%s)
rc=0
"$@" || rc=$?
took=$(( $(date +%s) - t0 ))
if [ $rc -eq 0 ]; then
    echo "stage $name: passed in $took s"
else
    echo "stage $name: failed ($rc) in $took s"
fi
exit $rc
