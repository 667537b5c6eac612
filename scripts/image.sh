#!/usr/bin/env bash
# Builds the cohort image (the top-level Dockerfile) with Debian's podman,
# tagged localhost/cohort:VERSION and localhost/cohort:dev.
#
#   scripts/image.sh [PODMAN-BUILD-ARGS...]   build; podman's layer cache
#                                 makes it a few seconds when nothing changed
#   scripts/image.sh --print-tag  the same, with the build's output on
#                                 stderr; prints the VERSION tag on stdout
#   scripts/image.sh --conf       only writes the podman configuration and
#                                 prints its path (for CONTAINERS_CONF)
#   scripts/image.sh --rebuild-base  makes the base image again first
#
#   IMAGE_REPO=name     repository (default localhost/cohort)
#   SOURCE_DATE_EPOCH   the image's creation time (default: the commit's)
#
# What these machines need (see docs/install.md, "The image"):
# - podman, buildah, runc, skopeo, debootstrap and catatonit (podman run
#   --init), installed with apt when missing;
# - a containers.conf with runc, cgroupfs and explicit ulimits, written to
#   build/podman/containers.conf and named by CONTAINERS_CONF for podman
#   (nothing under /etc changes);
# - the base image localhost/debian:bookworm-slim, which `FROM
#   debian:bookworm-slim` resolves to: no registry is reachable, so it is
#   made here with debootstrap from this machine's Debian mirror and
#   `podman import`, once. podman's store is machine-wide, so it is the
#   cache: it is made only when `podman image exists` says it is missing.
set -eu

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CONF_DIR=$ROOT/build/podman
CONF=$CONF_DIR/containers.conf
BASE=localhost/debian:bookworm-slim
REPO=${IMAGE_REPO:-localhost/cohort}

print_tag=0 conf_only=0 rebuild_base=0
while [ $# -gt 0 ]; do
    case $1 in
        --print-tag) print_tag=1 ;;
        --conf) conf_only=1 ;;
        --rebuild-base) rebuild_base=1 ;;
        -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
    shift
done
# With --print-tag stdout carries the tag alone.
if [ $print_tag = 1 ]; then exec 3>&1 1>&2; fi

if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi

# ---- the tools -------------------------------------------------------------
missing=""
for c in podman:podman buildah:buildah runc:runc skopeo:skopeo debootstrap:debootstrap; do
    command -v "${c%%:*}" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin command -v "${c%%:*}" \
        >/dev/null 2>&1 || missing="$missing ${c#*:}"
done
[ -x /usr/libexec/podman/catatonit ] || missing="$missing catatonit"
if [ -n "$missing" ]; then
    echo "image: installing$missing"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086
    $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

# ---- the configuration -----------------------------------------------------
# ulimits: podman's defaults for root (nofile 1048576, and the caller's
# nproc) exceed the hard limits these machines allow and runc fails with
# "error setting rlimit ...: operation not permitted". nofile is the
# caller's hard limit (capped at 65536: a broker's connections need more
# than 1024); nproc stays at 4096 because runc failed with values from
# 65536 up, the 96364 hard limit included, while 4096 to 32768 worked, and
# RLIMIT_NPROC counts a uid's processes machine-wide, which for the
# image's user is the containers' own few threads each.
hard_n=$(ulimit -Hn) hard_u=$(ulimit -Hu)
[ "$hard_n" = unlimited ] || [ "$hard_n" -gt 65536 ] && hard_n=65536
[ "$hard_u" = unlimited ] || [ "$hard_u" -gt 4096 ] && hard_u=4096
mkdir -p "$CONF_DIR"
cat > "$CONF.tmp" <<EOF
# Written by scripts/image.sh; podman reads it through CONTAINERS_CONF.
[containers]
default_ulimits = ["nofile=$hard_n:$hard_n", "nproc=$hard_u:$hard_u"]
[engine]
# crun fails on this kernel's hybrid cgroups; runc with cgroupfs works.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
mv -f "$CONF.tmp" "$CONF"
export CONTAINERS_CONF=$CONF
if [ $conf_only = 1 ]; then
    if [ $print_tag = 1 ]; then echo "$CONF" >&3; else echo "$CONF"; fi
    exit 0
fi

# One build at a time from this checkout: test processes running side by
# side each ask for the image, and two cold builds at once would race to
# make the base image and do all the work twice. The second waits here,
# then finds every layer in the cache.
exec 9>"$CONF_DIR/build.lock"
flock -w 3600 9 || { echo "image: another build held $CONF_DIR/build.lock for an hour" >&2; exit 1; }

# ---- the base image --------------------------------------------------------
# This machine's Debian mirror: the first URI of its deb822 sources, else of
# sources.list; deb.debian.org when it has neither.
debian_mirror() {
    local m=""
    if [ -r /etc/apt/sources.list.d/debian.sources ]; then
        m=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
    fi
    if [ -z "$m" ] && [ -r /etc/apt/sources.list ]; then
        m=$(awk '$1 == "deb" && $0 ~ /bookworm/ { print $2; exit }' /etc/apt/sources.list)
    fi
    echo "${m:-http://deb.debian.org/debian}"
}

make_base() {
    local mirror dir t0
    mirror=$(debian_mirror)
    dir=$(mktemp -d "${TMPDIR:-/tmp}/cohort-base.XXXXXX")
    trap '$SUDO rm -rf "$dir"' EXIT
    t0=$(date +%s)
    echo "image: making $BASE with debootstrap from $mirror (once; about 100 s)"
    $SUDO debootstrap --variant=minbase bookworm "$dir" "$mirror" > "$CONF_DIR/debootstrap.log" 2>&1 \
        || { tail -n 30 "$CONF_DIR/debootstrap.log"; exit 1; }
    # As Debian's slim image: no package cache, no indexes, no docs; apt
    # reads the same sources as the official image (this machine's own
    # deb822 file when it has one: it names the mirror that answers here).
    $SUDO rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/cache/apt/*.bin \
        "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* "$dir"/usr/share/man/* \
        "$dir"/usr/share/info/* "$dir"/usr/share/locale/* "$dir"/var/log/*.log \
        "$dir"/etc/apt/sources.list
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-exclude /usr/share/man/*' \
        'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
        | $SUDO tee "$dir/etc/dpkg/dpkg.cfg.d/docker" >/dev/null
    if [ -r /etc/apt/sources.list.d/debian.sources ]; then
        $SUDO cp /etc/apt/sources.list.d/debian.sources "$dir/etc/apt/sources.list.d/"
    else
        printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$mirror" | $SUDO tee "$dir/etc/apt/sources.list.d/debian.sources" >/dev/null
    fi
    $SUDO tar --numeric-owner -C "$dir" -c . | podman import --change 'CMD ["bash"]' - "$BASE" >/dev/null
    $SUDO rm -rf "$dir"
    trap - EXIT
    echo "image: made $BASE in $(( $(date +%s) - t0 )) s"
}

if [ $rebuild_base = 1 ] || ! podman image exists "$BASE"; then
    make_base
fi

# ---- the image -------------------------------------------------------------
version=$(cat "$ROOT/VERSION")
revision=unknown
if git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
    revision=$(git -C "$ROOT" rev-parse HEAD)
    # A build from uncommitted changes says so: the label then names a
    # commit the image does not exactly come from.
    [ -z "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ] || revision=$revision-dirty
    : "${SOURCE_DATE_EPOCH:=$(git -C "$ROOT" log -1 --format=%ct)}"
fi
# --timestamp (podman's spelling of SOURCE_DATE_EPOCH) sets the image's
# creation time and its files' times to the commit's, so that the same
# commit and the same packages give the same layers.
ts_args=()
created=""
if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
    ts_args=(--timestamp "$SOURCE_DATE_EPOCH")
    created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
fi

# The labels that change with the commit are given twice: as build
# arguments for the Dockerfile's LABEL (a build without this script), and
# as --label, because buildah 1.28 reuses a cached LABEL step whose
# arguments changed (the image kept the previous commit's revision).
labels=(--label "org.opencontainers.image.version=$version"
        --label "org.opencontainers.image.revision=$revision"
        --label "org.opencontainers.image.created=$created")
t0=$(date +%s)
podman build --layers --jobs 1 "${ts_args[@]}" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" \
    --build-arg CREATED="$created" "${labels[@]}" \
    -t "$REPO:$version" -t "$REPO:dev" -f "$ROOT/Dockerfile" "$@" "$ROOT"
echo "image: built $REPO:$version and $REPO:dev in $(( $(date +%s) - t0 )) s"

if [ $print_tag = 1 ]; then echo "$REPO:$version" >&3; fi
