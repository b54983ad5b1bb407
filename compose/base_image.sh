#!/usr/bin/env bash
# A local base image for compose/Dockerfile (BASE_IMAGE) and the redis service (KAIROS_REDIS_IMAGE)
# where no image registry is reachable: Debian bookworm from the configured apt mirror
# (debootstrap, minbase, with python3, python3-venv and redis-server), then `docker import`.
#
#   compose/base_image.sh [NAME]        # default kairos-base:bookworm; needs root (debootstrap)
#
# Cached twice: nothing is done when the Docker daemon already has NAME, and the root file
# system's tarball is kept in .cache/compose/ (ignored by git), so a fresh daemon imports it in
# seconds instead of bootstrapping again (about 40 s). The mirror is the first Debian one in
# /etc/apt/sources.list*; KAIROS_DEBIAN_MIRROR overrides it. DOCKER names the docker client.
set -euo pipefail
name=${1:-kairos-base:bookworm}
docker=${DOCKER:-docker}
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${KAIROS_COMPOSE_CACHE:-$root/.cache/compose}
tarball=$cache/base-bookworm.tar

if "$docker" image inspect "$name" >/dev/null 2>&1; then
  echo "$name: present"
  exit 0
fi
if [ ! -s "$tarball" ]; then
  mirror=${KAIROS_DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | grep -oE '^(URIs:|deb)[[:space:]]+[^[:space:]]+/debian/?([[:space:]]|$)' | awk '{print $2; exit}' || true)}
  mirror=${mirror:-http://deb.debian.org/debian}
  mkdir -p "$cache"
  rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs" "$tarball.part"' EXIT
  echo "debootstrap bookworm from $mirror" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,redis-server bookworm "$rootfs" "$mirror" >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
"$docker" import --change 'CMD ["bash"]' "$tarball" "$name" >/dev/null
echo "$name: imported from $tarball"
