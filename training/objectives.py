"""The pretraining objectives' loss and validation (``mae``, ``mlm``): their models return
their own loss; validation uses fixed masks, the same every epoch, so that epochs compare."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from training.evaluate import LossResult
from training.tasks import Batch, Task, TextTask

VAL_MASK_SEED = 20_240_501  # val masks (MAE patches, MLM tokens) are the same every epoch


def pretrain_loss(task: Task, model: nn.Module, batch: Batch,
                  generator: torch.Generator | None = None) -> Tensor:
    """The pretraining model's own loss on ``batch`` (scalar)."""
    if isinstance(task, TextTask):
        if len(batch.inputs) == 2:  # a validation batch: mask it here (fixed generator)
            batch = task.mlm_batch(batch, generator)
        loss, _ = model(*batch.inputs)  # MLM: (loss, logits of the selected tokens)
        return loss
    loss, _, _ = model(*batch.inputs, generator=generator)  # MAE: (loss, pred, mask)
    return loss


@torch.no_grad()
def pretrain_eval(task: Task, model: nn.Module, batch_size: int,
                  reduce: Callable[[Tensor], Tensor] | None = None) -> LossResult:
    """Mean pretraining loss over the validation part, with fixed masks; ``reduce`` sums
    ``(loss * n, n)`` across DDP ranks."""
    was_training = model.training
    model.eval()
    g = torch.Generator(device=task.device).manual_seed(VAL_MASK_SEED + task.dist.rank)
    stats = torch.zeros(2, dtype=torch.float64, device=task.device)
    for batch in task.val_batches(batch_size):
        loss = pretrain_loss(task, model, batch, g)
        n = batch.labels.shape[0]
        stats[0] += loss.double() * n
        stats[1] += n
    if reduce is not None:
        stats = reduce(stats)
    model.train(was_training)
    n = max(1, int(stats[1]))
    return LossResult(loss=float(stats[0]) / n, n=n)
