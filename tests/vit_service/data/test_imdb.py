"""IMDb (aclImdb) loading from folders and archives, cleaning, caching, errors."""

from __future__ import annotations

import numpy as np
import pytest

from vit_service.data import DataNotFoundError, TextDataset, clean_review, load_imdb
from vit_service.data import imdb as imdb_mod

TRAIN_IDS = [
    "train/neg/0_1",
    "train/neg/3_4",
    "train/neg/11_2",
    "train/pos/0_9",
    "train/pos/1_7",
    "train/pos/2_10",
    "train/pos/10_8",
]
UNSUP_IDS = ["train/unsup/0_0", "train/unsup/5_0", "train/unsup/12_0"]


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the source was read although a cache entry exists")


def _same(a: TextDataset, b: TextDataset) -> None:
    assert a.texts == b.texts and a.ids == b.ids
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.ratings, b.ratings)


def test_clean_review() -> None:
    assert clean_review("a<br />b<br/>c<BR>d<br >e") == "a b c d e"
    assert clean_review("  Great<br /><br />film!\t\n ok  ") == "Great film! ok"


def test_train_split_from_folder(imdb_tree, cache_dir) -> None:
    ds = load_imdb(imdb_tree.root, "train", cache_dir=cache_dir)
    assert ds.ids == TRAIN_IDS  # by label, then numeric id (2 before 10)
    assert ds.labels.dtype == np.int64
    np.testing.assert_array_equal(ds.labels, [0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(ds.ratings, [1, 4, 2, 9, 7, 10, 8])
    assert ds.class_names == ["negative", "positive"]
    for text in ds.texts:
        assert "<br" not in text.lower() and "  " not in text and "\t" not in text
    assert ds.texts[TRAIN_IDS.index("train/pos/10_8")] == "Great film! Loved every minute."
    assert ds.texts[TRAIN_IDS.index("train/pos/2_10")] == (
        "A masterpiece. Café scenes were wonderful."
    )
    assert not ds.from_cache and len(ds) == 7


def test_unsup_split_is_unlabelled(imdb_tree, cache_dir) -> None:
    ds = load_imdb(imdb_tree.archive, "unsup", cache_dir=cache_dir)
    assert ds.ids == UNSUP_IDS
    np.testing.assert_array_equal(ds.labels, [-1, -1, -1])
    np.testing.assert_array_equal(ds.ratings, [0, 0, 0])
    assert ds.texts[-1] == "Saw it on a Tuesday. No opinion."


@pytest.mark.parametrize("where", ["parent", "archive", "archive_parent"])
def test_all_sources_agree(imdb_tree, cache_dir, where) -> None:
    path = {
        "parent": imdb_tree.parent,
        "archive": imdb_tree.archive,
        "archive_parent": imdb_tree.archive.parent,
    }[where]
    reference = load_imdb(imdb_tree.root, "train", cache_dir=cache_dir / "ref")
    _same(load_imdb(path, "train", cache_dir=cache_dir), reference)


def test_archive_streamed_once_for_all_splits(imdb_tree, cache_dir, monkeypatch) -> None:
    train = load_imdb(imdb_tree.archive, "train", cache_dir=cache_dir)
    assert not train.from_cache
    monkeypatch.setattr(imdb_mod, "iter_tar_files", _fail)
    unsup = load_imdb(imdb_tree.archive, "unsup", cache_dir=cache_dir)  # cached by that pass
    again = load_imdb(imdb_tree.archive.parent, "train", cache_dir=cache_dir)
    assert unsup.from_cache and again.from_cache
    assert unsup.ids == UNSUP_IDS
    _same(again, train)
    with pytest.raises(DataNotFoundError, match="'test' split is not present"):
        load_imdb(imdb_tree.archive, "test", cache_dir=cache_dir)  # from the manifest


def test_folder_cache_hit(imdb_tree, cache_dir, monkeypatch) -> None:
    first = load_imdb(imdb_tree.parent, "unsup", cache_dir=cache_dir)
    monkeypatch.setattr(imdb_mod, "clean_review", _fail)
    second = load_imdb(imdb_tree.parent, "unsup", cache_dir=cache_dir)
    assert second.from_cache
    _same(first, second)
    assert not any(p.suffix == ".npz" for p in imdb_tree.parent.rglob("*"))


def test_missing_test_split(imdb_tree, cache_dir) -> None:
    for path in (imdb_tree.root, imdb_tree.archive):
        with pytest.raises(DataNotFoundError, match="'test' split is not present") as err:
            load_imdb(path, "test", cache_dir=cache_dir)
        assert str(path) in str(err.value)


def test_official_layout_with_test_split(imdb_full, cache_dir) -> None:
    for path in (imdb_full.parent, imdb_full.archive.parent):
        test = load_imdb(path, "test", cache_dir=cache_dir)
        assert test.ids == ["test/neg/6_2", "test/neg/7_3", "test/pos/4_9"]
        np.testing.assert_array_equal(test.labels, [0, 0, 1])
        assert test.texts[-1] == "Lovely. Simply lovely."
        assert load_imdb(path, "train", cache_dir=cache_dir).ids == TRAIN_IDS


def test_not_found_lists_looked_at_paths(tmp_path, cache_dir) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(DataNotFoundError) as err:
        load_imdb(empty, cache_dir=cache_dir)
    msg = str(err.value)
    assert isinstance(err.value, FileNotFoundError)
    for path in (empty / "aclImdb", empty / "notes.tar.gz"):
        assert str(path) in msg
    assert "aclImdb_v1.tar.gz" in msg and "--data-dir" in msg and "VIT_SERVICE_DATA_DIR" in msg
    with pytest.raises(ValueError):
        load_imdb(empty, "validation")


def test_cifar_archive_is_not_taken_for_imdb(image_tree, cache_dir) -> None:
    with pytest.raises(DataNotFoundError, match="does not hold aclImdb"):
        load_imdb(image_tree.archive.parent, cache_dir=cache_dir)


def test_subset(imdb_tree, cache_dir) -> None:
    ds = load_imdb(imdb_tree.root, cache_dir=cache_dir)
    sub = ds.subset([4, 1])
    assert sub.ids == [TRAIN_IDS[4], TRAIN_IDS[1]]
    assert sub.texts == [ds.texts[4], ds.texts[1]]
    np.testing.assert_array_equal(sub.labels, [1, 0])
    pos = ds.subset(ds.labels == 1)
    assert len(pos) == 4 and (pos.labels == 1).all() and pos.ids == TRAIN_IDS[3:]


def test_damaged_or_foreign_file(imdb_tree, tmp_path, cache_dir) -> None:
    text_file = tmp_path / "reviews.txt"
    text_file.write_text("just text")
    with pytest.raises(DataNotFoundError, match="unreadable tar archive"):
        load_imdb(text_file, cache_dir=cache_dir)
    damaged = tmp_path / "aclImdb_v1.tar.gz"
    data = imdb_tree.archive.read_bytes()
    damaged.write_bytes(data[: len(data) - 40])
    with pytest.raises(DataNotFoundError, match="unreadable tar archive"):
        load_imdb(tmp_path, cache_dir=cache_dir)
