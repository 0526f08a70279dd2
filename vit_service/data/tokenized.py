"""Tokenized text splits, cached on disk: the vocabulary and the ``(N, max_len)`` id arrays.

Tokenizing IMDb takes longer than a short training run, so the arrays are cached under
``<cache>/tokenized/<name>-<key>``; the key covers the source archive, the split, the vocabulary
size, ``max_len``, the truncation rule and the labels, so any change builds a new entry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vit_service.data import cache as data_cache
from vit_service.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

TOKENIZED_VERSION = "1"


def padding_mask(lengths: Tensor, T: int) -> Tensor:
    """``(B, T)`` True at each row's first ``lengths[i]`` positions (its real tokens)."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def length_sorted_batches(ids: np.ndarray, lengths: np.ndarray,
                          batch_size: int) -> Iterator[tuple[np.ndarray, Tensor, Tensor]]:
    """Batches of the id rows ``(N, L)`` shortest first (similar lengths together: less
    padding), each cut to its longest row: ``(rows, ids (B, T) int64, mask (B, T))``."""
    order = np.argsort(lengths, kind="stable")
    for s in range(0, len(order), batch_size):
        rows = order[s : s + batch_size]
        T = int(lengths[rows].max())
        yield (rows, torch.from_numpy(ids[rows, :T]).long(),
               padding_mask(torch.from_numpy(lengths[rows]), T))


def tokenized_cache_dir(cache_dir: str | Path | None, source: str, params: dict[str, Any],
                        name: str = "imdb") -> Path:
    """The cache folder of one tokenization of ``source`` with ``params``."""
    fp = data_cache.fingerprint(source) if source and Path(source).exists() else {"s": source}
    key = data_cache.cache_key(fp, version=TOKENIZED_VERSION, params=params)
    return data_cache.resolve_cache_dir(cache_dir) / "tokenized" / f"{name}-{key}"


@dataclass
class Tokenized:
    tokenizer: TextTokenizer
    arrays: dict[str, np.ndarray]  # train_ids / val_ids (N, L) int32, train_len / val_len (N,)


def tokenize_splits(cdir: Path, train_texts: Callable[[], list[str]], val_texts: list[str], *,
                    vocab_size: int, max_len: int, truncation: str,
                    tokenizer: TextTokenizer | None = None, write: bool = True,
                    params: dict[str, Any] | None = None) -> Tokenized:
    """The cached arrays of ``cdir`` when present, else: train a vocabulary on the train texts
    (or use ``tokenizer``, a pretrained encoder's), encode both splits and, with ``write``
    (rank 0 only under DDP), cache them. ``train_texts`` is called only on a cache miss."""
    arrays = data_cache.load_npz(cdir / "arrays.npz")
    if arrays is not None and (cdir / "tokenizer.json").is_file():
        log.info("tokenized arrays from cache %s", cdir)
        return Tokenized(tokenizer or TextTokenizer.load(cdir / "tokenizer.json"), arrays)
    t0 = time.perf_counter()
    texts = train_texts()
    if tokenizer is not None:
        log.info("using the given tokenizer (vocab %d)", tokenizer.vocab_size)
    else:
        tokenizer = TextTokenizer.train(texts, vocab_size=vocab_size)
    t1 = time.perf_counter()
    tr_ids, tr_len = tokenizer.encode_to_arrays(texts, max_len, truncation=truncation)
    va_ids, va_len = tokenizer.encode_to_arrays(val_texts, max_len, truncation=truncation)
    arrays = {"train_ids": tr_ids, "train_len": tr_len, "val_ids": va_ids, "val_len": va_len}
    log.info("tokenizer (vocab %d) ready in %.1fs, %d texts encoded in %.1fs",
             tokenizer.vocab_size, t1 - t0, len(texts) + len(val_texts),
             time.perf_counter() - t1)
    if write:
        cdir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(cdir / "tokenizer.json")
        data_cache.save_npz(cdir / "arrays.npz", arrays)
        data_cache.save_json(cdir / "params.json", params or {})
    return Tokenized(tokenizer, arrays)
