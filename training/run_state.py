"""Where a run is, and what a checkpoint stores to pick up from there.

:class:`RunState` is the position (step, epoch, batch, planned total, last evaluation);
:class:`Trainables` the objects the updates move (weights, EMA, optimiser, schedule, budget
plan). A checkpoint is both plus every rank's RNG state and what identifies the run (recipe,
model config, tokenizer, lineage, MLflow run); :mod:`training.checkpoint` does the file I/O.
The dictionary's keys are the checkpoint format: checkpoints written by earlier versions load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer

from training import checkpoint as ckpt_io
from training.distributed import DistInfo, gather_objects
from training.evaluate import EvalResult, LossResult
from training.optim import BudgetPlanner, LrSchedule, ModelEma
from training.step import seed_everything

log = logging.getLogger(__name__)


@dataclass
class Trainables:
    """What the updates change, each with its own ``state_dict``."""

    model: nn.Module
    ema: ModelEma | None
    optimizer: Optimizer
    scheduler: LrSchedule
    budget: BudgetPlanner | None  # budget mode's plan (measured rates, pauses)

    def eval_model(self) -> nn.Module:
        """The weights that are evaluated and published: the EMA's when there is one."""
        return self.ema.module if self.ema is not None else self.model


@dataclass
class RunState:
    """The position of a run."""

    total_steps: int  # the schedule's length (budget mode re-plans it)
    step: int = 0  # updates done
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch done
    last_eval: EvalResult | LossResult | None = None
    last_eval_step: int = -1  # the step last_eval (or the checkpoint's figure) was taken at
    saved_step: int = -1  # the step of the last checkpoint written

    def to_checkpoint(self, parts: Trainables, identity: dict[str, Any], status: str,
                      dist: DistInfo) -> dict[str, Any]:
        """The checkpoint dictionary; a collective under DDP (the RNG states are gathered):
        every rank calls it. ``identity``: recipe, objective, model_config, tokenizer,
        lineage, mlflow_run_id, run_name."""
        rngs = gather_objects(ckpt_io.rng_state(), dist)
        return {
            "model": parts.model.state_dict(),
            "ema": parts.ema.state_dict() if parts.ema is not None else None,
            "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(),
            "budget": parts.budget.state_dict() if parts.budget is not None else None,
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "rng": rngs,
            **identity,
            "status": str(status),  # a plain str: weights_only loading allows no enums
            "world_size": dist.world_size,
            "metrics": {
                "val_acc": self.last_eval.acc if self.last_eval else None,
                "val_loss": self.last_eval.loss if self.last_eval else None,
                "eval_step": self.last_eval_step,
            },
        }

    @classmethod
    def from_checkpoint(cls, ck: dict[str, Any], parts: Trainables, dist: DistInfo,
                        seed: int, total_steps: int) -> RunState:
        """Load ``ck`` into ``parts`` and return the position it was saved at; this rank's RNG
        state comes back (reseeded when the world size changed). ``total_steps``: the
        recipe's, kept unless the checkpoint's schedule or budget plan says otherwise."""
        parts.model.load_state_dict(ck["model"])
        if parts.ema is not None and ck.get("ema") is not None:
            parts.ema.load_state_dict(ck["ema"])
        parts.optimizer.load_state_dict(ck["optimizer"])
        parts.scheduler.load_state_dict(ck["scheduler"])
        if parts.budget is not None and ck.get("budget"):
            parts.budget.load_state_dict(ck["budget"])
        if parts.budget is not None or ck["scheduler"].get("total_steps"):
            total_steps = parts.scheduler.total_steps
        state = cls(total_steps, step=int(ck["step"]), epoch=int(ck["epoch"]),
                    batch_in_epoch=int(ck["batch_in_epoch"]))
        rngs = ck.get("rng") or []
        if len(rngs) == dist.world_size:
            ckpt_io.set_rng_state(rngs[dist.rank])
        else:
            log.warning("checkpoint has RNG states for %d ranks, running %d: reseeding",
                        len(rngs), dist.world_size)
            seed_everything(seed + dist.rank + state.step)
        m = ck.get("metrics") or {}
        if m.get("val_acc") is not None or m.get("val_loss") is not None:
            state.last_eval_step = int(m.get("eval_step", -1))
        return state
