#!/bin/sh
# Prepares a Debian or Ubuntu base for primaplug's image; run by both stages of the Dockerfile:
#   base-setup.sh build     CA certificates, Python 3.11+ with venv, a C/C++ compiler, CMake, ninja, patch
#   base-setup.sh runtime   CA certificates and Python 3.11+ (no compilers, no venv module: the venv is copied)
# The Python comes from the base when it has one (the official python images), else from apt (a bare Debian
# bookworm or Ubuntu 24.04, CUDA's images). Extra CA certificates (docker/certs/*.crt in the build context, copied
# to /tmp/certs) are added to the system's bundle, which pip is pointed at (PIP_CERT in the Dockerfile).
set -eu
role=${1:?build or runtime}

pkgs="ca-certificates libstdc++6"
command -v python3 >/dev/null || pkgs="$pkgs python3"
if [ "$role" = build ]; then
    pkgs="$pkgs gcc g++ make patch cmake ninja-build"
    # Debian's python3 comes without its venv module (the official python images have it)
    python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs="$pkgs python3-venv"
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $pkgs
rm -rf /var/lib/apt/lists/*

python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else
    "primaplug needs Python 3.11+; this base has %s: pick a newer base (docs/docker.md)" % sys.version.split()[0])'

if ls /tmp/certs/*.crt >/dev/null 2>&1; then
    cp /tmp/certs/*.crt /usr/local/share/ca-certificates/
    update-ca-certificates
fi
rm -rf /tmp/certs
