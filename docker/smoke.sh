#!/usr/bin/env bash
# End-to-end check of the docker set-up: build the CPU image, bring up the CPU part of
# docker/compose.yaml (postgres, mlflow, api), then through the running stack
#   1. train a smoke model as an API job (job state in PostgreSQL, run + registry in MLflow on
#      PostgreSQL, artifacts through the MLflow server's artifact proxy),
#   2. let the API load the registered champion and POST an image prediction with attention,
#   3. check that bad input still gets a 4xx, and that the MLflow UI and registry answer,
# and tear everything down (volumes included), also on failure.
#
#   docker/smoke.sh                 # official base images (needs a registry)
#   docker/testing/offline.sh       # the same with local base images, for registry-less hosts
#
# With GPU=1 it also builds docker/Dockerfile.cuda and starts the `trainer` service (profile
# gpu) on cifar10-smoke: that needs an NVIDIA GPU and the NVIDIA container runtime; without
# them the script reports the refusal, then runs the same image's trainer with --device cpu
# against the stack's MLflow so the image itself is still checked.
#
# Environment: BASE_IMAGE, POSTGRES_IMAGE, TORCH_INDEX_URL, TORCH_SPEC (build args passed
# through), CUDA_BASE_IMAGE (BASE_IMAGE of the CUDA build), API_PORT (18000), MLFLOW_PORT
# (15000), KEEP=1 to leave the stack up, SKIP_BUILD=1, GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=vit-smoke
export VIT_SERVICE_IMAGE=${VIT_SERVICE_IMAGE:-vit-service:smoke}
export VIT_SERVICE_CUDA_IMAGE=${VIT_SERVICE_CUDA_IMAGE:-vit-service:cuda-smoke}
export API_PORT=${API_PORT:-18000} MLFLOW_PORT=${MLFLOW_PORT:-15000}
export VIT_SERVICE_API_KEY=smoke-key-0123456789
export MLFLOW_UI_URL=http://localhost:${MLFLOW_PORT}
API=http://127.0.0.1:${API_PORT}
MLFLOW=http://127.0.0.1:${MLFLOW_PORT}
AUTH="Authorization: Bearer ${VIT_SERVICE_API_KEY}"

if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
compose+=(-f docker/compose.yaml)

log() { printf '\n[smoke %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { log "FAILED: $*"; "${compose[@]}" ps || true; "${compose[@]}" logs --tail=60 api mlflow || true; exit 1; }

DATA_DIR=$(mktemp -d /tmp/vit-smoke-data.XXXXXX)
chmod 0755 "$DATA_DIR"  # the containers' uid 10001 reads it; only this user writes it
export DATA_DIR
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then log "KEEP=1: stack left up; data in $DATA_DIR"; return; fi
    log "tearing down"
    "${compose[@]}" down --volumes --remove-orphans >/dev/null 2>&1 || true
    rm -rf "$DATA_DIR"
}
trap cleanup EXIT

# ------------------------------------------------------------------------------------- build
build_args=()
for arg in BASE_IMAGE TORCH_INDEX_URL TORCH_SPEC; do
    if [ -n "${!arg+x}" ]; then build_args+=(--build-arg "$arg=${!arg}"); fi
done
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    log "building $VIT_SERVICE_IMAGE (docker/Dockerfile) ${build_args[*]}"
    t0=$(date +%s)
    DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build -f docker/Dockerfile \
        "${build_args[@]}" -t "$VIT_SERVICE_IMAGE" .
    log "built in $(( $(date +%s) - t0 )) s: $(docker image inspect -f '{{.Size}}' "$VIT_SERVICE_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
fi
user=$(docker image inspect -f '{{.Config.User}}' "$VIT_SERVICE_IMAGE")
[ "$user" = "10001:10001" ] || fail "image runs as '$user', not the non-root 10001"
docker image inspect -f '{{json .Config.Healthcheck}}' "$VIT_SERVICE_IMAGE" | grep -q healthz \
    || fail "image has no health check"

# -------------------------------------------------------------------------------------- data
log "generating a small CIFAR-style ImageFolder tree (10 classes x 50 PNGs) in $DATA_DIR"
docker run --rm --user "$(id -u):$(id -g)" -v "$DATA_DIR":/data "$VIT_SERVICE_IMAGE" python3 -c '
import numpy as np, pathlib
from PIL import Image
from vit_service.data import CIFAR10_CLASSES
rng = np.random.default_rng(0)
for k, name in enumerate(CIFAR10_CLASSES):
    d = pathlib.Path("/data/cifar10/train") / name
    d.mkdir(parents=True)
    colour = np.array([(k * 25) % 256, (k * 97) % 256, (255 - k * 25) % 256])
    for i in range(50):
        img = np.clip(colour + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(d / f"{i}.png")
Image.fromarray(np.full((32, 32, 3), (75, 35, 180), np.uint8)).save("/data/probe.png")
open("/data/corrupt.png", "wb").write(b"\x89PNG\r\n\x1a\n not really a png")
'

# ----------------------------------------------------------------------------------------- up
log "compose up: postgres, mlflow, api"
"${compose[@]}" up -d --no-build postgres mlflow api
for _ in $(seq 1 90); do
    curl -fsS "$API/healthz" >/dev/null 2>&1 && break
    sleep 2
done
curl -fsS "$API/healthz" >/dev/null || fail "the API did not come up"
log "API healthy: $(curl -fsS "$API/healthz")"
docker inspect -f '{{.State.Health.Status}}' "$("${compose[@]}" ps -q mlflow)" | grep -q healthy \
    || fail "mlflow is not healthy"

# ---------------------------------------------------------------------------------------- job
log "POST /v1/jobs cifar10-smoke"
job=$(curl -fsS -X POST "$API/v1/jobs" -H "$AUTH" -H 'Content-Type: application/json' \
      -d '{"recipe": "cifar10-smoke", "name": "docker smoke"}') || fail "job submission refused"
id=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])' <<<"$job")
state=queued
for _ in $(seq 1 150); do
    state=$(curl -fsS "$API/v1/jobs/$id" -H "$AUTH" | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])')
    case $state in succeeded|failed|cancelled) break ;; esac
    sleep 4
done
curl -fsS "$API/v1/jobs/$id/logs?tail=8" -H "$AUTH" | python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin)["lines"]))'
[ "$state" = succeeded ] || fail "job $id ended $state"
log "job $id succeeded"

# ----------------------------------------------------------------------------------- predict
curl -fsS -X POST "$API/v1/models/cifar10-vit/reload" -H "$AUTH" >/dev/null || fail "reload"
pred=$(curl -fsS -X POST "$API/v1/predict/image?attention=rollout&top_k=3" \
       -F "file=@$DATA_DIR/probe.png;type=image/png") || fail "prediction failed"
python3 - "$pred" <<'EOF' || fail "bad prediction response"
import json, sys
r = json.loads(sys.argv[1])
res = r["results"][0]
top, roll = res["predictions"], res["attention"]["rollout"]
total = sum(sum(row) for row in roll)
print(f"model {r['model']['name']} v{r['model']['version']}: top-3 "
      + ", ".join(f"{t['label']} {t['probability']:.3f}" for t in top)
      + f"; rollout {len(roll)}x{len(roll[0])}, sum {total:.4f}")
assert len(top) == 3 and abs(total - 1) < 1e-3
EOF
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "$API/v1/predict/image" \
       -F "file=@$DATA_DIR/corrupt.png;type=image/png")
[ "$code" = 400 ] || fail "a corrupt image got $code, not 400"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST "$API/v1/jobs" -H 'Content-Type: application/json' \
       -d '{"recipe": "cifar10-smoke"}')
[ "$code" = 401 ] || fail "a job without the key got $code, not 401"
log "bad input through the stack: corrupt image 400, job without key 401"

# ------------------------------------------------------------------------------------ mlflow
curl -fsS "$MLFLOW/api/2.0/mlflow/registered-models/get?name=cifar10-vit" | python3 -c '
import json, sys
m = json.load(sys.stdin)["registered_model"]
print("MLflow registry:", m["name"], "aliases", m.get("aliases"))
assert any(a["alias"] == "champion" for a in m.get("aliases", []))' || fail "registry"
curl -fsS -o /dev/null "$MLFLOW/" || fail "MLflow UI"
log "MLflow UI and registry answer on $MLFLOW"

# ------------------------------------------------------------------------------- GPU trainer
if [ "${GPU:-0}" = 1 ]; then
    cuda_args=()
    if [ -n "${TORCH_SPEC+x}" ]; then cuda_args+=(--build-arg "TORCH_SPEC=$TORCH_SPEC"); fi
    if [ -n "${CUDA_BASE_IMAGE:-}" ]; then cuda_args+=(--build-arg "BASE_IMAGE=$CUDA_BASE_IMAGE"); fi
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
        log "building $VIT_SERVICE_CUDA_IMAGE (docker/Dockerfile.cuda) ${cuda_args[*]}"
        t0=$(date +%s)
        DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} docker build -f docker/Dockerfile.cuda \
            "${cuda_args[@]}" -t "$VIT_SERVICE_CUDA_IMAGE" .
        log "built in $(( $(date +%s) - t0 )) s: $(docker image inspect -f '{{.Size}}' "$VIT_SERVICE_CUDA_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
    fi
    log "compose --profile gpu run trainer (cifar10-smoke --device cuda)"
    if "${compose[@]}" --profile gpu run --rm trainer train cifar10-smoke --device cuda; then
        log "GPU trainer ran"
    elif docker info 2>/dev/null | grep -qi 'runtimes:.*nvidia'; then
        fail "the GPU trainer failed although the NVIDIA runtime is installed"
    else
        log "GPU trainer NOT run: no NVIDIA GPU / container runtime on this host (expected here)"
        log "the CUDA image's trainer with --device cpu instead, logging to the stack's MLflow"
        docker run --rm --network "${COMPOSE_PROJECT_NAME}_default" \
            -e MLFLOW_TRACKING_URI=http://mlflow:5000 -v "$DATA_DIR":/data:ro \
            "$VIT_SERVICE_CUDA_IMAGE" train cifar10-smoke --device cpu --run-name cuda-image-on-cpu \
            >/dev/null || fail "the CUDA image's trainer failed on CPU"
    fi
fi
log "OK"
