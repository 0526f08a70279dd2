"""One optimisation step and what it measures: soft-target cross-entropy, ``train_step``
(autocast, backward, clipping, the optimizer update), seeding, the linear-probe freeze, and
the running window of train metrics between two logs."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.objectives import pretrain_loss
from training.tasks import Batch, Task

log = logging.getLogger(__name__)


def freeze_encoder(model: nn.Module) -> int:
    """Linear probe: only ``head.*`` keeps ``requires_grad``; returns the trainable count."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError("freeze_encoder: the model has no head.* parameters")
    return n


def soft_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over the batch of ``-sum_k targets_k * log_softmax(logits)_k``."""
    return torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()


def train_step(
    train_model: nn.Module,
    model: nn.Module,
    task: Task,
    batch: Batch,
    optimizer: torch.optim.Optimizer,
    grad_clip: float | None = None,
    amp_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One optimisation step: forward (``train_model``: maybe DDP/compiled ``model``) under
    autocast, soft-target cross-entropy (or the mae/mlm model's own loss), backward, clip,
    the optimizer update. Returns the detached loss, the logits (None when pretraining) and
    the pre-clip gradient norm (None without clipping)."""
    device_type = batch.labels.device.type
    logits = None
    with torch.autocast(device_type, dtype=amp_dtype or torch.bfloat16,
                        enabled=amp_dtype is not None):
        if task.objective == "classify":
            logits = task.forward(train_model, batch)
        else:
            loss = pretrain_loss(task, train_model, batch).float()
    if logits is not None:
        assert batch.targets is not None
        loss = soft_cross_entropy(logits, batch.targets)
    loss.backward()
    gnorm = None
    if grad_clip:
        params = [p for p in model.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), None if logits is None else logits.detach(), gnorm


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # all devices


class StepWindow:
    """Running sums between two train-metric logs (tensors: no device sync per step)."""

    def __init__(self, has_acc: bool = True) -> None:
        self.has_acc = has_acc
        self.reset()

    def reset(self) -> None:
        self.loss: Tensor | float = 0.0
        self.correct: Tensor | float = 0.0
        self.gnorm: Tensor | float = 0.0
        self.n_gnorm = self.steps = self.examples = self.items = 0
        self.data_t = 0.0
        self.t0 = time.perf_counter()

    def add(self, loss: Tensor, correct: Tensor | float, batch: Any, gnorm: Tensor | None,
            t_data: float, t_step: float) -> None:
        self.loss = self.loss + loss
        self.correct = self.correct + correct
        if gnorm is not None:
            self.gnorm = self.gnorm + gnorm
            self.n_gnorm += 1
        self.steps += 1
        self.examples += int(batch.labels.shape[0])
        self.items += batch.n_items
        self.data_t += t_data

    def flush(self, world_size: int) -> dict[str, float] | None:
        if not self.steps:
            return None
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        m = {"loss": float(self.loss) / self.steps,
             "acc": float(self.correct) / max(self.examples, 1),  # a window of no examples
             "throughput": self.items * world_size / elapsed,
             "data_time_frac": self.data_t / elapsed}
        if not self.has_acc:
            del m["acc"]
        if self.n_gnorm:
            m["grad_norm"] = float(self.gnorm) / self.n_gnorm
        self.reset()
        return m
