"""What a training run checkpoints and how it picks up from one: weights, EMA, optimiser,
schedule, budget plan, position, every rank's RNG state, the recipe, config, tokenizer and
lineage (:mod:`training.checkpoint` does the file I/O).

A mixin of :class:`training.trainer._Run`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training import checkpoint as ckpt_io
from training.distributed import gather_objects
from training.step import seed_everything

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

    from training.distributed import DistInfo
    from training.evaluate import EvalResult, LossResult
    from training.init import Lineage
    from training.optim import BudgetPlanner, LrSchedule, ModelEma
    from training.recipes import Recipe
    from training.tasks import Task

log = logging.getLogger(__name__)


class CheckpointedRun:
    """The checkpoint side of a run (see the module docstring)."""

    recipe: Recipe
    dist: DistInfo
    task: Task
    model: nn.Module
    model_config: dict[str, Any]
    ema: ModelEma | None
    optimizer: Optimizer
    scheduler: LrSchedule
    budget: BudgetPlanner | None
    lineage: Lineage
    run_name: str
    ckpt_path: Path
    step: int
    epoch: int
    batch_in_epoch: int
    total_steps: int
    last_eval: EvalResult | LossResult | None
    last_eval_step: int
    _saved_step: int

    def _load_state(self, ck: dict[str, Any]) -> None:
        self.model.load_state_dict(ck["model"])
        if self.ema is not None and ck.get("ema") is not None:
            self.ema.load_state_dict(ck["ema"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scheduler.load_state_dict(ck["scheduler"])
        if self.budget is not None and ck.get("budget"):
            self.budget.load_state_dict(ck["budget"])
        if self.budget is not None or ck["scheduler"].get("total_steps"):
            self.total_steps = self.scheduler.total_steps
        self.step, self.epoch = int(ck["step"]), int(ck["epoch"])
        self.batch_in_epoch = int(ck["batch_in_epoch"])
        rngs = ck.get("rng") or []
        if len(rngs) == self.dist.world_size:
            ckpt_io.set_rng_state(rngs[self.dist.rank])
        else:
            log.warning("checkpoint has RNG states for %d ranks, running %d: reseeding",
                        len(rngs), self.dist.world_size)
            seed_everything(self.recipe.seed + self.dist.rank + self.step)
        m = ck.get("metrics") or {}
        if m.get("val_acc") is not None or m.get("val_loss") is not None:
            self.last_eval_step = int(m.get("eval_step", -1))

    def _state(self, status: str, run_id: str | None) -> dict[str, Any]:
        rngs = gather_objects(ckpt_io.rng_state(), self.dist)
        return {
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "budget": self.budget.state_dict() if self.budget is not None else None,
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": rngs,
            "recipe": self.recipe.to_dict(),
            "objective": self.recipe.objective,
            "model_config": self.model_config,  # the (encoder's, when pretraining) config
            "tokenizer": self.task.tokenizer.to_str() if self.task.tokenizer else None,
            "lineage": self.lineage.to_dict(),
            "mlflow_run_id": run_id, "run_name": self.run_name, "status": status,
            "world_size": self.dist.world_size,
            "metrics": {
                "val_acc": self.last_eval.acc if self.last_eval else None,
                "val_loss": self.last_eval.loss if self.last_eval else None,
                "eval_step": self.last_eval_step,
            },
        }

    def _save(self, status: str, run_id: str | None) -> Path:
        state = self._state(status, run_id)  # collective in DDP: every rank takes part
        if self.dist.is_main:
            ckpt_io.save_checkpoint(self.ckpt_path, state)
        self._saved_step = self.step
        return self.ckpt_path
