"""Self-training: a teacher's confident predictions label unlabelled texts for the student.

``data.pseudo_labels: <teacher bundle>`` (objective classify, ``data.include_unsup``) has the
teacher classify the 50,000 unlabelled IMDb reviews once; those it labels with probability at
least ``data.pseudo_min_confidence`` join the student's train part with that label (hard labels,
as in Yarowsky-style self-training and Xie et al. 2020's "noisy student"). The teacher's
predictions are cached beside the tokenised data, keyed by the teacher's weights and the texts.
With ``data.pseudo_labels: teacher`` the run trains that teacher itself first (the same recipe
on the labelled part alone, an MLflow run of its own, not registered), so self-training is one
command and one job; with ``data.pseudo_teachers: N`` it trains N teachers (seeds ``seed``,
``seed + 1``, ...) and their averaged probabilities label the reviews: an ensemble is right more
often than any of its members, so more of the labels it is sure of are right. With
``data.pseudo_labels: ngram`` the teacher is a naive-Bayes n-gram logistic regression fitted on
the labelled part in seconds (``training/ngram_teacher.py``). Validation
never sees the pseudo labels: the teacher was trained on the same train part with the same
held-out rows (the recipe's split), and the unlabelled reviews are not in the validation set.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from training.recipes import Recipe
from vit_service.bundle import load_bundle
from vit_service.data.tokenized import length_sorted_batches
from vit_service.execution import resolve_execution
from vit_service.tta import predict

log = logging.getLogger(__name__)



def teacher_recipe(recipe: Recipe, k: int = 0) -> Recipe:
    """The ``k``-th teacher a ``data.pseudo_labels: teacher`` run trains first: the same recipe
    on the labelled reviews alone (the same split), seed ``seed + k``, not registered."""
    data = recipe.data.model_copy(update={"include_unsup": False, "pseudo_labels": None,
                                          "pseudo_teachers": 1})
    return recipe.model_copy(update={"data": data, "register_as": None,
                                     "seed": recipe.seed + k})


def with_teacher(recipe: Recipe, bundles: list[Path]) -> Recipe:
    """The student's recipe once its teachers are trained: its pseudo labels from
    ``bundles`` (saved with its checkpoints, so a resume labels with the same teachers)."""
    names: str | list[str] = ([str(b) for b in bundles] if len(bundles) > 1
                              else str(bundles[0]))
    return recipe.model_copy(update={"data": recipe.data.model_copy(
        update={"pseudo_labels": names, "pseudo_teachers": 1})})


def ensemble_probabilities(teachers: str | Path | list[str], texts: list[str],
                           cache_dir: str | Path | None) -> np.ndarray:
    """``(N, C)`` mean class probabilities of one or several teacher bundles on ``texts``."""
    folders = teachers if isinstance(teachers, list) else [teachers]
    return np.mean([teacher_probabilities(f, texts, cache_dir) for f in folders], axis=0,
                   dtype=np.float32)


def teacher_probabilities(teacher: str | Path, texts: list[str], cache_dir: str | Path | None,
                          batch_size: int = 256) -> np.ndarray:
    """``(N, C)`` float32 class probabilities of a text bundle on ``texts`` (as served: its
    tokenizer, truncation and precision), cached under ``cache_dir`` when given."""
    folder = Path(teacher)
    weights = folder / "weights.pt"
    key = hashlib.sha1(weights.read_bytes() if weights.is_file() else str(folder).encode())
    key.update(str(len(texts)).encode())
    for t in texts[:: max(1, len(texts) // 64)]:  # a sample fixes which texts these are
        key.update(t.encode("utf-8", "replace"))
    cache = Path(cache_dir) / "pseudo" / f"{key.hexdigest()[:16]}.npy" if cache_dir else None
    if cache is not None and cache.is_file():
        return np.load(cache)
    b = load_bundle(folder)
    if b.meta.task != "text" or b.tokenizer is None:
        raise ValueError(f"data.pseudo_labels: {teacher} is not a text classifier bundle")
    p = b.meta.preprocess
    ids, lengths = b.tokenizer.encode_to_arrays(texts, int(p["max_len"]),
                                                truncation=p.get("truncation", "head"))
    out = np.zeros((len(texts), len(b.meta.class_names)), np.float32)
    ex = resolve_execution("serve", "cpu")
    b.model.eval()
    with torch.inference_mode(), ex.applied(b.model):
        for rows, x, mask in length_sorted_batches(ids, lengths, batch_size):
            out[rows] = torch.softmax(predict(b.model, x, mask).float(), -1).numpy()
    log.info("pseudo labels: %s classified %d texts", folder, len(texts))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.save(cache, out)
    return out


def confident(probs: np.ndarray, min_confidence: float) -> tuple[np.ndarray, np.ndarray]:
    """The rows whose top class has at least ``min_confidence``, and those classes."""
    top = probs.max(1)
    rows = np.flatnonzero(top >= min_confidence)
    return rows, probs[rows].argmax(1).astype(np.int64)
