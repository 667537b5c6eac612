#!/bin/sh
# Prints, one a line as PACKAGE=VERSION, the Debian packages that hold the
# shared libraries the given binaries link directly (their NEEDED entries),
# at the versions installed here. The Dockerfile's builder stage runs it on
# the binaries it built, and the runtime stage installs exactly that list:
# the image carries the libraries the binaries were linked against, at the
# same versions, and no package is named by hand, so a builder on another
# release (Ubuntu's t64 names, a CUDA base) yields its own names.
#
# The C library itself (libc6) is left out: it is the base image's own, and
# pinning it could ask apt for a downgrade of an essential package.
#
#   scripts/runtime-packages.sh BINARY...
set -eu

[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }

# The package that owns a library path: dpkg records the path as shipped,
# which on a merged-/usr system may be the /lib or the /usr/lib spelling.
owner() {
    for p in "$1" "$(readlink -f "$1")" "/usr$1" "${1#/usr}"; do
        pkg=$(dpkg-query -S "$p" 2>/dev/null | head -n 1 | cut -d: -f1) || true
        [ -n "$pkg" ] && { echo "$pkg"; return 0; }
    done
    echo "runtime-packages: no package owns $1" >&2
    return 1
}

libs=$(for b in "$@"; do objdump -p "$b" | awk '$1 == "NEEDED" { print $2 }'; done | sort -u)
pkgs=$(for lib in $libs; do
    path=$(ldconfig -p | awk -v l="$lib" '$1 == l { print $NF; exit }')
    [ -n "$path" ] || { echo "runtime-packages: $lib not found by ldconfig" >&2; exit 1; }
    owner "$path" || exit 1
done | sort -u | { grep -vx libc6 || true; })
for pkg in $pkgs; do
    dpkg-query -W -f '${Package}=${Version}\n' "$pkg"
done
