"""What both tasks share: the :class:`Batch` the trainer sees, the per-epoch batch plan
(:class:`Task`), and reading the recipe's uploaded data set and validation size."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from training.distributed import DistInfo
from training.recipes import Recipe
from vit_service.data import DataNotFoundError
from vit_service.data.datasets import DatasetStore
from vit_service.data.tokenizer import TextTokenizer
from vit_service.tta import predict


@dataclass
class Batch:
    inputs: tuple[Tensor, ...]  # positional model inputs: (images,) or (input_ids, mask)
    labels: Tensor  # (B,) int64 hard labels
    targets: Tensor | None = None  # (B, K) soft targets (training only)
    n_items: int = 0  # images, or real tokens, in this rank's batch (for throughput)


def epoch_permutation(n: int, seed: int, epoch: int) -> Tensor:
    """The same permutation of ``0..n-1`` on every rank, for this (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


class Task:
    """Common batching logic; subclasses hold the data."""

    kind: str = ""
    unit: str = "img"  # throughput unit
    class_names: list[str]
    n_train: int
    n_val: int

    def __init__(self, recipe: Recipe, dist: DistInfo) -> None:
        self.recipe, self.dist, self.device = recipe, dist, dist.device
        self.objective = recipe.objective

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def steps_per_epoch(self) -> int:
        return max(1, self.n_train // self.recipe.batch_size)

    def _global_batches(self, epoch: int) -> Tensor:
        """``(steps, G)`` train-part row indices of every global batch of ``epoch``."""
        if getattr(self, "_plan_epoch", None) != epoch:
            self._plan = self._plan_epoch_batches(epoch)
            self._plan_epoch = epoch
        return self._plan

    def _plan_epoch_batches(self, epoch: int) -> Tensor:
        steps = self.steps_per_epoch()
        g = min(self.recipe.batch_size, self.n_train)
        perm = epoch_permutation(self.n_train, self.recipe.seed, epoch)
        return perm[: steps * g].view(steps, g)

    def _rank_slice(self, idx: Tensor) -> Tensor:
        """This rank's contiguous share of one global batch."""
        return idx.tensor_split(self.dist.world_size)[self.dist.rank]

    def _val_shard(self) -> np.ndarray:
        return np.array_split(np.arange(self.n_val), self.dist.world_size)[self.dist.rank]

    # subclass API
    def train_batch(self, epoch: int, index: int, size: int | None = None) -> Batch:
        """Batch ``index`` of ``epoch``; ``size`` (images): downsample to ``size`` px."""
        raise NotImplementedError

    def val_batches(self, batch_size: int, all_ranks: bool = False) -> Iterator[Batch]:
        raise NotImplementedError

    def forward(self, model: nn.Module, batch: Batch, final: bool = True) -> Tensor:
        """The logits the model answers with (TTA in eval mode where its config says so:
        :func:`vit_service.tta.predict`, as served); ``final=False`` (an intermediate
        validation pass, for the curve) leaves out the shifted views."""
        return predict(model, *batch.inputs, shift=final)

    def model_fields(self) -> dict[str, Any]:
        return {}

    def data_params(self) -> dict[str, Any]:
        """MLflow params the data preparation measured (a teacher's accuracy, say)."""
        return {}

    def val_fingerprint(self) -> str:
        """sha256 of the validation split's inputs and labels: two runs' validation scores are
        comparable (the champion check) only when their fingerprints match."""
        h = hashlib.sha256()
        for part in self._val_parts():
            h.update(part)
        return h.hexdigest()[:32]

    def _val_parts(self) -> Iterator[bytes]:
        raise NotImplementedError

    def bundle_preprocess(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return None


def store(datasets: DatasetStore | None) -> DatasetStore:
    if datasets is None:
        raise DataNotFoundError("an uploaded data set needs the service's data set store")
    return datasets


def val_count(recipe: Recipe, n: int) -> int:
    """Rows held out for validation: ``data.val_fraction`` of them when set, else
    ``data.val_size``."""
    f = recipe.data.val_fraction
    return max(1, round(f * n)) if f is not None else recipe.data.val_size


def uploaded(recipe: Recipe, read: Callable[[str], Any]) -> Any:
    """``read(id)`` of the recipe's uploaded data set, or :class:`DataNotFoundError` saying
    what is missing (no id, an unknown one, a set of the other kind)."""
    dataset = recipe.data.dataset
    if dataset is None:
        raise DataNotFoundError(f"recipe {recipe.name} trains on an uploaded data set: give "
                                "its id (--set data.dataset=<id>; POST /v1/datasets)")
    try:
        return read(dataset)
    except KeyError:
        raise DataNotFoundError(f"unknown data set {dataset!r} (POST /v1/datasets)") from None
    except ValueError as e:  # a text set under an image model, or the reverse
        raise DataNotFoundError(f"recipe {recipe.name}: {e}") from None
