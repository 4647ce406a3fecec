#!/usr/bin/env bash
# Builds the base images the compose stack needs from Debian packages alone (debootstrap, then
# `docker import`), for hosts that cannot pull from a public registry: air-gapped GPU clusters,
# build machines behind a proxy. Prints the variables that point compose at them; with
# `--env-file FILE` it also writes them into FILE (replacing earlier values).
#
#   deploy/base-images.sh [--env-file .env]
#
# Images (Debian bookworm, minbase, security updates applied, docs and apt lists removed):
#   crucible-base/debian:bookworm        minbase (coreutils' chown for volumes-init)   INIT_IMAGE
#   crucible-base/python:3.11-bookworm   python3, venv, CA certificates                PYTHON_IMAGE
#   crucible-base/redis:7.0-bookworm     redis-server, /data owned by redis            REDIS_IMAGE
#   crucible-base/haproxy:2.6-bookworm   haproxy (runs as haproxy) and wget            SANDBOX_LB_IMAGE
#
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR
# (http://deb.debian.org/debian-security), CACHE_DIR (downloaded packages, kept between runs).
# Needs root, debootstrap and a running Docker engine.
set -euo pipefail
shopt -s inherit_errexit

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
SUITE=bookworm
CACHE_DIR=${CACHE_DIR:-${HOME}/.cache/crucible-debootstrap}
ENV_FILE=
if [[ ${1:-} == --env-file ]]; then
    ENV_FILE=${2:?--env-file needs a path}
fi

PATH_ENV="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WORK=$(mktemp -d)
trap 'umount -l "$WORK"/*/proc 2>/dev/null || true; rm -rf "$WORK"' EXIT

log() { printf '[base-images] %s\n' "$*" >&2; }

in_root() {  # in_root DIR COMMAND...: run a command inside a root tree, with /proc mounted
    local root=$1 rc=0
    shift
    mount -t proc proc "$root/proc"
    DEBIAN_FRONTEND=noninteractive chroot "$root" "$@" >>"$WORK/apt.log" 2>&1 || rc=$?
    umount "$root/proc"
    if ((rc != 0)); then
        tail -30 "$WORK/apt.log" >&2
        return $rc
    fi
}

slim() {  # what an image does not need at run time
    local root=$1
    rm -f "$root/usr/sbin/policy-rc.d"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/usr/share/locale/* "$root"/tmp/* "$root"/var/tmp/*
    : >"$root/etc/resolv.conf"
}

import() {  # import DIR IMAGE CHANGE...: the tree as a one-layer image
    local root=$1 image=$2
    shift 2
    local args=(--change "ENV $PATH_ENV" --change "ENV LANG=C.UTF-8")
    for change in "$@"; do
        args+=(--change "$change")
    done
    tar --numeric-owner -C "$root" -c . | docker import "${args[@]}" - "$image" >/dev/null
    log "$image: $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')"
}

# One minbase tree with security updates; each image is a copy of it plus its packages.
base="$WORK/base"
mkdir -p "$CACHE_DIR"
log "debootstrap $SUITE (minbase) from $MIRROR"
debootstrap --variant=minbase --cache-dir="$CACHE_DIR" "$SUITE" "$base" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
cat >"$base/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$base/etc/apt/apt.conf.d/90crucible"
cp /etc/resolv.conf "$base/etc/resolv.conf"
# Package scripts must not try to start services in the image.
printf '#!/bin/sh\nexit 101\n' >"$base/usr/sbin/policy-rc.d"
chmod 0755 "$base/usr/sbin/policy-rc.d"
in_root "$base" sh -c 'apt-get -qq update && apt-get -qq -y upgrade'

with_packages() {  # with_packages NAME PACKAGE...: a copy of the base tree with these installed
    local root="$WORK/$1"
    shift
    cp -a "$base" "$root"
    in_root "$root" apt-get -qq -y install "$@"
    echo "$root"
}

declare -A IMAGE=(
    [INIT_IMAGE]=crucible-base/debian:bookworm
    [PYTHON_IMAGE]=crucible-base/python:3.11-bookworm
    [REDIS_IMAGE]=crucible-base/redis:7.0-bookworm
    [SANDBOX_LB_IMAGE]=crucible-base/haproxy:2.6-bookworm
)

root=$(with_packages python python3 python3-venv python-is-python3 ca-certificates)
slim "$root"
import "$root" "${IMAGE[PYTHON_IMAGE]}" 'CMD ["python3"]'

root=$(with_packages redis redis-server)
mkdir -p "$root/data"
in_root "$root" chown redis:redis /data
slim "$root"
import "$root" "${IMAGE[REDIS_IMAGE]}" "WORKDIR /data" "USER redis" "EXPOSE 6379" 'CMD ["redis-server"]'

root=$(with_packages haproxy haproxy wget)
mkdir -p "$root/usr/local/etc/haproxy"
slim "$root"
import "$root" "${IMAGE[SANDBOX_LB_IMAGE]}" "USER haproxy" \
    'CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]'

slim "$base"
import "$base" "${IMAGE[INIT_IMAGE]}" 'CMD ["bash"]'

for name in INIT_IMAGE PYTHON_IMAGE REDIS_IMAGE SANDBOX_LB_IMAGE; do
    echo "$name=${IMAGE[$name]}"
    if [[ -n $ENV_FILE ]]; then
        touch "$ENV_FILE"
        sed -i "/^$name=/d" "$ENV_FILE"
        echo "$name=${IMAGE[$name]}" >>"$ENV_FILE"
    fi
done
