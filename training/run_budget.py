"""Budget mode of a training run (``budget_minutes``): what to keep free at the end, what one
evaluation costs, re-sizing the schedule from the measured throughput, and the report of how
the run kept its budget.

:class:`BudgetController` is given everything it uses (the plan, the schedule it moves, the
MLflow run it logs to) and is called by the training loop at fixed points: :meth:`probe`
before the first step, :meth:`replan` after each update, :meth:`pause` / :meth:`resume` around
epoch ends, :meth:`report` at the end. The arithmetic of the plan is
:class:`training.optim.BudgetPlanner`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from training.distributed import DistInfo, broadcast_object
from training.optim import BudgetPlanner, LrSchedule
from training.reporting import MlflowRun

log = logging.getLogger(__name__)

# What the end of a run costs besides its validation is measured before training
# (publish.rehearse_publish); until then the plan keeps this much, and afterwards a share of the
# budget as a margin for the noise in the throughput estimate.
PUBLISH_RESERVE_S = 5.0
BUDGET_MARGIN = 0.01
# registering in MLflow (database rows, the artifact copy) is the one part of the end the
# rehearsal cannot do without logging; it costs tenths of a second against a local store
REGISTER_S = 0.3


class BudgetController:
    """Keeps a run inside ``planner.budget_s`` (see the module docstring)."""

    def __init__(self, planner: BudgetPlanner, dist: DistInfo, mlrun: MlflowRun | None, *,
                 batch_size: int, steps_per_epoch: int, eval_every: int,
                 warmup_steps: Callable[[int], int] | None) -> None:
        """``warmup_steps(total)``: the warm-up a schedule of ``total`` steps gets, when it
        is a fraction of the run (re-sized with the first plan); None: fixed warm-up."""
        self.planner, self.dist, self.mlrun = planner, dist, mlrun
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.steps_per_eval = steps_per_epoch * eval_every
        self.warmup_steps = warmup_steps
        self.planned_once = False
        # a guess until probe() measures the end
        planner.keep_for_end(0.0, PUBLISH_RESERVE_S, BUDGET_MARGIN)

    # ------------------------------------------------------------------ before the first step

    def probe(self, measure_eval: Callable[[], float | None],
              measure_end: Callable[[float], float | None],
              rehearse_publish: Callable[[], float], with_mlflow: bool) -> None:
        """Size what the plan keeps free: ``measure_eval()`` estimates the seconds of one
        intermediate validation pass (None: no validation data, nothing to size; a resumed run
        measured it before), ``measure_end(eval_s)`` those of the passes the end runs (the last one
        sees every TTA view and may run twice: fp32, and as served; ``eval_s``, the intermediate
        pass's, stands for a last pass run the same way), and
        ``rehearse_publish()`` times publishing (rank 0; every rank follows its plan)."""
        b = self.planner
        if b.eval_s <= 0:
            eval_s = measure_eval()
            if eval_s is None:
                return
            b.eval_s = eval_s
        end_s = measure_end(b.eval_s) or 0.0
        publish_s = 0.0
        if self.dist.is_main:
            try:
                publish_s = rehearse_publish() + (REGISTER_S if with_mlflow else 0.0)
            except Exception:  # the plan falls back to the default; the run goes on
                log.warning("could not rehearse publishing: keeping %.0fs for it",
                            PUBLISH_RESERVE_S, exc_info=True)
                publish_s = PUBLISH_RESERVE_S
        if self.dist.enabled:
            publish_s = float(broadcast_object(publish_s, self.dist))
        b.keep_for_end(end_s, publish_s, BUDGET_MARGIN)
        log.info("budget %.1f min: one evaluation ~%.1fs, the end's ~%.1fs, publishing ~%.1fs, "
                 "%.1fs kept for the end", b.budget_s / 60, b.eval_s, end_s, publish_s,
                 b.reserve_s)

    # ------------------------------------------------------------------ while training

    def replan(self, step: int, stage: int, scheduler: LrSchedule) -> int | None:
        """After update ``step``: the planner's new length of the run, applied to
        ``scheduler``; None when it did not re-plan."""
        planned = self.planner.observe(step, steps_per_eval=self.steps_per_eval, stage=stage)
        if planned is None:
            return None
        # every rank follows rank 0's plan (their clocks and rates differ slightly)
        planned = int(broadcast_object(planned, self.dist)) if self.dist.enabled else planned
        first, self.planned_once = not self.planned_once, True
        if first and self.warmup_steps is not None:
            scheduler.warmup_steps = max(step + 1, min(self.warmup_steps(planned), planned - 1))
        # a plan that cuts the run at the update just made (which ran at the lr of the older,
        # longer plan) gets one more update, at the final lr; a run already at its end stops
        scheduler.set_total_steps(max(planned, min(step + 1, scheduler.total_steps)))
        total = scheduler.total_steps
        if first:
            self._log_first_plan(total)
        if self.mlrun is not None:
            self.mlrun.log_metrics({"budget/planned_steps": total,
                                    "budget/steps_per_s": self.planner.rate or 0.0}, step)
        return total

    def _log_first_plan(self, total: int) -> None:
        fp = self.planner.first_plan or {}
        rate = fp.get("steps_per_s", 0.0)
        log.info("budget: %.2f steps/s measured -> %d steps (%.1f epochs)", rate, total,
                 total / self.steps_per_epoch)
        if self.mlrun is not None:
            self.mlrun.log_params({
                "budget.measured_steps_per_s": round(rate, 4),
                "budget.measured_items_per_s": round(rate * self.batch_size, 1),
                "budget.first_planned_steps": total,
                "budget.reserve_s": round(self.planner.reserve_s, 1),
                "budget.publish_s": round(self.planner.publish_s, 2)})

    def pause(self) -> None:
        """Evaluation and checkpointing are not training time (the plan keeps room for them)."""
        self.planner.pause()

    def resume(self, eval_s: float | None = None) -> None:
        """Back to training; ``eval_s``: what the evaluation just made took, for the plan."""
        if eval_s is not None:
            self.planner.eval_s = eval_s
        self.planner.resume()

    # ------------------------------------------------------------------ at the end

    def report(self, step: int, status: str, end_s: float) -> None:
        """How the run kept its budget, in the log and in MLflow; a run that ended early says
        why (``budget_underrun_reason``). ``status``: how the loop ended (``stopped by
        max_steps``, ``interrupted``...); ``end_s``: what the end took."""
        b = self.planner
        wall = time.monotonic() - b.start
        log.info("budget: %d steps in %.1fs of a %.0fs budget (%+.1f%%); the end took %.1fs "
                 "(%.1fs kept for it)", step, wall, b.budget_s, 100 * (wall / b.budget_s - 1),
                 end_s, b.final_eval_s + b.publish_s)
        reason = b.underrun_reason(wall, status, end_s)
        if reason is not None:
            log.warning("budget underrun: %s", reason)
        if self.mlrun is not None:
            self.mlrun.log_metrics({"budget/wall_s": wall, "budget/steps": step,
                                    "budget/epochs": step / self.steps_per_epoch,
                                    "budget/end_s": end_s}, step)
            if reason is not None:
                self.mlrun.log_params({"budget_underrun_reason": reason})
