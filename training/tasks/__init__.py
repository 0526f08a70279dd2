"""Task adapters: the data side of training (the splits on the device, batches,
augmentation), one class per input kind: `base` (the batch plan both share), `image`,
`text`; :func:`build_task` picks the recipe's.

Both keep the whole (train, val) data as tensors on the training device (uint8 images
``(N, 3, H, W)`` or int32 token ids ``(N, max_len)``), cut batches by indexing with a per-epoch
permutation, and augment on the device. The trainer only sees :class:`Batch` objects and calls
``task.forward(model, batch)`` (classification) or :func:`training.objectives.pretrain_loss`.
The model is built by :mod:`training.model_setup`, the published pictures by
:mod:`training.artifacts`.

Batches: every rank draws the same permutation of the train part for an epoch (seeded by the
recipe seed and the epoch number, independent of any other RNG), splits it into
``steps_per_epoch`` global batches (the remainder is dropped), and takes its own contiguous
slice of each global batch - what a ``DistributedSampler`` does, without a ``DataLoader``.
"""

from __future__ import annotations

from pathlib import Path

from training.distributed import DistInfo
from training.recipes import Recipe
from training.tasks.base import Batch, Task, epoch_permutation
from training.tasks.image import ImageTask
from training.tasks.text import TextTask
from vit_service.data.datasets import DatasetStore
from vit_service.data.tokenizer import TextTokenizer

__all__ = ["Batch", "ImageTask", "Task", "TextTask", "build_task", "epoch_permutation"]


def build_task(recipe: Recipe, dist: DistInfo, data_dir: str | Path | None,
               cache_dir: str | Path | None = None, tokenizer: TextTokenizer | None = None,
               datasets: DatasetStore | None = None) -> Task:
    """The recipe's task (``tokenizer``: text only, a pretrained encoder's vocabulary). Under
    DDP rank 0 goes first (filling the decode/tokenisation caches) while the other ranks wait,
    then read the caches."""

    def make() -> Task:
        if recipe.task == "image":
            return ImageTask(recipe, dist, data_dir, cache_dir, datasets=datasets)
        return TextTask(recipe, dist, data_dir, cache_dir, tokenizer=tokenizer,
                        datasets=datasets)

    if not dist.enabled:
        return make()
    import torch.distributed as tdist

    task = make() if dist.is_main else None
    tdist.barrier()
    return task or make()
