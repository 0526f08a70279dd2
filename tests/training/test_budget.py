"""``budget_minutes``: a real CLI run on a tiny recipe ends on time, with its schedule done."""

import time
from pathlib import Path

import pytest

from tests.training.conftest import QUIET, mlflow_client, progress_events

pytestmark = pytest.mark.slow

BUDGET_S = 24.0


def test_budget_run_ends_on_time_with_the_lr_at_its_final_value(
        tmp_path: Path, data_dir: Path, run_cli, mlflow_db) -> None:
    uri = mlflow_db(tmp_path)
    env = {"VIT_SERVICE_HOME": str(tmp_path / "home"), **QUIET,
           "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache")}
    t0 = time.monotonic()
    proc = run_cli(["train", "cifar10-smoke", "--data-dir", str(data_dir), "--tracking-uri", uri,
                    "--set", f"budget_minutes={BUDGET_S / 60}", "--set", "log_every=1",
                    "--set", "optim.schedule=linear", "--no-register"], env)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the whole process, start-up and publishing included, within a few percent of the budget
    assert 0.85 * BUDGET_S <= wall <= 1.06 * BUDGET_S, wall
    events = progress_events(proc.stdout)
    end = events[-1]
    assert end["event"] == "end" and end["status"] == "finished"
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["step"] == end["step"] == end["total_steps"]
    assert steps[-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # min_lr on the last update
    assert max(e["lr"] for e in steps) == pytest.approx(3e-3, rel=0.05)  # the recipe's peak
    assert end["step"] > 2 * 12  # many more steps than the recipe's 2 epochs of 12
    run = mlflow_client(uri).get_run(events[0]["mlflow_run_id"])
    p, m = run.data.params, run.data.metrics
    assert float(p["recipe.budget_minutes"]) == pytest.approx(BUDGET_S / 60)
    assert float(p["budget.measured_steps_per_s"]) > 0
    assert int(p["budget.first_planned_steps"]) > 0
    assert m["budget/steps"] == end["step"] and 0 < m["budget/wall_s"] <= BUDGET_S * 1.02
