#!/usr/bin/env bash
# Build both benchmark images where the real bases (python:3.11-slim, nvidia/cuda) cannot be
# pulled: a Debian base made by debootstrap stands in for both, and podman builds with chroot
# isolation, vfs storage and the host network, which work as root inside VMs and containers
# that have no user namespaces or overlayfs. Only a Debian mirror and PyPI must be reachable.
#
#   sudo docker/build-local.sh                  # localhost/gpucoll-bench:cpu and :gpu
#   sudo TARGETS=cpu docker/build-local.sh      # one target
#   sudo podman --storage-driver vfs run --rm --ipc=host --network host \
#       -v "$PWD/results:/results" localhost/gpucoll-bench:cpu
#
# Needs: root, podman, debootstrap (apt-get install podman debootstrap).
# Variables: SUITE (bookworm), MIRROR (http://deb.debian.org/debian), BASE (the base image's
# name), TARGETS ("cpu gpu"), TAG (localhost/gpucoll-bench), PODMAN (podman --storage-driver vfs),
# CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt: the certificates the base trusts, this host's,
# so a proxy with its own certificate authority works inside the builds too).
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE=${BASE:-localhost/gpucoll-base:$SUITE}
TARGETS=${TARGETS:-cpu gpu}
TAG=${TAG:-localhost/gpucoll-bench}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
read -r -a PODMAN <<< "${PODMAN:-podman --storage-driver vfs}"

if [ "$(id -u)" -ne 0 ]; then
    echo "build-local.sh: needs root (debootstrap, and podman with chroot isolation)" >&2
    exit 2
fi
for tool in "${PODMAN[0]}" debootstrap; do
    command -v "$tool" > /dev/null || { echo "build-local.sh: $tool not found" >&2; exit 2; }
done

if ! "${PODMAN[@]}" image exists "$BASE"; then
    root=$(mktemp -d /var/tmp/gpucoll-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    echo "build-local.sh: making $BASE with debootstrap ($SUITE from $MIRROR)" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$root" "$MIRROR" > "$root.log" 2>&1 \
        || { tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    if [ -r "$CA_BUNDLE" ]; then  # trust what this host trusts; pip, too, not its own copy
        cp "$CA_BUNDLE" "$root/etc/ssl/certs/ca-certificates.crt"
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
    fi
    tar -C "$root" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE"
fi

for target in $TARGETS; do
    echo "build-local.sh: building $TAG:$target on $BASE" >&2
    "${PODMAN[@]}" build --isolation chroot --network host -f docker/Dockerfile \
        --target "$target" --build-arg PYTHON_IMAGE="$BASE" --build-arg CUDA_IMAGE="$BASE" \
        -t "$TAG:$target" .
done
