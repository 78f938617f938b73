#!/usr/bin/env bash
# Run an image made by build-local.sh as `docker run --rm --ipc=host -v DIR:/results IMAGE
# [ARGS...]` would: its entrypoint, its default command unless ARGS replace it, its user and
# working directory. It runs through buildah with chroot isolation and the host network, like
# the build, because podman's OCI runtime cannot start containers where root lacks
# CAP_SYS_RESOURCE (it must set the container's resource limits), as in some VMs.
#
#   sudo docker/run-local.sh localhost/gpucoll-bench:cpu "$PWD/results"        # default sweep
#   sudo docker/run-local.sh localhost/gpucoll-bench:gpu "$PWD/results" info   # other arguments
#
# DIR must be writable by the image's user (uid 1000). Variables: BUILDAH (buildah
# --storage-driver vfs).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: run-local.sh IMAGE RESULTS_DIR [ARGS...]" >&2
    exit 2
fi
image=$1
results=$(cd "$2" && pwd)
shift 2
read -r -a BUILDAH <<< "${BUILDAH:-buildah --storage-driver vfs}"

words() {  # the image's configured Entrypoint or Cmd, one word per line
    "${BUILDAH[@]}" inspect --type image "$image" | python3 -c '
import json, sys
words = json.load(sys.stdin)["OCIv1"]["config"].get(sys.argv[1]) or []
sys.stdout.writelines(w + "\n" for w in words)' "$1"
}
mapfile -t entry < <(words Entrypoint)
if [ $# -gt 0 ]; then
    args=("$@")
else
    mapfile -t args < <(words Cmd)
fi

container=$("${BUILDAH[@]}" from --quiet "$image")
trap '"${BUILDAH[@]}" rm "$container" > /dev/null' EXIT
"${BUILDAH[@]}" run --isolation chroot --network host -v "$results:/results" "$container" \
    -- "${entry[@]}" "${args[@]}"
