"""Stratified, deterministic train/validation splits."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vit_service.data import (
    DEFAULT_VAL_IMAGES,
    DEFAULT_VAL_REVIEWS,
    split_indices,
    stratified_split,
)


def _labels() -> np.ndarray:
    return np.random.default_rng(7).permutation(np.repeat([0, 1, 2, -1], [53, 31, 11, 5]))


def _check(labels: np.ndarray, val_size: int, train: np.ndarray, val: np.ndarray) -> None:
    n = len(labels)
    assert train.dtype == np.int64 and val.dtype == np.int64
    assert len(val) == val_size and len(train) == n - val_size
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)  # sorted, unique
    assert not np.intersect1d(train, val).size
    np.testing.assert_array_equal(np.union1d(train, val), np.arange(n))
    for c in np.unique(labels):
        exact = val_size * np.sum(labels == c) / n
        assert abs(np.sum(labels[val] == c) - exact) <= 1


@pytest.mark.parametrize("val_size", [0, 1, 7, 15, 50, 99, 100])
def test_properties(val_size) -> None:
    labels = _labels()
    train, val = stratified_split(labels, val_size, seed=3)
    _check(labels, val_size, train, val)


def test_deterministic_and_independent_of_global_rng() -> None:
    labels = _labels()
    np.random.seed(0)
    random.seed(0)
    a = stratified_split(labels, 20, seed=5)
    np.random.seed(123)
    np.random.rand(10)
    random.seed(99)
    b = stratified_split(labels, 20, seed=5)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    c = stratified_split(labels, 20, seed=6)
    assert not np.array_equal(a[1], c[1])


def test_default_sizes_are_exactly_balanced() -> None:
    cifar = np.repeat(np.arange(10), 5000)
    train, val = stratified_split(cifar, DEFAULT_VAL_IMAGES)
    _check(cifar, DEFAULT_VAL_IMAGES, train, val)
    np.testing.assert_array_equal(np.bincount(cifar[val]), [500] * 10)
    imdb = np.repeat([0, 1], 12500)
    train, val = stratified_split(imdb, DEFAULT_VAL_REVIEWS, seed=1)
    np.testing.assert_array_equal(np.bincount(imdb[val]), [1250, 1250])


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        stratified_split(np.zeros(5), 6)
    with pytest.raises(ValueError):
        stratified_split(np.zeros(5), -1)
    with pytest.raises(ValueError):
        stratified_split(np.zeros((2, 2)), 1)


def test_split_indices_of_a_run() -> None:
    labels = _labels()  # 100 rows, 4 classes
    train, val = split_indices(labels, 20, 3, None)
    np.testing.assert_array_equal(val, stratified_split(labels, 20, seed=3)[1])
    _check(labels, 20, train, val)
    # subset: a stratified sample of the train part, val unchanged
    sub, val2 = split_indices(labels, 20, 3, 40)
    np.testing.assert_array_equal(val2, val)
    assert len(sub) == 40 and set(sub) <= set(train)
    assert len(np.unique(labels[sub])) == 4
    assert len(split_indices(labels, 20, 3, 1000)[0]) == 80  # subset >= train part: all
    # val_size is capped so that one train row remains
    train, val = split_indices(labels, 500, 0, None)
    assert len(train) == 1 and len(val) == 99
