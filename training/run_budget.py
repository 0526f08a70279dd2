"""Budget mode of a training run (``budget_minutes``): what to keep free at the end, what one
evaluation costs, and re-sizing the schedule from the measured throughput.

A mixin of :class:`training.trainer._Run`: it reads the run's recipe, task, scheduler and
resolution schedule and moves ``total_steps``; the arithmetic of the plan itself is
:class:`training.optim.BudgetPlanner`'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from training.distributed import broadcast_object
from vit_service.models.layers import attention_path

if TYPE_CHECKING:
    from torch import nn

    from training.distributed import DistInfo
    from training.optim import BudgetPlanner, LrSchedule
    from training.progress import Progress
    from training.recipes import Recipe
    from training.reporting import MlflowRun
    from training.resolution import ResolutionSchedule
    from training.tasks import Task

log = logging.getLogger(__name__)

# What the end of a run costs besides its validation is measured before training
# (publish.rehearse_publish); until then the plan keeps this much, and afterwards a share of the
# budget as a margin for the noise in the throughput estimate.
PUBLISH_RESERVE_S = 5.0
BUDGET_MARGIN = 0.01
# registering in MLflow (database rows, the artifact copy) is the one part of the end the
# rehearsal cannot do without logging; it costs tenths of a second against a local store
REGISTER_S = 0.3


class BudgetedRun:
    """The budget-mode steps of a run (see the module docstring)."""

    recipe: Recipe
    dist: DistInfo
    task: Task
    budget: BudgetPlanner | None
    scheduler: LrSchedule
    resolution: ResolutionSchedule | None
    progress: Progress
    mlrun: MlflowRun | None
    step: int
    steps_per_epoch: int
    total_steps: int
    _budget_logged: bool

    if TYPE_CHECKING:  # the run's own
        def eval_model(self) -> nn.Module: ...
        def _set_train_mode(self) -> None: ...
        def _warmup_steps(self, total_steps: int) -> int: ...

    def _final_eval_s(self, eval_s: float) -> float:
        """The validation passes at the end: the fp32 one, and the bf16 one as served
        (training/publish.py), which runs on rank 0 over every rank's rows and is faster than
        the fp32 one, so one more eval_s per rank bounds it."""
        from training.publish import records_bf16_val

        return eval_s + (eval_s * self.dist.world_size if records_bf16_val(self) else 0.0)

    def _budget_probe(self) -> None:
        """Size what the plan keeps free at the end: time one validation batch to estimate
        what an evaluation costs (the plan keeps room for the intermediate ones and the last
        one; a resumed run measured it before) and rehearse publishing."""
        assert self.budget is not None
        if self.budget.eval_s <= 0 and not self._measure_eval():
            return  # no validation data: nothing to size
        publish_s = self._rehearse_publish()
        self.budget.keep_for_end(self._final_eval_s(self.budget.eval_s), publish_s,
                                 BUDGET_MARGIN)
        log.info("budget %.1f min: one evaluation ~%.1fs, publishing ~%.1fs, %.1fs kept for "
                 "the end", self.budget.budget_s / 60, self.budget.eval_s, publish_s,
                 self.budget.reserve_s)

    def _measure_eval(self) -> bool:
        """``budget.eval_s`` from one timed validation batch; False without validation data."""
        assert self.budget is not None
        t0 = time.perf_counter()
        bs = self.recipe.eval_batch_size
        model = self.eval_model()
        with torch.no_grad(), attention_path(model, fused=True):
            for batch in self.task.val_batches(bs):
                if self.recipe.pretraining:
                    self.task.pretrain_loss(model, batch)
                else:  # as evaluate() runs it: eval mode (all patches, flip TTA), fused
                    model.eval()
                    self.task.forward(model, batch)
                n = int(batch.labels.shape[0])
                break
            else:
                return False
        self._set_train_mode()
        per_example = (time.perf_counter() - t0) / max(1, n)
        self.budget.eval_s = per_example * self.task.n_val / max(1, self.dist.world_size)
        return True

    def _rehearse_publish(self) -> float:
        """Seconds publishing will take (rank 0 publishes; every rank follows its plan)."""
        from training.publish import rehearse_publish

        publish_s = 0.0
        if self.dist.is_main:
            try:
                publish_s = rehearse_publish(self) + (REGISTER_S if self.mlrun else 0.0)
            except Exception:  # the plan falls back to the default; the run goes on
                log.warning("could not rehearse publishing: keeping %.0fs for it",
                            PUBLISH_RESERVE_S, exc_info=True)
                publish_s = PUBLISH_RESERVE_S
        return float(broadcast_object(publish_s, self.dist)) if self.dist.enabled else publish_s

    def _budget_replan(self) -> None:
        assert self.budget is not None
        spe = self.steps_per_epoch
        stage = self.resolution.stage if self.resolution is not None else 0
        planned = self.budget.observe(self.step, steps_per_eval=spe * self.recipe.eval_every,
                                      stage=stage)
        if planned is None:
            return
        # every rank follows rank 0's plan (their clocks and rates differ slightly)
        planned = int(broadcast_object(planned, self.dist)) if self.dist.enabled else planned
        first, self._budget_logged = not self._budget_logged, True
        if first and self.recipe.optim.warmup_fraction is not None:
            self.scheduler.warmup_steps = max(self.step + 1, min(
                self._warmup_steps(planned), planned - 1))
        # a plan that cuts the run at the update just made (which ran at the lr of the older,
        # longer plan) gets one more update, at the final lr; a run already at its end stops
        self.scheduler.set_total_steps(max(planned, min(self.step + 1, self.total_steps)))
        self.total_steps = self.scheduler.total_steps
        self.progress.total_steps = self.total_steps
        if first:
            fp = self.budget.first_plan or {}
            log.info("budget: %.2f steps/s measured -> %d steps (%.1f epochs)",
                     fp.get("steps_per_s", 0.0), self.total_steps, self.total_steps / spe)
            if self.mlrun is not None:
                self.mlrun.log_params({
                    "budget.measured_steps_per_s": round(fp.get("steps_per_s", 0.0), 4),
                    "budget.measured_items_per_s": round(
                        fp.get("steps_per_s", 0.0) * self.recipe.batch_size, 1),
                    "budget.first_planned_steps": self.total_steps,
                    "budget.reserve_s": round(self.budget.reserve_s, 1),
                    "budget.publish_s": round(self.budget.publish_s, 2)})
        if self.mlrun is not None:
            self.mlrun.log_metrics({"budget/planned_steps": self.total_steps,
                                    "budget/steps_per_s": self.budget.rate or 0.0}, self.step)
