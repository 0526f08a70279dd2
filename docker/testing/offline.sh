#!/usr/bin/env bash
# TEST HARNESS ONLY: run docker/smoke.sh on a host with no container registry (this project's
# CI-like machines). Builds the local base (debootstrap) and the postgres stand-in, serves a
# local wheel index to the build when WHEEL_INDEX_DIR is given (a PEP 503 tree with a simple/
# folder, e.g. one holding torch), and runs the smoke test with those images. The docker engine
# must be running (e.g. `dockerd >/tmp/dockerd.log 2>&1 &`).
#   docker/testing/offline.sh
#   WHEEL_INDEX_DIR=/opt/pypi-more docker/testing/offline.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
base=${LOCAL_BASE_IMAGE:-vit-local-base:bookworm}
# the host as build containers see it: the default bridge's address
gateway=$(ip -4 -o addr show docker0 | awk '{split($4, a, "/"); print a[1]; exit}')
port=${WHEEL_INDEX_PORT:-18765}

if [ "${REBUILD_BASE:-0}" = 1 ] || ! docker image inspect "$base" >/dev/null 2>&1; then
    t0=$(date +%s)
    "$here/local-base.sh" "$base"
    echo "local base built in $(( $(date +%s) - t0 )) s"
fi
export DOCKER_BUILDKIT=0
docker build -q -f "$here/postgres.Dockerfile" --build-arg "BASE_IMAGE=$base" \
    -t vit-local-postgres:15 "$here" >/dev/null

build_base=$base
if [ -n "${WHEEL_INDEX_DIR:-}" ]; then
    python3 -m http.server "$port" --bind "$gateway" --directory "$WHEEL_INDEX_DIR" \
        >/tmp/vit-wheel-index.log 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    # the local index first, so pip takes the big wheels from disk; PyPI for the rest
    build_base=vit-local-base:wheels
    printf '%s\n' "FROM $base" \
        "ENV PIP_INDEX_URL=http://$gateway:$port/simple PIP_EXTRA_INDEX_URL=https://pypi.org/simple PIP_TRUSTED_HOST=$gateway" \
        | docker build -q -t "$build_base" - >/dev/null
fi

export BASE_IMAGE=$build_base CUDA_BASE_IMAGE=$build_base POSTGRES_IMAGE=vit-local-postgres:15
export TORCH_INDEX_URL=""  # the CPU wheel index is not reachable: torch from the indexes above
"$here/../smoke.sh"
