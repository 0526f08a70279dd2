"""CIFAR-10 / ImageFolder loading (``cifar`` and ``images`` modules), caching and error
reporting."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_service.data import (
    CIFAR10_CLASSES,
    DataNotFoundError,
    ImageDataset,
    load_cifar10,
    load_image_folder,
    load_image_folder_train,
    resolve_cache_dir,
)
from vit_service.data import cifar as cifar_mod
from vit_service.data import image_folder as image_folder_mod
from vit_service.data import images as images_mod


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _fail(*args: object, **kwargs: object) -> None:
    raise AssertionError("the source was read although a cache entry exists")


# ----------------------------------------------------------------------------- official layout


def test_official_class_order_is_alphabetical() -> None:
    assert list(CIFAR10_CLASSES) == sorted(CIFAR10_CLASSES)
    assert CIFAR10_CLASSES[0] == "airplane" and CIFAR10_CLASSES[-1] == "truck"


def test_batches_folder_pixels_round_trip(cifar_batches, cache_dir) -> None:
    ds = load_cifar10(cifar_batches.folder, "train", cache_dir=cache_dir)
    assert isinstance(ds, ImageDataset)
    assert ds.images.dtype == np.uint8 and ds.images.shape == (20, 32, 32, 3)
    assert ds.labels.dtype == np.int64
    np.testing.assert_array_equal(ds.images, cifar_batches.train_images)
    np.testing.assert_array_equal(ds.labels, cifar_batches.train_labels)
    assert ds.class_names == list(CIFAR10_CLASSES)

    test = load_cifar10(cifar_batches.folder, "test", cache_dir=cache_dir)
    np.testing.assert_array_equal(test.images, cifar_batches.test_images)
    np.testing.assert_array_equal(test.labels, cifar_batches.test_labels)


@pytest.mark.parametrize("where", ["parent", "folder", "archive", "archive_parent"])
def test_every_official_source_gives_the_same_data(cifar_batches, cache_dir, where) -> None:
    path = {
        "parent": cifar_batches.parent,
        "folder": cifar_batches.folder,
        "archive": cifar_batches.archive,
        "archive_parent": cifar_batches.archive.parent,
    }[where]
    for split, images, labels in (
        ("train", cifar_batches.train_images, cifar_batches.train_labels),
        ("test", cifar_batches.test_images, cifar_batches.test_labels),
    ):
        ds = load_cifar10(path, split, cache_dir=cache_dir)
        np.testing.assert_array_equal(ds.images, images)
        np.testing.assert_array_equal(ds.labels, labels)
        assert not ds.from_cache


def test_batches_resized(cifar_batches, cache_dir) -> None:
    ds = load_cifar10(cifar_batches.archive, "test", image_size=16, cache_dir=cache_dir)
    assert ds.images.shape == (6, 16, 16, 3) and ds.images.dtype == np.uint8


def test_batches_refuse_foreign_pickles(tmp_path, cache_dir) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [Evil()]}, f)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_cifar10(tmp_path, cache_dir=cache_dir)


# ----------------------------------------------------------------------------- ImageFolder


def _check_folder_dataset(ds: ImageDataset, per_class: int, colors: dict) -> None:
    classes = sorted(colors)
    assert ds.class_names == classes
    assert ds.images.shape == (per_class * len(classes), 32, 32, 3)
    np.testing.assert_array_equal(ds.labels, np.repeat(np.arange(len(classes)), per_class))
    for image, label in zip(ds.images, ds.labels, strict=True):
        expected = np.array(colors[classes[label]])
        centre = image[8:24, 8:24].reshape(-1, 3).mean(axis=0)
        assert np.abs(centre - expected).max() < 4, (classes[label], centre)


@pytest.mark.parametrize("where", ["parent", "root", "split_dir"])
def test_image_folder_tree(image_tree, cache_dir, where) -> None:
    path = {
        "parent": image_tree.parent,
        "root": image_tree.root,
        "split_dir": image_tree.root / "train",
    }[where]
    _check_folder_dataset(load_cifar10(path, "train", cache_dir=cache_dir), 4, image_tree.colors)
    if where != "split_dir":
        _check_folder_dataset(load_cifar10(path, "test", cache_dir=cache_dir), 2, image_tree.colors)


def test_image_folder_archive_matches_tree(image_tree, cache_dir) -> None:
    from_tar = load_cifar10(image_tree.archive, cache_dir=cache_dir)
    from_dir = load_cifar10(image_tree.parent, cache_dir=cache_dir)
    _check_folder_dataset(from_tar, 4, image_tree.colors)
    np.testing.assert_array_equal(from_tar.images, from_dir.images)
    np.testing.assert_array_equal(from_tar.labels, from_dir.labels)
    # the folder holding the archive works too
    from_parent = load_cifar10(image_tree.archive.parent, cache_dir=cache_dir)
    np.testing.assert_array_equal(from_parent.images, from_tar.images)


def test_fast_jpeg_path_equals_pil(image_tree, cache_dir, monkeypatch) -> None:
    fast = load_cifar10(image_tree.archive, cache_dir=cache_dir / "a")
    monkeypatch.setattr(images_mod, "USE_TORCHVISION_JPEG", False)
    slow = load_cifar10(image_tree.archive, cache_dir=cache_dir / "b")
    assert not slow.from_cache
    np.testing.assert_array_equal(fast.images, slow.images)


def test_missing_test_split_in_archive(image_tree, cache_dir) -> None:
    for _ in range(2):  # second time answered from the archive's cached manifest
        with pytest.raises(DataNotFoundError, match="'test' split is not present") as err:
            load_cifar10(image_tree.archive, "test", cache_dir=cache_dir)
        assert str(image_tree.archive) in str(err.value)


def test_odd_sizes_and_modes_are_converted(tmp_path, cache_dir) -> None:
    root = tmp_path / "odd"
    (root / "gray").mkdir(parents=True)
    (root / "rgba").mkdir(parents=True)
    Image.new("L", (48, 40), 77).save(root / "gray" / "a.png")
    Image.new("RGBA", (20, 30), (10, 20, 30, 128)).save(root / "rgba" / "b.png")
    Image.new("RGB", (64, 64), (5, 250, 5)).save(root / "rgba" / "c.jpeg", quality=95)
    ds = load_image_folder(root, image_size=16, cache_dir=cache_dir)
    assert ds.images.shape == (3, 16, 16, 3) and ds.images.dtype == np.uint8
    assert ds.class_names == ["gray", "rgba"]
    np.testing.assert_array_equal(ds.labels, [0, 1, 1])
    assert (ds.images[0] == 77).all()
    assert (ds.images[1] == (10, 20, 30)).all()
    assert np.abs(ds.images[2].astype(int) - (5, 250, 5)).max() <= 4


def test_load_image_folder_archive_and_ambiguity(image_tree, tmp_path, cache_dir) -> None:
    ds = load_image_folder(image_tree.archive, cache_dir=cache_dir)  # single root: train
    _check_folder_dataset(ds, 4, image_tree.colors)
    with pytest.raises(ValueError, match="split="):
        load_image_folder(image_tree.root, cache_dir=cache_dir)  # train and test
    test = load_image_folder(image_tree.root, "test", cache_dir=cache_dir)
    _check_folder_dataset(test, 2, image_tree.colors)
    with pytest.raises(DataNotFoundError):
        load_image_folder(tmp_path / "nope", cache_dir=cache_dir)


def test_load_image_folder_train_picks_train_root(image_tree, cache_dir) -> None:
    # several roots (train, test): the train one; a single root: that one
    _check_folder_dataset(load_image_folder_train(image_tree.root, cache_dir=cache_dir), 4,
                          image_tree.colors)
    _check_folder_dataset(load_image_folder_train(image_tree.root / "test", cache_dir=cache_dir),
                          2, image_tree.colors)


def test_folder_with_several_archives_picks_images(image_tree, imdb_tree, tmp_path, cache_dir):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(imdb_tree.archive, data / imdb_tree.archive.name)  # sorts first, skipped
    shutil.copy(image_tree.archive, data / "images.tar.gz")
    _check_folder_dataset(load_cifar10(data, cache_dir=cache_dir), 4, image_tree.colors)


# ----------------------------------------------------------------------------- cache


def test_cache_hit_does_not_read_source(image_tree, cache_dir, monkeypatch) -> None:
    before = _listing(image_tree.archive.parent)
    first = load_cifar10(image_tree.archive, cache_dir=cache_dir)
    assert not first.from_cache
    assert _listing(image_tree.archive.parent) == before  # nothing written next to the data
    assert any(cache_dir.rglob("*.npz"))
    monkeypatch.setattr(image_folder_mod, "iter_tar_files", _fail)
    monkeypatch.setattr(images_mod, "decode_image", _fail)
    second = load_cifar10(image_tree.archive, cache_dir=cache_dir)
    assert second.from_cache
    np.testing.assert_array_equal(second.images, first.images)
    np.testing.assert_array_equal(second.labels, first.labels)
    assert second.class_names == first.class_names


def test_cache_hit_for_folders(cifar_batches, image_tree, cache_dir, monkeypatch) -> None:
    a = load_cifar10(cifar_batches.folder, cache_dir=cache_dir)
    b = load_cifar10(image_tree.root, cache_dir=cache_dir)
    monkeypatch.setattr(cifar_mod, "_decode_batches", _fail)
    monkeypatch.setattr(image_folder_mod, "ImageDecoder", _fail)
    a2 = load_cifar10(cifar_batches.folder, cache_dir=cache_dir)
    b2 = load_cifar10(image_tree.root, cache_dir=cache_dir)
    assert a2.from_cache and b2.from_cache
    np.testing.assert_array_equal(a.images, a2.images)
    np.testing.assert_array_equal(b.images, b2.images)


def test_cache_invalidated_when_source_changes(image_tree, tmp_path, cache_dir) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(image_tree.root / "train", tree / "train")
    assert len(load_cifar10(tree, cache_dir=cache_dir)) == 12
    assert load_cifar10(tree, cache_dir=cache_dir).from_cache
    shutil.copy(tree / "train" / "cat" / "0000.jpg", tree / "train" / "cat" / "0099.jpg")
    ds = load_cifar10(tree, cache_dir=cache_dir)
    assert not ds.from_cache and len(ds) == 13


def test_cache_dir_from_env_and_unwritable_cache(cifar_batches, tmp_path, monkeypatch) -> None:
    env_dir = tmp_path / "from-env"
    monkeypatch.setenv("VIT_SERVICE_CACHE_DIR", str(env_dir))
    assert resolve_cache_dir() == env_dir
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    load_cifar10(cifar_batches.folder, "test")
    assert any(env_dir.rglob("*.npz"))
    monkeypatch.delenv("VIT_SERVICE_CACHE_DIR")
    assert resolve_cache_dir() == Path("~/.cache/vit-service").expanduser()

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    ds = load_cifar10(cifar_batches.folder, "test", cache_dir=not_a_dir)  # warns, still loads
    np.testing.assert_array_equal(ds.images, cifar_batches.test_images)


# ----------------------------------------------------------------------------- errors


def test_not_found_lists_looked_at_paths(tmp_path, cache_dir) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataNotFoundError) as err:
        load_cifar10(empty, cache_dir=cache_dir)
    exc = err.value
    assert isinstance(exc, FileNotFoundError)
    msg = str(exc)
    for path in (empty / "cifar-10-batches-py", empty / "cifar-10-python.tar.gz"):
        assert str(path) in msg and str(path) in exc.looked_at
    assert "--data-dir" in msg and "VIT_SERVICE_DATA_DIR" in msg and "download=True" in msg

    with pytest.raises(DataNotFoundError, match="does not exist"):
        load_cifar10(tmp_path / "missing", cache_dir=cache_dir)


def test_data_dir_from_env(cifar_batches, cache_dir, monkeypatch) -> None:
    with pytest.raises(DataNotFoundError, match="VIT_SERVICE_DATA_DIR"):
        load_cifar10(None, cache_dir=cache_dir)
    monkeypatch.setenv("VIT_SERVICE_DATA_DIR", str(cifar_batches.parent))
    assert len(load_cifar10(None, "test", cache_dir=cache_dir)) == 6


def test_bad_arguments(cifar_batches) -> None:
    with pytest.raises(ValueError):
        load_cifar10(cifar_batches.folder, "validation")
    with pytest.raises(ValueError):
        load_cifar10(cifar_batches.folder, image_size=0)


def test_subset(cifar_batches, cache_dir) -> None:
    ds = load_cifar10(cifar_batches.folder, cache_dir=cache_dir)
    sub = ds.subset(np.array([3, 0]))
    assert len(sub) == 2
    np.testing.assert_array_equal(sub.images[0], ds.images[3])
    np.testing.assert_array_equal(sub.labels, ds.labels[[3, 0]])
    assert sub.class_names == ds.class_names
    mask = ds.labels == ds.labels[0]
    assert len(ds.subset(mask)) == int(mask.sum())


def test_jpeg_shape_reads_headers() -> None:
    def jpeg(size: tuple[int, int], mode: str, **kw: object) -> bytes:
        buf = io.BytesIO()
        Image.new(mode, size).save(buf, "JPEG", **kw)
        return buf.getvalue()

    assert images_mod.jpeg_shape(jpeg((32, 32), "RGB")) == (32, 32, 3)
    assert images_mod.jpeg_shape(jpeg((640, 480), "RGB", progressive=True)) == (480, 640, 3)
    assert images_mod.jpeg_shape(jpeg((33, 17), "L")) == (17, 33, 1)
    assert images_mod.jpeg_shape(jpeg((10, 10), "CMYK")) == (10, 10, 4)
    assert images_mod.jpeg_shape(b"\x89PNG\r\n") is None
    assert images_mod.jpeg_shape(jpeg((32, 32), "RGB")[:40]) is None  # truncated


def test_damaged_archive_is_reported(image_tree, tmp_path, cache_dir) -> None:
    damaged = tmp_path / "cifar10-jpeg-train.tar.gz"
    data = image_tree.archive.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataNotFoundError, match="unreadable tar archive"):
        load_cifar10(damaged, cache_dir=cache_dir)
    with pytest.raises(DataNotFoundError, match="unreadable tar archive"):
        load_image_folder(damaged, cache_dir=cache_dir)
