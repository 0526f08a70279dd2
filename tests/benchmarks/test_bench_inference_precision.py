"""``benchmarks/bench_inference_precision.py`` runs end to end on a tiny bundle and prints the
eight rows (the figures themselves come from full runs, never from tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.training.conftest import REPO
from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD, BundleMeta, save_bundle
from vit_service.models import config_to_dict, create_model


def test_bench_inference_precision_prints_every_configuration(tmp_path: Path) -> None:
    model = create_model("vit_test").eval()
    meta = BundleMeta(task="image", model_config=config_to_dict(model.config),
                      class_names=[str(i) for i in range(10)],
                      preprocess={"image_size": 32, "mean": list(CIFAR10_MEAN),
                                  "std": list(CIFAR10_STD)})
    bundle = save_bundle(tmp_path / "b", model, meta)
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_inference_precision.py", "--bundle", str(bundle),
         "--batch", "4", "--calls", "1", "--rounds", "1", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "fell back" not in proc.stderr  # both precisions traced
    rows = re.findall(r"^\| (eager|traced) (fp32|bf16) \| (logits|\+ weights) \| ([\d,]+) \| "
                      r"([\d.]+)x \|$", proc.stdout, re.M)
    assert [(f, p, o) for f, p, o, _, _ in rows] == [
        (f, p, o) for f, p in (("eager", "fp32"), ("traced", "fp32"), ("eager", "bf16"),
                               ("traced", "bf16")) for o in ("logits", "+ weights")]
    assert all(int(rate.replace(",", "")) > 0 for *_, rate, _ in rows)
    assert rows[0][4] == rows[1][4] == "1.00"
