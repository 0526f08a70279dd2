"""IMDb or an uploaded text set tokenised once to resident int32 ids (cached), batches cut
to their longest review; self-training's pseudo-labelled reviews and MLM masking."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from training.augment import smooth, smooth_one_hot, token_dropout
from training.distributed import DistInfo
from training.evaluate import evaluate_batches
from training.ngram_teacher import NgramTeacher, fit_ngram_head
from training.pseudo_labels import confident, ensemble_probabilities
from training.recipe_parts import NGRAM
from training.recipes import Recipe
from training.tasks.base import Batch, Task, store, uploaded, val_count
from vit_service.data import TextDataset, load_imdb, split_indices
from vit_service.data.datasets import DatasetStore, TextTable
from vit_service.data.tokenized import padding_mask, tokenize_splits, tokenized_cache_dir
from vit_service.data.tokenizer import TextTokenizer
from vit_service.models.ngram_heads import NgramHeads, WordNgramHead

log = logging.getLogger(__name__)


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
        ds: TextDataset | TextTable = (_uploaded_texts(recipe, store(datasets))
                                       if recipe.uploaded
                                       else load_imdb(data_dir, "train", cache_dir=cache_dir))
        self.class_names = list(ds.class_names)
        labels = np.asarray(ds.labels)
        train_idx, val_idx = split_indices(labels, val_count(recipe, len(ds)), d.split_seed,
                                           d.subset)
        self.val_texts = [ds.texts[i] for i in val_idx]
        train_labels = labels[train_idx]
        self.n_labelled = len(train_idx)  # the train part's first rows; pseudo-labelled after
        unsup_texts: list[str] = []
        soft: np.ndarray | None = None  # (N_unsup, K) the teachers' probabilities (pseudo_soft)
        self._data_params: dict[str, Any] = {}
        if d.include_unsup:
            unsup = load_imdb(data_dir, "unsup", cache_dir=cache_dir)
            unsup_texts = list(unsup.texts)
            unsup_labels = np.full(len(unsup), -1, np.int64)
            if d.pseudo_labels is not None:  # self-training: the teacher's confident labels
                if d.pseudo_labels == NGRAM:  # fitted here, on the labelled train part only
                    teacher = NgramTeacher([ds.texts[i] for i in train_idx], train_labels,
                                           len(self.class_names))
                    probs = teacher.probabilities(unsup_texts)
                    acc = teacher.accuracy(self.val_texts, labels[val_idx])
                    log.info("pseudo labels: the n-gram teacher's val_acc %.4f", acc)
                    self._data_params["data.pseudo_teacher_val_acc"] = round(acc, 6)
                else:
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

    def data_params(self) -> dict[str, Any]:
        return dict(self._data_params)

    def fit_ngram_head(self, head: NgramHeads) -> None:
        """NB-LR on the labelled train part's tokens (never the pseudo-labelled reviews nor
        validation); its validation accuracy alone becomes an MLflow param. A word head first
        learns from the vocabulary which pieces continue a word."""
        if isinstance(head, WordNgramHead):
            head.read_pieces(self._tokenizer.pieces())
        # on the run's device, where its rows are: the run fits the head before it moves the
        # model (the head's buffers would be indexed with the device's ids)
        head.to(self.device)
        n = self.n_labelled
        fit_ngram_head(head, self.train_ids[:n], self.train_len[:n],
                       self.train_y[:n].cpu().numpy())
        # every rank reads the whole validation split, so no cross-rank reduction
        acc = evaluate_batches(head, self.val_batches(1024, all_ranks=True),
                               lambda m, b: m(*b.inputs), self.class_names, self.device).acc
        log.info("n-gram head alone: val_acc %.4f", acc)
        self._data_params["model.ngram_head_val_acc"] = round(acc, 6)

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
        return Batch((input_ids, padding_mask(lengths_dev, T)), y, n_items=int(lengths.sum()))

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
            b.targets = smooth(self.train_soft[dev_idx], ls)  # (B, K)
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


def _uploaded_texts(recipe: Recipe, store: DatasetStore) -> TextTable:
    return uploaded(recipe, lambda i: store.text_table(i))
