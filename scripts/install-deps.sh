#!/bin/sh
# Installs the Debian packages cohort builds and tests with, only those that
# are missing, so that a fresh Debian 12 machine needs nothing but `make`.
# iproute2 and iptables are for tests/netfault (namespaces, partitions),
# which runs wherever it may (root) and skips elsewhere.
set -eu

PKGS="gcc make pkg-config libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
libcjson-dev libcurl4-openssl-dev libyaml-dev libssl-dev openssl libcriterion-dev python3 python3-pytest
python3-pytest-xdist python3-dev python3-setuptools python3-yaml python3-torch clang libclang-rt-dev
iproute2 iptables"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

echo "install-deps: installing$missing"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
