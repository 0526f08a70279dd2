"""The n-gram teacher (NB-LR) of ``data.pseudo_labels: ngram``."""

from __future__ import annotations

import numpy as np
import pytest

from training.ngram_teacher import NgramTeacher
from training.recipes import RecipeError

WORDS = {0: "awful boring dull", 1: "great superb moving", 2: "odd strange weird"}
FILLER = "the film plot actor scene story was and it of".split()


def _texts(n: int, classes: int, seed: int) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    texts = [" ".join(list(rng.choice(FILLER, 12)) + list(rng.choice(WORDS[int(k)].split(), 2)))
             for k in labels]
    return texts, labels


def test_it_learns_two_classes_and_answers_probabilities() -> None:
    texts, labels = _texts(300, 2, seed=0)
    held, held_labels = _texts(100, 2, seed=1)
    teacher = NgramTeacher(texts, labels, num_classes=2)
    p = teacher.probabilities(held)
    assert p.shape == (100, 2) and p.dtype == np.float32 and np.allclose(p.sum(1), 1, atol=1e-5)
    assert teacher.accuracy(held, held_labels) >= 0.95
    # the sentiment words, not the filler, decide: a review of filler alone is unsure
    assert 0.2 < float(teacher.probabilities(["the film plot was the story"])[0, 1]) < 0.8
    # deterministic: a resumed run refits the same teacher and gets the same labels
    again = NgramTeacher(texts, labels, num_classes=2).probabilities(held)
    assert np.array_equal(p, again)


def test_more_than_two_classes_one_vs_rest() -> None:
    texts, labels = _texts(450, 3, seed=2)
    held, held_labels = _texts(150, 3, seed=3)
    teacher = NgramTeacher(texts, labels, num_classes=3)
    p = teacher.probabilities(held)
    assert p.shape == (150, 3) and np.allclose(p.sum(1), 1, atol=1e-5)
    assert teacher.accuracy(held, held_labels) >= 0.9


@pytest.mark.parametrize("texts, labels, needle", [
    (["great film", "great plot", "awful film"], [1, 1, 1], "no example of class"),
    (["one", "two", "three"], [0, 1, 0], "no word in 2 or more"),
])
def test_too_little_data_is_a_clear_error(texts: list[str], labels: list[int],
                                          needle: str) -> None:
    with pytest.raises(RecipeError, match=needle):  # the CLI's clean error, not a traceback
        NgramTeacher(texts, np.array(labels), num_classes=2)
