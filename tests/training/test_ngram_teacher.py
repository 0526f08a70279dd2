"""NB-LR: the n-gram teacher of ``data.pseudo_labels: ngram`` and a text model's fitted
n-gram head."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


def _token_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Rows of ids (N, 24) as a task stores them ([CLS] first, padded with 0): filler ids
    5..99, two sentiment ids (200..202 negative, 300..302 positive), random lengths."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    ids = np.zeros((n, 24), np.int32)
    lengths = rng.integers(8, 25, n)
    for i, (k, L) in enumerate(zip(labels, lengths, strict=True)):
        row = list(rng.integers(5, 100, L - 3)) + list(rng.integers(0, 3, 2) + (300 if k else 200))
        ids[i, 0], ids[i, 1:L] = 2, rng.permutation(row)
    return torch.from_numpy(ids), torch.from_numpy(lengths), labels


def test_the_fitted_head_is_nblr_on_its_own_features() -> None:
    from sklearn.linear_model import LogisticRegression

    from training.ngram_teacher import ALPHA, MIN_DF, C, fit_ngram_head
    from vit_service.models import create_model
    from vit_service.models.text import pair_buckets

    ids, lengths, labels = _token_rows(400, seed=0)
    held, held_len, held_labels = _token_rows(200, seed=1)
    model = create_model("text_test", pool="mean", ngram_head_buckets=97)
    head = model.ngram_head
    assert fit_ngram_head(head, ids, lengths, labels) > 0
    with torch.no_grad():
        mask = torch.arange(24)[None, :] < held_len[:, None]
        p_head = torch.softmax(head(held.long(), mask), 1)[:, 1].numpy()
    assert ((p_head > 0.5) == held_labels).mean() >= 0.95

    # the same model built independently: python sets of features, sklearn on dense arrays
    V, F = 1000, 1000 + 97

    def bag(rows: torch.Tensor, lens: torch.Tensor) -> np.ndarray:
        x = np.zeros((len(rows), F), np.float32)
        for i, (r, L) in enumerate(zip(rows.tolist(), lens.tolist(), strict=True)):
            r = r[:L]
            pairs = [V + int(pair_buckets(torch.tensor(a), torch.tensor(b), 97))
                     for a, b in zip(r[:-1], r[1:], strict=True)]
            x[i, list(set(r) | set(pairs))] = 1
        return x

    x, xh = bag(ids, lengths), bag(held, held_len)
    used = x.sum(0) >= MIN_DF
    x, xh = x[:, used], xh[:, used]
    p = x[labels == 1].sum(0) + ALPHA
    q = x[labels == 0].sum(0) + ALPHA
    r = np.log((p / p.sum()) / (q / q.sum()))
    clf = LogisticRegression(C=C, solver="liblinear", max_iter=1000, random_state=0)
    expected = clf.fit(x * r, labels).predict_proba(xh * r)[:, 1]
    np.testing.assert_allclose(p_head, expected, atol=1e-4)


def test_a_head_with_nothing_to_learn_from_is_a_clear_error() -> None:
    from training.ngram_teacher import fit_ngram_head
    from vit_service.models import create_model

    head = create_model("text_test", ngram_head_buckets=97).ngram_head
    ids = torch.tensor([[2, 10, 11], [2, 12, 13]])  # [CLS] is the only shared token
    with pytest.raises(RecipeError, match="no example of class"):
        fit_ngram_head(head, ids, torch.tensor([3, 3]), np.array([1, 1]))


def test_a_run_fits_a_word_head_that_reads_further_than_its_transformer(
        env: dict[str, str], data_dir) -> None:
    """A word head with ``student_len``: the run gives the head its vocabulary's piece kinds
    (saved in the bundle) and fits it; the bundle's Transformer reads its crop and the head
    every token (a word outside the crop moves the head's logits alone)."""
    import io

    from training.progress import Progress
    from training.recipes import load_recipe
    from training.run import train
    from vit_service.bundle import load_bundle
    from vit_service.config import Settings
    from vit_service.models.ngram_heads import WordNgramHead, piece_kinds

    recipe = load_recipe("imdb-smoke", {
        "attention_samples": 0, "device": "cpu", "data.max_len": 64,
        "data.truncation": "head_tail", "model.overrides.pool": "mean",
        "model.overrides.ngram_head_buckets": 4096, "model.overrides.ngram_head_unit": "word",
        "model.overrides.student_len": 24})
    res = train(recipe, settings=Settings(), register=False, mlflow_enabled=False,
                run_name="word-head", progress=Progress(json_lines=True, stream=io.StringIO()))
    assert res.status == "finished" and 0 <= res.val_acc <= 1
    b = load_bundle(res.run_dir / "bundle")
    head = b.model.ngram_head
    assert isinstance(head, WordNgramHead) and head.weight.any()
    assert torch.equal(head.piece_kind, piece_kinds(b.tokenizer.pieces()))
    assert (head.piece_kind == 1).any()  # some pieces continue a word
    assert b.model.config.student_len == 24 and b.meta.preprocess["max_len"] == 64
    enc = b.tokenizer.encode_batch(["a long review " * 30], 64, truncation="head_tail")
    ids, mask = enc.input_ids, enc.attention_mask
    _, crop_mask, pos = b.model.student_view(ids, mask)
    assert pos is not None and int(crop_mask.sum()) == 24 and ids.shape[1] == 64
    # a word outside the crop moves the head's logits, never the Transformer's
    t = min(set(range(64)) - set(pos[0].tolist()))
    m = b.model.eval()
    with torch.no_grad():
        alone = 2 * m(ids, mask) - head(ids, mask)
        moved = []
        for new in range(5, b.tokenizer.vocab_size, 7):
            other = ids.clone()
            other[0, t] = new
            torch.testing.assert_close(2 * m(other, mask) - head(other, mask), alone)
            moved.append(not torch.equal(head(other, mask), head(ids, mask)))
    assert any(moved)
