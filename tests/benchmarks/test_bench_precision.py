"""``benchmarks/bench_precision.py`` runs end to end on a tiny recipe and prints one row per
configuration (the figures themselves come from full runs, never from tests)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.training.conftest import REPO


def test_bench_precision_prints_every_configuration() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_precision.py", "--recipe", "cifar10-smoke",
         "--batch", "8", "--steps", "1", "--rounds", "1", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\| (fused|explicit) (fp32|bf16) \| ([\d,]+) \| ([\d.]+)x \|$",
                      proc.stdout, re.M)
    # 4 training rows (cifar10-smoke trains at 32 px only) + 2 validation rows
    assert [(p, d) for p, d, _, _ in rows] == [
        ("fused", "fp32"), ("fused", "bf16"), ("explicit", "fp32"), ("explicit", "bf16"),
        ("fused", "fp32"), ("explicit", "fp32")]
    assert all(int(rate.replace(",", "")) > 0 for _, _, rate, _ in rows)
    assert rows[0][3] == "1.00" and rows[4][3] == "1.00"
