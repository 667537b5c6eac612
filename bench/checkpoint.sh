#!/bin/sh
# What checkpoints cost: write throughput (MiB/s, fsync and checksum
# included) and rounds per second with the leader checkpointing every
# version and every 10 versions against none, interleaved in the same run
# (see `cohortctl bench checkpoint --help`). Uses the release build.
# Checkpoints go under DIR (default: build/, on the repository's disk;
# /tmp may be memory, where fsync costs nothing).
#
#   bench/checkpoint.sh                        64 MiB and 256 MiB, 2 members
#   BYTES=64M PEERS=4 REPS=5 bench/checkpoint.sh
set -eu
cd "$(dirname "$0")/.."
[ -x build/cohortctl ] || make -j2 all >/dev/null
DIR=${DIR:-build}
mkdir -p "$DIR"
exec build/cohortctl bench checkpoint --peers "${PEERS:-2}" --bytes "${BYTES:-64M,256M}" \
    --every "${EVERY:-1,10}" --seconds "${SECONDS_PER_RUN:-8}" --reps "${REPS:-3}" \
    --writes "${WRITES:-5}" --dir "$DIR" "$@"
