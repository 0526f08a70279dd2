"""CIFAR-10, an ImageFolder tree or an uploaded image set as resident uint8 tensors; crop,
flip, RandAugment, CutMix / Mixup on the device."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from training.augment import CutMix, ImageAugment, normalize
from training.distributed import DistInfo
from training.recipes import Recipe
from training.tasks.base import Batch, Task, store, uploaded, val_count
from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD
from vit_service.data import (
    ImageDataset,
    load_cifar10,
    load_image_folder,
    load_image_folder_train,
    split_indices,
)
from vit_service.data.datasets import DatasetStore

log = logging.getLogger(__name__)


class ImageTask(Task):
    kind, unit = "image", "img"

    def __init__(self, recipe: Recipe, dist: DistInfo, data_dir: str | Path | None,
                 cache_dir: str | Path | None = None, dataset: ImageDataset | None = None,
                 datasets: DatasetStore | None = None) -> None:
        super().__init__(recipe, dist)
        d = recipe.data
        val_part = None  # an uploaded set's own val/ rows (else val is carved from train)
        if dataset is not None:
            ds = dataset
        elif recipe.uploaded:
            ds, val_part = _uploaded_images(recipe, store(datasets), cache_dir)
        elif d.dataset == "imagefolder":
            assert d.path is not None
            ds = load_image_folder_train(d.path, d.image_size, cache_dir)
        else:
            ds = load_cifar10(data_dir, "train", image_size=d.image_size, cache_dir=cache_dir)
        self.class_names = list(ds.class_names)
        if val_part is not None:
            train_idx, val_idx = np.arange(val_part[0]), np.arange(*val_part)
        else:
            train_idx, val_idx = split_indices(ds.labels, val_count(recipe, len(ds)),
                                               d.split_seed, d.subset)
        self.n_train, self.n_val = len(train_idx), len(val_idx)

        def to_dev(idx: np.ndarray) -> tuple[Tensor, Tensor]:
            x = torch.from_numpy(ds.images[idx]).permute(0, 3, 1, 2).contiguous()  # (N,3,H,W)
            return x.to(self.device), torch.from_numpy(ds.labels[idx]).to(self.device)

        self.train_x, self.train_y = to_dev(train_idx)
        self.val_x, self.val_y = to_dev(val_idx)
        a, o = recipe.augment, recipe.optim
        self.augment = ImageAugment(CIFAR10_MEAN, CIFAR10_STD, a.crop_padding, a.hflip,
                                    a.randaugment_ops, a.randaugment_magnitude, self.device)
        self.mix = CutMix(a.cutmix_alpha, a.cutmix_prob, self.num_classes, o.label_smoothing,
                          a.mixup_alpha)
        log.info("%s: %d train / %d val images, %d classes (%s), resident on %s", d.dataset,
                 self.n_train, self.n_val, self.num_classes, ds.source, self.device)

    def sample_train_images(self, n: int) -> Tensor:
        """``n`` training images (a fixed sample), normalised as in training: ``(n, 3, H, W)``."""
        g = torch.Generator().manual_seed(self.recipe.seed)
        rows = torch.randperm(self.n_train, generator=g)[: min(n, self.n_train)]
        return normalize(self.train_x[rows.to(self.device)], self.augment.mean,
                         self.augment.std)

    def train_batch(self, epoch: int, index: int, size: int | None = None) -> Batch:
        idx = self._rank_slice(self._global_batches(epoch)[index]).to(self.device)
        x = self.augment(self.train_x[idx], train=True)  # (B, 3, H, W) float
        if size is not None and size != x.shape[-1]:  # progressive resizing: box filter
            x = F.interpolate(x, size=(size, size), mode="area")  # (B, 3, size, size)
        if self.objective == "mae":  # no labels: no CutMix/Mixup
            return Batch((x,), self.train_y[idx], n_items=int(idx.numel()))
        x, targets = self.mix(x, self.train_y[idx])
        return Batch((x,), self.train_y[idx], targets, n_items=int(idx.numel()))

    def val_batches(self, batch_size: int, all_ranks: bool = False) -> Iterator[Batch]:
        rows = np.arange(self.n_val) if all_ranks else self._val_shard()
        for start in range(0, len(rows), batch_size):
            idx = torch.from_numpy(rows[start : start + batch_size]).to(self.device)
            x = self.augment(self.val_x[idx], train=False)
            yield Batch((x,), self.val_y[idx], n_items=int(idx.numel()))

    def _val_parts(self) -> Iterator[bytes]:
        yield self.val_x.cpu().contiguous().numpy().tobytes()  # (N, 3, H, W) uint8
        yield self.val_y.cpu().numpy().astype("<i8").tobytes()

    def bundle_preprocess(self) -> dict[str, Any]:
        return {"image_size": self.recipe.data.image_size, "mean": list(CIFAR10_MEAN),
                "std": list(CIFAR10_STD)}


def _uploaded_images(recipe: Recipe, store: DatasetStore, cache_dir: str | Path | None
                     ) -> tuple[ImageDataset, tuple[int, int] | None]:
    """An uploaded image set (its ``train/`` tree, and its ``val/`` one appended with labels
    mapped by class name) and the ``(start, stop)`` rows of that val part, if any."""
    d = recipe.data
    tree: Path = uploaded(recipe, lambda i: store.image_tree(i))
    train = load_image_folder(tree, "train", image_size=d.image_size, cache_dir=cache_dir)
    if not (tree / "val").is_dir():
        return train, None
    val = load_image_folder(tree, "val", image_size=d.image_size, cache_dir=cache_dir)
    to_train = np.array([train.class_names.index(c) for c in val.class_names])
    both = ImageDataset(np.concatenate([train.images, val.images]),
                        np.concatenate([train.labels, to_train[val.labels]]),
                        list(train.class_names), str(tree))
    return both, (len(train), len(both))
