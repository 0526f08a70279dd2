"""``budget_minutes``: the plan ends a run at its deadline, its schedule done.

The planner's behaviour is proven on a simulated clock (deterministic, whatever else the
machine runs); one real CLI run on the smoke recipe checks, in the run's own accounts, that
the trainer feeds it the measured costs (the end's cost included) and ends within the plan's
own resolution."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.training.conftest import QUIET, REPO, mlflow_client, progress_events
from training.optim import BudgetPlanner, LrSchedule
from training.run_budget import PUBLISH_RESERVE_S

BUDGET_S = 24.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _simulate(budget_s: float, step_s, eval_s: float, end_s: float, kept_end_s: float,
              steps_per_epoch: int = 12, startup_s: float = 3.0) -> tuple[float, float, int]:
    """A run as the trainer drives the planner: start-up, then steps of ``step_s(step)``
    seconds with a paused evaluation of ``eval_s`` after each epoch, the plan re-sized after
    every step, then the end (last validation and publishing) taking ``end_s`` while the
    plan kept ``kept_end_s`` for it. Returns (wall seconds, last lr, steps)."""
    clock = FakeClock()
    start = clock.t
    clock.t += startup_s  # the process's start-up counts against the budget
    b = BudgetPlanner(budget_s, start, reserve_s=5.0, warmup_steps=5, clock=clock)
    b.eval_s = eval_s
    b.keep_for_end(final_eval_s=eval_s, publish_s=kept_end_s - eval_s)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LrSchedule(opt, 1e-2, 24, 4, 0.0, "linear")
    step = lr = 0
    while step < sched.total_steps:
        lr = sched.apply()
        clock.t += step_s(step)
        sched.step()
        step += 1
        planned = b.observe(step, steps_per_eval=steps_per_epoch)
        if planned is not None:  # as training/run_budget.py applies a plan
            sched.set_total_steps(max(planned, min(step + 1, sched.total_steps)))
        if step % steps_per_epoch == 0 and step < sched.total_steps:
            b.pause()
            clock.t += eval_s
            b.resume()
    clock.t += end_s
    return clock.t - start, lr, step


@pytest.mark.parametrize("step_s", [0.02, 0.08])
def test_plan_ends_at_the_deadline_when_the_end_costs_what_was_measured(step_s: float) -> None:
    wall, lr, steps = _simulate(BUDGET_S, lambda i: step_s, eval_s=0.05, end_s=0.9,
                                kept_end_s=0.95)
    # the margin (1 % of the budget) and one step are the plan's resolution
    assert BUDGET_S - 0.01 * BUDGET_S - 0.1 - step_s <= wall <= BUDGET_S
    assert lr == pytest.approx(0.0, abs=1e-9)  # the last update ran at the final lr
    assert steps > 24


def test_plan_follows_a_machine_that_slows_down_midway() -> None:
    wall, lr, _ = _simulate(BUDGET_S, lambda i: 0.02 if i < 300 else 0.05, eval_s=0.05,
                            end_s=0.9, kept_end_s=0.95)
    assert BUDGET_S * 0.97 <= wall <= BUDGET_S * 1.005
    assert lr == pytest.approx(0.0, abs=1e-9)


def test_a_guessed_end_cost_ends_early_and_says_why() -> None:
    # what the planner did before it measured the end: 5 s kept, 1.2 s used (a fast CPU)
    b = BudgetPlanner(BUDGET_S, 0.0, reserve_s=0.0)
    b.keep_for_end(final_eval_s=0.05, publish_s=4.95)
    wall, _, _ = _simulate(BUDGET_S, lambda i: 0.02, eval_s=0.05, end_s=1.2, kept_end_s=5.0)
    assert wall < 0.85 * BUDGET_S  # the 20.2 s of a 24 s budget seen on such a CPU
    reason = b.underrun_reason(wall, "finished", end_s=1.2)
    assert reason is not None and "1.2s of the 5.0s" in reason
    assert b.underrun_reason(BUDGET_S - 0.3, "finished", end_s=1.2) is None  # on time
    assert "stopped by max_steps" in b.underrun_reason(10.0, "stopped by max_steps", None)


@pytest.mark.slow
def test_budget_run_ends_on_time_with_the_lr_at_its_final_value(
        tmp_path: Path, data_dir: Path, run_cli, mlflow_db) -> None:
    uri = mlflow_db(tmp_path)
    env = {"VIT_SERVICE_HOME": str(tmp_path / "home"), **QUIET,
           "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache")}
    proc = run_cli(["train", "cifar10-smoke", "--data-dir", str(data_dir), "--tracking-uri", uri,
                    "--set", f"budget_minutes={BUDGET_S / 60}", "--set", "log_every=1",
                    "--set", "optim.schedule=linear", "--no-register"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
    # the end's cost was rehearsed (tenths of a second), not the guessed default
    assert 0 < float(p["budget.publish_s"]) < PUBLISH_RESERVE_S
    # On time, or early only because the end cost less than the rehearsal measured (a load
    # that came and went between the two): then the run says so, and the accounts below hold.
    # Any other reason (stopped, a throughput the plan misjudged) fails.
    reason = p.get("budget_underrun_reason")
    assert reason is None or reason.startswith("the last validation and publishing took"), reason
    # Timing in the run's own accounts, so that a loaded machine cannot fail it: training
    # stops when what was kept for the end (``reserve_s``) is left, then the end takes what it
    # takes (``end_s``). The run's wall time is therefore the budget less what was kept plus
    # what the end used, to within the plan's resolution near the deadline (a re-plan at
    # least every second, one step: ~0.1 s on a machine at load 2). The tolerance is below
    # what the run keeps for its end (~1 s), so a trainer that did not keep it, fed the plan
    # other costs than the measured ones or did not follow the plan fails.
    wall, end_s, kept = m["budget/wall_s"], m["budget/end_s"], float(p["budget.reserve_s"])
    assert 0 < end_s < BUDGET_S and kept > 0.75
    expected = BUDGET_S - kept + end_s
    assert expected - 0.75 <= wall <= expected + 0.75, (wall, kept, end_s)
    assert m["budget/steps"] == end["step"]

SCRIPT_WITHOUT_MLFLOW = """
import logging, sys
sys.modules["mlflow"] = None  # as on an accelerator image without the package: import fails
from pathlib import Path
from training.recipes import load_recipe
from training.run import prepare_run
from vit_service.config import Settings
logging.basicConfig(level=logging.WARNING)
home = Path(sys.argv[2])
recipe = load_recipe("cifar10-smoke", {"budget_minutes": 0.1, "attention_samples": 0})
run = prepare_run(recipe, data_dir=sys.argv[1], register=False, mlflow_enabled=False,
                  settings=Settings(home=home, cache_dir=home / "cache"))
result = run.run()
print("STATUS", result.status, (Path(result.run_dir) / "bundle" / "meta.json").is_file())
"""


@pytest.mark.slow
def test_a_budget_run_without_mlflow_needs_no_mlflow_package(
        tmp_path: Path, data_dir: Path) -> None:
    # The GPU check trains with MLflow off on an image that has no mlflow: the budget's
    # rehearsal of publishing must not import it (it did, and fell back to a guessed 5 s).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, **QUIET,
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT_WITHOUT_MLFLOW, str(data_dir),
                           str(tmp_path / "home")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATUS finished True" in proc.stdout
    assert "could not rehearse" not in proc.stderr, proc.stderr[-3000:]
