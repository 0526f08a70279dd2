"""Self-training: a teacher bundle labels the unlabelled reviews, the confident ones join the
student's train part with the teacher's labels; validation is the labelled held-out part."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from training.distributed import DistInfo
from training.ngram_teacher import NgramTeacher
from training.progress import Progress
from training.pseudo_labels import confident, ensemble_probabilities, teacher_probabilities
from training.recipes import RecipeError, load_recipe
from training.run import train
from training.tasks import build_task
from training.tasks.base import val_count
from vit_service.config import Settings
from vit_service.data import load_imdb, split_indices

QUIET = {"attention_samples": 0, "device": "cpu"}


def test_confident_rows_and_their_classes() -> None:
    probs = np.array([[0.95, 0.05], [0.6, 0.4], [0.02, 0.98], [0.5, 0.5]], np.float32)
    rows, labels = confident(probs, 0.9)
    assert rows.tolist() == [0, 2] and labels.tolist() == [0, 1]


def test_a_teachers_confident_labels_join_the_students_train_part(
        env: dict[str, str], data_dir: Path) -> None:
    settings = Settings()
    teacher = train(load_recipe("imdb-smoke", QUIET), settings=settings, register=False,
                    mlflow_enabled=False, run_name="teacher",
                    progress=Progress(json_lines=True, stream=io.StringIO()))
    bundle = teacher.run_dir / "bundle"
    unsup = list(load_imdb(data_dir, "unsup", cache_dir=settings.cache_dir).texts)
    probs = teacher_probabilities(bundle, unsup, settings.cache_dir)
    assert probs.shape == (len(unsup), 2) and np.allclose(probs.sum(1), 1, atol=1e-3)
    # cached: the same teacher on the same texts is not run again
    assert np.array_equal(teacher_probabilities(bundle, unsup, settings.cache_dir), probs)

    plain = build_task(load_recipe("imdb-smoke", QUIET), DistInfo(), data_dir,
                       settings.cache_dir)
    student = load_recipe("imdb-smoke", {**QUIET, "data.include_unsup": True,
                                         "data.pseudo_labels": str(bundle),
                                         "data.pseudo_min_confidence": 0.5})
    task = build_task(student, DistInfo(), data_dir, settings.cache_dir)
    rows, labels = confident(probs, 0.5)
    assert task.n_train == plain.n_train + len(rows) and len(rows) == len(unsup)
    assert task.train_y[plain.n_train:].tolist() == labels.tolist()
    assert task.n_val == plain.n_val and task.val_texts == plain.val_texts
    res = train(student, settings=settings, register=False, mlflow_enabled=False,
                run_name="student", progress=Progress(json_lines=True, stream=io.StringIO()))
    assert 0 <= res.val_acc <= 1


def test_one_run_trains_its_teacher_first(env: dict[str, str], data_dir: Path) -> None:
    """``data.pseudo_labels: teacher``: one command trains the teacher (its own run, not
    registered), labels the unlabelled reviews with it, then trains the student."""
    settings = Settings()
    student = load_recipe("imdb-smoke", {**QUIET, "data.include_unsup": True,
                                         "data.pseudo_labels": "teacher",
                                         "data.pseudo_min_confidence": 0.5})
    res = train(student, settings=settings, register=False, mlflow_enabled=False,
                run_name="selftrain", progress=Progress(json_lines=True, stream=io.StringIO()))
    teacher = Path(settings.home) / "runs" / "selftrain-teacher" / "bundle"
    assert (teacher / "weights.pt").is_file() and res.status == "finished"
    ckpt = torch.load(res.checkpoint, weights_only=True)
    assert ckpt["recipe"]["data"]["pseudo_labels"] == str(teacher)  # resumes with that teacher
    assert ckpt["recipe"]["data"]["include_unsup"] is True


def test_an_ensemble_of_teachers_trained_by_the_run_labels_with_its_mean(
        env: dict[str, str], data_dir: Path) -> None:
    """``data.pseudo_teachers: 2``: the run trains two teachers (seeds seed and seed + 1, the
    same split), and their mean probabilities pick and label the reviews the student gets."""
    settings = Settings()
    student = load_recipe("imdb-smoke", {**QUIET, "seed": 3, "data.include_unsup": True,
                                         "data.pseudo_labels": "teacher",
                                         "data.pseudo_teachers": 2,
                                         "data.pseudo_min_confidence": 0.5})
    res = train(student, settings=settings, register=False, mlflow_enabled=False,
                run_name="ens", progress=Progress(json_lines=True, stream=io.StringIO()))
    runs = Path(settings.home) / "runs"
    teachers = [runs / "ens-teacher" / "bundle", runs / "ens-teacher-2" / "bundle"]
    ckpt = torch.load(res.checkpoint, weights_only=True)
    assert ckpt["recipe"]["data"]["pseudo_labels"] == [str(t) for t in teachers]
    seeds = [torch.load(t.parent / "checkpoints" / "last.pt", weights_only=True)["recipe"]["seed"]
             for t in teachers]
    assert seeds == [3, 4]

    unsup = list(load_imdb(data_dir, "unsup", cache_dir=settings.cache_dir).texts)
    each = [teacher_probabilities(t, unsup, settings.cache_dir) for t in teachers]
    assert not np.allclose(each[0], each[1])  # two different teachers
    mean = ensemble_probabilities([str(t) for t in teachers], unsup, settings.cache_dir)
    assert np.allclose(mean, (each[0] + each[1]) / 2)
    rows, labels = confident(mean, 0.5)
    task = build_task(load_recipe("imdb-smoke", {**QUIET, "data.include_unsup": True,
                                                 "data.pseudo_labels": [str(t) for t in teachers],
                                                 "data.pseudo_min_confidence": 0.5}),
                      DistInfo(), data_dir, settings.cache_dir)
    assert task.train_y[task.n_train - len(rows):].tolist() == labels.tolist()

    # pseudo_soft: the same rows, learnt from the mean probabilities instead of its top class
    soft = build_task(load_recipe("imdb-smoke", {**QUIET, "data.include_unsup": True,
                                                 "data.pseudo_labels": [str(t) for t in teachers],
                                                 "data.pseudo_min_confidence": 0.5,
                                                 "data.pseudo_soft": True}),
                      DistInfo(), data_dir, settings.cache_dir)
    assert soft.train_soft is not None and task.train_soft is None
    n_lab = soft.n_train - len(rows)
    assert torch.allclose(soft.train_soft[n_lab:], torch.from_numpy(mean[rows]))
    labelled = soft.train_soft[:n_lab]
    assert torch.equal(labelled.argmax(1), soft.train_y[:n_lab]) and bool((labelled.max(1)
                                                                          .values == 1).all())
    b = soft.train_batch(0, 0)
    idx = soft._rank_slice(soft._global_batches(0)[0])
    assert torch.allclose(b.targets, soft.train_soft[idx])  # no label smoothing in imdb-smoke


def test_an_ngram_teacher_fitted_by_the_run_labels_the_reviews(
        env: dict[str, str], data_dir: Path) -> None:
    """``data.pseudo_labels: ngram``: the task fits NB-LR on its labelled train part alone (not
    the validation rows), its confident labels join the train part, and the run reports the
    teacher's validation accuracy among its params."""
    settings = Settings()
    plain = build_task(load_recipe("imdb-smoke", QUIET), DistInfo(), data_dir,
                       settings.cache_dir)
    recipe = load_recipe("imdb-smoke", {**QUIET, "data.include_unsup": True,
                                        "data.pseudo_labels": "ngram",
                                        "data.pseudo_min_confidence": 0.5})
    task = build_task(recipe, DistInfo(), data_dir, settings.cache_dir)
    ds = load_imdb(data_dir, "train", cache_dir=settings.cache_dir)
    labels_all = np.asarray(ds.labels)
    d = recipe.data
    train_idx, _ = split_indices(labels_all, val_count(recipe, len(ds)), d.split_seed, d.subset)
    train_texts, train_labels = [ds.texts[i] for i in train_idx], labels_all[train_idx]
    assert len(train_texts) == plain.n_train and not set(train_texts) & set(plain.val_texts)
    unsup = list(load_imdb(data_dir, "unsup", cache_dir=settings.cache_dir).texts)
    same = NgramTeacher(train_texts, train_labels, 2)
    rows, labels = confident(same.probabilities(unsup), 0.5)
    assert task.n_train == plain.n_train + len(rows)
    assert task.train_y[plain.n_train:].tolist() == labels.tolist()
    acc = task.data_params()["data.pseudo_teacher_val_acc"]
    assert acc == round(same.accuracy(plain.val_texts, plain.val_y.numpy()), 6) and acc > 0.9
    assert plain.data_params() == {}
    res = train(recipe, settings=settings, register=False, mlflow_enabled=False,
                run_name="ngram", progress=Progress(json_lines=True, stream=io.StringIO()))
    assert res.status == "finished"
    ckpt = torch.load(res.checkpoint, weights_only=True)
    assert ckpt["recipe"]["data"]["pseudo_labels"] == "ngram"  # a resume refits the same


@pytest.mark.parametrize("overrides, needle", [
    ({"data.include_unsup": True, "data.pseudo_labels": "/x", "data.pseudo_teachers": 2},
     "pseudo_teachers"),
    ({"data.include_unsup": True, "data.pseudo_labels": []}, "at least one"),
    ({"data.include_unsup": True, "data.pseudo_labels": "ngram", "data.pseudo_teachers": 3},
     "pseudo_teachers"),
    ({"data.pseudo_labels": "/x"}, "needs data.include_unsup"),
    ({"data.include_unsup": True}, "data.pseudo_labels"),
    ({"data.pseudo_soft": True}, "needs data.pseudo_labels"),
    ({"data.include_unsup": True, "data.pseudo_labels": "/x",
      "data.pseudo_min_confidence": 0.3}, "pseudo_min_confidence"),
])
def test_bad_self_training_settings(overrides: dict, needle: str) -> None:
    with pytest.raises(RecipeError, match=needle):
        load_recipe("imdb-smoke", overrides)
