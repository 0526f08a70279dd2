"""Task adapters: the data side of training (the splits on the device, batches,
augmentation), one class per input kind.

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

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.augment import CutMix, ImageAugment, normalize, smooth_one_hot, token_dropout
from training.distributed import DistInfo
from training.pseudo_labels import confident, ensemble_probabilities
from training.recipes import Recipe
from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD
from vit_service.data import (
    DataNotFoundError,
    ImageDataset,
    TextDataset,
    load_cifar10,
    load_image_folder,
    load_image_folder_train,
    load_imdb,
    split_indices,
)
from vit_service.data.datasets import DatasetStore, TextTable
from vit_service.data.tokenized import tokenize_splits, tokenized_cache_dir
from vit_service.data.tokenizer import TextTokenizer
from vit_service.tta import predict

log = logging.getLogger(__name__)



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

    def forward(self, model: nn.Module, batch: Batch) -> Tensor:
        """The logits the model answers with (flip TTA in eval mode where its config says
        so: :func:`vit_service.tta.predict`, as served)."""
        return predict(model, *batch.inputs)

    def model_fields(self) -> dict[str, Any]:
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


# ----------------------------------------------------------------------------------- images


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
            ds, val_part = _uploaded_images(recipe, _store(datasets), cache_dir)
        elif d.dataset == "imagefolder":
            assert d.path is not None
            ds = load_image_folder_train(d.path, d.image_size, cache_dir)
        else:
            ds = load_cifar10(data_dir, "train", image_size=d.image_size, cache_dir=cache_dir)
        self.class_names = list(ds.class_names)
        if val_part is not None:
            train_idx, val_idx = np.arange(val_part[0]), np.arange(*val_part)
        else:
            train_idx, val_idx = split_indices(ds.labels, _val_count(recipe, len(ds)),
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


# ----------------------------------------------------------------------------------- text


class TextTask(Task):
    kind, unit = "text", "tok"

    def __init__(self, recipe: Recipe, dist: DistInfo, data_dir: str | Path | None,
                 cache_dir: str | Path | None = None, tokenizer: TextTokenizer | None = None,
                 datasets: DatasetStore | None = None) -> None:
        """``tokenizer``: use this vocabulary (a pretrained encoder's) instead of training one
        on the train part. With ``data.include_unsup`` (objective mlm) the 50,000 unlabelled
        reviews join the train part (label -1); validation stays the labelled held-out part
        and the test split is never read."""
        super().__init__(recipe, dist)
        d = recipe.data
        assert d.vocab_size is not None and d.max_len is not None
        self.max_len = d.max_len
        ds: TextDataset | TextTable = (_uploaded_texts(recipe, _store(datasets))
                                       if recipe.uploaded
                                       else load_imdb(data_dir, "train", cache_dir=cache_dir))
        self.class_names = list(ds.class_names)
        labels = np.asarray(ds.labels)
        train_idx, val_idx = split_indices(labels, _val_count(recipe, len(ds)), d.split_seed,
                                           d.subset)
        self.val_texts = [ds.texts[i] for i in val_idx]
        train_labels = labels[train_idx]
        unsup_texts: list[str] = []
        soft: np.ndarray | None = None  # (N_unsup, K) the teachers' probabilities (pseudo_soft)
        if d.include_unsup:
            unsup = load_imdb(data_dir, "unsup", cache_dir=cache_dir)
            unsup_texts = list(unsup.texts)
            unsup_labels = np.full(len(unsup), -1, np.int64)
            if d.pseudo_labels is not None:  # self-training: the teacher's confident labels
                probs = ensemble_probabilities(d.pseudo_labels, unsup_texts, cache_dir)
                rows, unsup_labels = confident(probs, d.pseudo_min_confidence)
                unsup_texts = [unsup_texts[i] for i in rows]
                soft = probs[rows] if d.pseudo_soft else None
                log.info("pseudo labels: %d of %d unlabelled reviews at confidence >= %.2f "
                         "(per class %s)", len(rows), len(probs), d.pseudo_min_confidence,
                         np.bincount(unsup_labels, minlength=probs.shape[1]).tolist())
            train_labels = np.concatenate([train_labels, unsup_labels])
        self.n_train, self.n_val = len(train_labels), len(val_idx)
        params = {"n": len(ds), "val_size": d.val_size, "split_seed": d.split_seed,
                  "subset": d.subset, "vocab_size": d.vocab_size, "max_len": d.max_len,
                  "truncation": d.truncation,
                  "labels": hashlib.sha1(labels.tobytes()).hexdigest()}
        if d.include_unsup:
            params["unsup"] = len(unsup_texts)
            params["unsup_labels"] = hashlib.sha1(train_labels.tobytes()).hexdigest()
        if tokenizer is not None:
            params["tokenizer"] = hashlib.sha1(tokenizer.to_str().encode()).hexdigest()
        tok = tokenize_splits(
            tokenized_cache_dir(cache_dir, ds.source, params),
            lambda: [ds.texts[i] for i in train_idx] + unsup_texts, self.val_texts,
            vocab_size=d.vocab_size, max_len=d.max_len, truncation=d.truncation,
            tokenizer=tokenizer, write=dist.is_main, params=params)
        self._tokenizer, arrays = tok.tokenizer, tok.arrays
        self.train_ids = torch.from_numpy(arrays["train_ids"]).to(self.device)  # (N, L) int32
        self.train_len = torch.from_numpy(arrays["train_len"])  # (N,) on CPU: trims batches
        self.train_y = torch.from_numpy(train_labels).to(self.device)  # -1: unlabelled
        # pseudo_soft: per-row targets, one-hot on the labelled part, the teachers' mean
        # probabilities on the pseudo-labelled reviews; None: targets from train_y
        self.train_soft: Tensor | None = None
        if soft is not None:
            n_lab = len(train_labels) - len(soft)
            one_hot = smooth_one_hot(torch.from_numpy(train_labels[:n_lab]), self.num_classes)
            self.train_soft = torch.cat([one_hot, torch.from_numpy(soft)]).to(self.device)
        self.val_ids = torch.from_numpy(arrays["val_ids"]).to(self.device)
        self.val_len = torch.from_numpy(arrays["val_len"])
        self.val_y = torch.from_numpy(labels[val_idx]).to(self.device)
        trunc = float((self.train_len >= d.max_len).float().mean())
        log.info("imdb: %d train (%d unlabelled) / %d val reviews, max_len %d (%.0f%% "
                 "truncated), mean %.0f tokens", self.n_train, len(unsup_texts), self.n_val,
                 d.max_len, 100 * trunc, float(self.train_len.float().mean()))

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    def model_fields(self) -> dict[str, Any]:
        return {"vocab_size": self._tokenizer.vocab_size, "max_len": self.max_len,
                "pad_id": self._tokenizer.pad_id}

    def _plan_epoch_batches(self, epoch: int) -> Tensor:
        batches = super()._plan_epoch_batches(epoch)  # (steps, G)
        if not self.recipe.data.length_buckets or batches.shape[0] < 2:
            return batches
        # sort within windows of 50 batches by length, then shuffle the batch order
        steps, g = batches.shape
        flat = batches.flatten()
        window = 50 * g
        chunks = []
        for s in range(0, flat.numel(), window):
            c = flat[s : s + window]
            chunks.append(c[torch.argsort(self.train_len[c], stable=True)])
        batches = torch.cat(chunks).view(steps, g)
        gen = torch.Generator().manual_seed(self.recipe.seed * 7919 + epoch)
        return batches[torch.randperm(steps, generator=gen)]

    def _make_batch(self, ids: Tensor, lengths: Tensor, y: Tensor) -> Batch:
        T = int(lengths.max())
        lengths_dev = lengths.to(self.device)
        input_ids = ids[:, :T].long()  # (B, T)
        mask = torch.arange(T, device=self.device)[None, :] < lengths_dev[:, None]  # (B, T)
        return Batch((input_ids, mask), y, n_items=int(lengths.sum()))

    def train_batch(self, epoch: int, index: int, size: int | None = None) -> Batch:
        if size is not None:
            raise ValueError("text batches have no resolution")
        idx = self._rank_slice(self._global_batches(epoch)[index])
        dev_idx = idx.to(self.device)
        b = self._make_batch(self.train_ids[dev_idx], self.train_len[idx], self.train_y[dev_idx])
        if self.objective == "mlm":
            return self.mlm_batch(b)
        p = self.recipe.augment.token_dropout
        if p > 0:
            ids, mask = b.inputs
            b.inputs = (ids, token_dropout(mask, p))
        ls = self.recipe.optim.label_smoothing
        if self.train_soft is not None:
            b.targets = self.train_soft[dev_idx] * (1 - ls) + ls / self.num_classes  # (B, K)
        else:
            b.targets = smooth_one_hot(b.labels, self.num_classes, ls)
        return b

    def mlm_batch(self, b: Batch, generator: torch.Generator | None = None) -> Batch:
        """Inputs ``(masked ids, attention mask, MLM labels)`` per the 80/10/10 rule."""
        from vit_service.data.tokenizer import SPECIAL_TOKENS
        from vit_service.models.mlm import mlm_mask

        assert self.recipe.mlm is not None
        ids, attn = b.inputs
        m = self.recipe.mlm
        inputs, mlm_labels = mlm_mask(
            ids, attn, mask_id=self._tokenizer.mask_id, vocab_size=self._tokenizer.vocab_size,
            special_ids=tuple(range(len(SPECIAL_TOKENS))), mask_prob=m.mask_prob,
            replace_mask=m.replace_mask, replace_random=m.replace_random, generator=generator)
        return Batch((inputs, attn, mlm_labels), b.labels, n_items=b.n_items)

    def val_batches(self, batch_size: int, all_ranks: bool = False) -> Iterator[Batch]:
        rows = np.arange(self.n_val) if all_ranks else self._val_shard()
        rows = rows[np.argsort(self.val_len.numpy()[rows], kind="stable")]  # less padding
        for start in range(0, len(rows), batch_size):
            idx = torch.from_numpy(rows[start : start + batch_size])
            dev_idx = idx.to(self.device)
            yield self._make_batch(self.val_ids[dev_idx], self.val_len[idx], self.val_y[dev_idx])

    def _val_parts(self) -> Iterator[bytes]:
        for text in self.val_texts:  # the raw reviews: independent of the tokenizer
            yield text.encode("utf-8") + b"\0"
        yield self.val_y.cpu().numpy().astype("<i8").tobytes()

    def bundle_preprocess(self) -> dict[str, Any]:
        return {"max_len": self.max_len, "truncation": self.recipe.data.truncation}


def _store(datasets: DatasetStore | None) -> DatasetStore:
    if datasets is None:
        raise DataNotFoundError("an uploaded data set needs the service's data set store")
    return datasets


def _val_count(recipe: Recipe, n: int) -> int:
    """Rows held out for validation: ``data.val_fraction`` of them when set, else
    ``data.val_size``."""
    f = recipe.data.val_fraction
    return max(1, round(f * n)) if f is not None else recipe.data.val_size


def _uploaded_texts(recipe: Recipe, store: DatasetStore) -> TextTable:
    return _uploaded(recipe, lambda i: store.text_table(i))


def _uploaded(recipe: Recipe, read: Callable[[str], Any]) -> Any:
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


def _uploaded_images(recipe: Recipe, store: DatasetStore, cache_dir: str | Path | None
                     ) -> tuple[ImageDataset, tuple[int, int] | None]:
    """An uploaded image set (its ``train/`` tree, and its ``val/`` one appended with labels
    mapped by class name) and the ``(start, stop)`` rows of that val part, if any."""
    d = recipe.data
    tree: Path = _uploaded(recipe, lambda i: store.image_tree(i))
    train = load_image_folder(tree, "train", image_size=d.image_size, cache_dir=cache_dir)
    if not (tree / "val").is_dir():
        return train, None
    val = load_image_folder(tree, "val", image_size=d.image_size, cache_dir=cache_dir)
    to_train = np.array([train.class_names.index(c) for c in val.class_names])
    both = ImageDataset(np.concatenate([train.images, val.images]),
                        np.concatenate([train.labels, to_train[val.labels]]),
                        list(train.class_names), str(tree))
    return both, (len(train), len(both))


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
