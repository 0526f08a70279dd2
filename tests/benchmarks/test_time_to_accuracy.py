"""The time-to-accuracy table and plot from a results file (benchmarks/time_to_accuracy.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_plot_and_table_from_results(tmp_path: Path) -> None:
    rows = [{"recipe": "r", "budget_minutes": b, "seed": s, "val_acc": acc, "steps": st,
             "wall_s": 60 * b - 5, "load_before": 0.1, "load_after": 2.0, "cpu": "CPU X",
             "cores": 2}
            for b, s, acc, st in ((5, 0, 0.70, 100), (5, 1, 0.72, 110), (10, 0, 0.80, 200))]
    # history that must stay out of the table and the plot (e.g. a slower machine's run)
    rows.append({**rows[2], "seed": 1, "val_acc": 0.10, "superseded": "a slower machine"})
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plot.png"
    proc = subprocess.run([sys.executable, "benchmarks/time_to_accuracy.py", "plot",
                           "--recipes", "r", "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()  # the recipe's name, a blank line, then its table
    assert lines[0] == "`r`" and lines[2].startswith("| budget |")
    # steps/s over the wall time: 100 / 295 and 110 / 295 -> 0.36; 200 / 595 -> 0.34
    assert lines[4].startswith("| 5 min | 2 | 70.00 / 72.00 % | **71.00 %** | 105 | 0.4 |")
    assert lines[5].startswith("| 10 min | 1 | 80.00 % | **80.00 %** | 200 | 0.3 |")
    assert len(lines) == 6
