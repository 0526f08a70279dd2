"""How a run validates: the passes for the curve, the last (fp32) one it reports, the pass as
the server answers on this CPU, and a quick estimate of what one pass costs (budget mode).

:class:`Validator` is given what it needs (recipe, task, device, precision) and takes the
model to evaluate as an argument: it holds no training state.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from training.distributed import DistInfo, all_reduce_sum
from training.evaluate import EvalResult, LossResult, evaluate_batches, evaluate_in_precision
from training.objectives import pretrain_eval, pretrain_loss
from training.recipes import Recipe
from training.tasks import Task
from vit_service.execution import Execution, resolve_execution
from vit_service.precision import Precision, resolve_precision, serving_execution
from vit_service.tta import shifts

log = logging.getLogger(__name__)


class Validator:
    """The validation passes of one run."""

    def __init__(self, recipe: Recipe, task: Task, dist: DistInfo) -> None:
        self.recipe, self.task, self.dist = recipe, task, dist

    @property
    def served_precision(self) -> Precision:
        """What the server answers in on this device by default (``inference_precision:
        auto``, :func:`vit_service.precision.resolve_precision`)."""
        return resolve_precision("auto", self.dist.device)

    def execution(self, final: bool = True) -> Execution:
        """How a pass runs: fused, fp32 on the CPU (``validate``:
        :func:`vit_service.execution.resolve_execution`); ``final=False`` with
        ``val_precision: served`` as the server answers, where that is bf16."""
        r, dev = self.recipe, self.dist.device
        if not final and r.val_precision == "served" and self.served_precision == "bf16":
            return serving_execution("bf16", dev)
        return resolve_execution("validate", dev, amp=r.amp)

    @property
    def records_bf16_val(self) -> bool:
        """Whether the end measures the validation accuracy as served in bf16: a classifier
        trained on a CPU with native bf16, where the server answers in bf16 by default."""
        return not self.recipe.pretraining and self.served_precision == "bf16"

    def run(self, model: nn.Module, final: bool = True) -> EvalResult | LossResult:
        """A pass over this rank's share of the split, summed over the ranks. ``final=False``
        (an intermediate pass, for the curve) runs in the served precision when the recipe
        says ``val_precision: served``."""
        r, dev = self.recipe, self.dist.device
        reduce = (lambda t: all_reduce_sum(t, self.dist)) if self.dist.enabled else None
        if r.pretraining:
            with self.execution().autocast():  # attention on the training forward's path
                return pretrain_eval(self.task, model, r.eval_batch_size, reduce)
        ex = self.execution(final)
        with ex.applied(model):
            return evaluate_batches(model, self.task.val_batches(r.eval_batch_size),
                                    functools.partial(self.task.forward, final=final),
                                    self.task.class_names, dev, ex.dtype, reduce)

    def served(self, model: nn.Module, fp32_acc: float | None) -> EvalResult | None:
        """The whole split once more (call on rank 0), as the server runs the model on this
        CPU by default (bf16 autocast, explicit attention), so that the bundle and MLflow
        carry the accuracy it answers with (``val_acc_bf16``); None elsewhere."""
        if not self.records_bf16_val:
            return None
        t = time.perf_counter()
        res = evaluate_in_precision(model, self.task.val_batches(self.recipe.eval_batch_size,
                                                                 all_ranks=True),
                                    self.task.forward, self.task.class_names,
                                    self.dist.device, "bf16")
        log.info("validation as served in bf16: val_acc %.4f (fp32 %.4f), %.1fs", res.acc,
                 fp32_acc if fp32_acc is not None else float("nan"), time.perf_counter() - t)
        return res

    def time_pass(self, model: nn.Module, final: bool = True,
                  served: bool = False) -> float | None:
        """Seconds of one pass, estimated from one timed batch run as that pass runs it: an
        intermediate one (``final=False``: its precision, the flip pair only), the last one
        (fp32, every view), or with ``served`` the pass as served (:meth:`served`: bf16, every
        view, on rank 0 over the whole split). None without validation data. Leaves ``model``
        in eval mode."""
        ex = serving_execution("bf16", self.dist.device) if served else self.execution(final)
        t0 = time.perf_counter()
        with torch.no_grad(), ex.applied(model):
            for batch in self.task.val_batches(self.recipe.eval_batch_size):
                if self.recipe.pretraining:
                    pretrain_loss(self.task, model, batch)
                else:
                    model.eval()
                    self.task.forward(model, batch, final=final)
                n = int(batch.labels.shape[0])
                break
            else:
                return None
        per_example = (time.perf_counter() - t0) / max(1, n)
        return per_example * self.task.n_val / (1 if served else max(1, self.dist.world_size))

    def time_end(self, model: nn.Module, intermediate_s: float | None = None) -> float | None:
        """Seconds of the passes the end runs: the last fp32 one, and the one as served where
        the run records it (:attr:`records_bf16_val`). None without validation data.
        ``intermediate_s``: an intermediate pass's seconds, taken for the last pass where that
        runs the same way (the same execution, and no shifted views the intermediate one
        leaves out) instead of timing it again."""
        model.eval()  # tta.shifts reads eval mode
        same = (intermediate_s is not None and self.execution(final=False) == self.execution()
                and not shifts(model))
        last = intermediate_s if same else self.time_pass(model)
        if last is None or not self.records_bf16_val:
            return last
        return last + (self.time_pass(model, served=True) or 0.0)
