#!/usr/bin/env bash
# The GPU check, one command (< 10 min on one H200): trains the GPU CIFAR-10 recipe
# (cifar10-vit: time to 90 % / 94 % val accuracy, final accuracy, images/s, FLOPs per image,
# MFU) and the IMDb masked-LM self-pretraining (imdb-mlm-pretrain-gpu) + fine-tuning
# (imdb-transformer from that encoder), then prints a summary table and the JSON summary.
#
#   bash benchmarks/gpu_check.sh                            # data in .device/data
#   bash benchmarks/gpu_check.sh --dry-run --data-dir DIR   # CPU, smoke recipes, seconds
#   bash benchmarks/gpu_check.sh --only cifar --cifar-set budget_minutes=3
#   bash benchmarks/gpu_check.sh --help
#
# Needs no network and installs nothing. Interpreter: $PYTHON, else .venv/bin/python when
# present, else python3; PYTHONPATH = the repository root. MLflow is not used.
# Environment: OUT (gpu_check.json, gpu_check.log and events.jsonl are written there),
# GPU_PEAK_FLOPS (bf16 dense peak for the MFU, default 989e12 = H200),
# VIT_SERVICE_CACHE_DIR (decoded/tokenised data cache, default .device/cache).
# Exit status: 0 every phase ran, 1 a phase failed (the JSON says which), 2 bad set-up.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x "$repo/.venv/bin/python" ]]; then
  py="$repo/.venv/bin/python"
else
  py="python3"
fi
if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: no Python interpreter '$py' (set PYTHON)" >&2
  exit 2
fi

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-true}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true

cd "$repo"
exec "$py" "$repo/benchmarks/gpu_check.py" "$@"
