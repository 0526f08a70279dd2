"""``benchmarks/gpu_check.sh --dry-run``: the GPU check's whole flow (CIFAR-10 training with
time-to-accuracy, FLOP count and MFU; IMDb MLM pretraining then fine-tuning from its bundle) on
the CPU with the smoke recipes, on generated data in the real archive formats."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.conftest import QUIET, REPO, make_cifar_archive, make_imdb_archive


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gpu-check")
    data = root / "data"
    data.mkdir()
    make_cifar_archive(data / "cifar10-jpeg-train.tar.gz")
    make_imdb_archive(data / "aclImdb-train.tar.gz")
    out = root / "out"
    env = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, **QUIET,
           "PYTHON": sys.executable, "OUT": str(out), "VIT_SERVICE_CACHE_DIR": str(root / "cache"),
           "GPU_PEAK_FLOPS": "1e12"}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--data-dir", str(data),
                           "--home", str(root / "home")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    return {"proc": proc, "out": out, "root": root}


def _unit(x: object) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def test_dry_run_exits_0_and_writes_the_summary(dry_run: dict) -> None:
    proc = dry_run["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((dry_run["out"] / "gpu_check.json").read_text())
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith('{"schema"'))
    assert json.loads(line) == summary  # also on stdout
    assert summary["ok"] is True and summary["dry_run"] is True and summary["errors"] == []
    assert summary["device"]["peak_flops"] == 1e12  # GPU_PEAK_FLOPS is honoured
    assert "time to 94 %" in proc.stdout and "MFU" in proc.stdout  # the table
    assert (dry_run["out"] / "gpu_check.log").stat().st_size > 0
    events = [json.loads(line) for line in (dry_run["out"] / "events.jsonl").open()]
    assert {e["phase"] for e in events} == {"cifar", "mlm", "finetune"}


def test_dry_run_cifar_figures_are_sane(dry_run: dict) -> None:
    c = json.loads((dry_run["out"] / "gpu_check.json").read_text())["cifar"]
    assert c["recipe"] == "cifar10-smoke" and c["status"] == "finished"
    assert {"time_to_90_s", "time_to_94_s", "final_val_acc", "images_per_s", "flops_per_item",
            "mfu", "curve", "train_s"} <= set(c)
    assert _unit(c["final_val_acc"]) and _unit(c["best_val_acc"])
    assert c["best_val_acc"] >= c["final_val_acc"]
    assert c["images_per_s"] > 0 and c["flops_per_item"] > 0
    # vit_test at 32x32, patch 8: forward + backward is a few MFLOPs per image
    assert 1e6 < c["flops_per_item"] < 1e8
    assert c["mfu"] == pytest.approx(c["flops_per_item"] * c["images_per_s"] / 1e12)
    assert len(c["curve"]) == 2 and all(_unit(p["val_acc"]) for p in c["curve"])
    for key in ("time_to_90_s", "time_to_94_s"):  # seconds after training start, or None
        t = c[key]
        assert t is None or (0 < t <= c["train_s"] + 1e-6 and math.isfinite(t))


def test_dry_run_imdb_pretrains_then_fine_tunes_from_the_bundle(dry_run: dict) -> None:
    imdb = json.loads((dry_run["out"] / "gpu_check.json").read_text())["imdb"]
    pre, ft = imdb["pretrain"], imdb["finetune"]
    assert pre["recipe"] == "imdb-mlm-smoke" and pre["status"] == "finished"
    assert pre["final_val_acc"] is None and 0 < pre["final_val_loss"] < 20
    assert pre["n_train"] == 201  # 200 labelled train reviews + the 1 unlabelled one
    assert pre["tokens_per_s"] > 0
    assert ft["recipe"] == "imdb-transformer-finetune-smoke" and ft["status"] == "finished"
    assert ft["init_from"] == str(Path(pre["run_dir"]) / "bundle")
    assert _unit(ft["final_val_acc"]) and ft["tokens_per_s"] > 0
    assert imdb["total_s"] > 0
    meta = json.loads((Path(ft["run_dir"]) / "bundle" / "meta.json").read_text())
    assert meta["extra"]["lineage"]["init"] == "bundle"


def test_budget_mode_ends_on_time_and_its_last_evaluation_is_on_the_curve(
        tmp_path: Path, dry_run: dict) -> None:
    """``--only cifar --cifar-set budget_minutes=...``: the trainer sizes the run to the
    budget, which ends mid-epoch; that final evaluation is the curve's last point."""
    root = dry_run["root"]
    env = {**os.environ, **QUIET, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "VIT_SERVICE_CACHE_DIR": str(root / "cache")}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--data-dir",
                           str(root / "data"), "--home", str(tmp_path / "home"), "--only",
                           "cifar", "--cifar-set", "budget_minutes=0.25"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    c = s["cifar"]
    assert s["imdb"] is None and c["budget_minutes"] == 0.25 and c["status"] == "finished"
    assert c["steps"] > 2 * 12  # sized by the measured rate, not by the recipe's 2 epochs
    assert c["total_s"] < 0.25 * 60 + 5
    last = c["curve"][-1]
    assert last["step"] == c["steps"] and last["val_acc"] == c["final_val_acc"]


def test_bad_setup_is_exit_code_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--data-dir",
                           str(tmp_path / "nowhere")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "not found" in proc.stderr
