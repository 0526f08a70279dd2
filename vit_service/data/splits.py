"""Deterministic stratified train/validation splits."""

from __future__ import annotations

import numpy as np

DEFAULT_VAL_IMAGES = 5000  # CIFAR-10: 45,000 train / 5,000 validation
DEFAULT_VAL_REVIEWS = 2500  # IMDb: 22,500 train / 2,500 validation


def stratified_split(
    labels: np.ndarray, val_size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices ``0..N-1`` into (train, val) with class proportions preserved.

    Each class gets ``val_size * n_class / N`` validation rows, rounded by the largest
    remainder so that the total is exactly ``val_size`` and every per-class count is within 1
    of its exact share. Rows are drawn with a private RNG seeded by ``seed`` (global RNG
    state plays no part). Both index arrays are sorted int64 and together cover all rows.
    """
    labels = np.asarray(labels)  # (N,)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    n = labels.shape[0]
    if not 0 <= val_size <= n:
        raise ValueError(f"val_size must be in [0, {n}], got {val_size}")
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    exact = counts * (val_size / n) if n else counts.astype(float)  # (C,) exact shares
    per_class = np.floor(exact).astype(np.int64)  # (C,)
    remainder = val_size - int(per_class.sum())
    if remainder:
        # largest fractional parts first; ties -> smaller class index (stable sort)
        order = np.argsort(-(exact - per_class), kind="stable")
        per_class[order[:remainder]] += 1
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    val_parts = []
    for c in range(len(classes)):
        members = np.flatnonzero(inverse == c)  # (n_c,) sorted
        if per_class[c]:
            val_parts.append(rng.choice(members, size=int(per_class[c]), replace=False))
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, dtype=np.int64)
    is_val = np.zeros(n, dtype=bool)
    is_val[val] = True
    train = np.flatnonzero(~is_val)
    return train.astype(np.int64), val.astype(np.int64)


def split_indices(
    labels: np.ndarray, val_size: int, split_seed: int, subset: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """A training run's deterministic stratified (train, val) indices (``data.val_size``,
    ``data.split_seed``, ``data.subset``); ``val_size`` is capped at ``N - 1``. ``subset`` keeps a
    stratified sample of N train rows (sources are often sorted by class, so "the first N"
    would be one class)."""
    val_size = min(val_size, len(labels) - 1)
    train_idx, val_idx = stratified_split(labels, val_size, seed=split_seed)
    if subset is not None and subset < len(train_idx):
        _, keep = stratified_split(labels[train_idx], subset, seed=split_seed)
        train_idx = train_idx[keep]
    return train_idx, val_idx
