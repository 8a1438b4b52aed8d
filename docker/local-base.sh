#!/bin/sh
# Make a Debian bookworm base image without a registry: debootstrap a minimal root file system and import it.
# For machines that cannot pull from Docker Hub; the Dockerfile's default base is the official Python image.
#
#   sudo docker/local-base.sh                      # -> local/debian:bookworm
#   sudo docker/local-base.sh my/debian:bookworm   # another tag
#   MIRROR=http://my.mirror/debian SECURITY_MIRROR=http://my.mirror/debian-security sudo docker/local-base.sh
#
# Idempotent: does nothing when the image exists. Needs root (debootstrap), debootstrap and a Docker daemon.
set -eu

IMAGE=${1:-local/debian:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "local-base: $IMAGE exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "local-base: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "local-base: debootstrap needs root" >&2; exit 1; }

ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/primaplug-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS"' EXIT
echo "local-base: debootstrap bookworm from $MIRROR (about a minute)"
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 || {
    tail -20 "$ROOTFS.log" >&2; rm -f "$ROOTFS.log"; echo "local-base: debootstrap failed" >&2; exit 1; }
rm -f "$ROOTFS.log"
# the suites of Debian's own image, so that apt-get installs the security updates too; the packages' lists are
# fetched again by the Dockerfile's apt-get update
cat >"$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY_MIRROR bookworm-security main
EOF
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "local-base: made $IMAGE"
