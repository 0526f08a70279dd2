"""Small real-format data sets built in temporary folders (never the shared data)."""

from __future__ import annotations

import pickle
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_service.data import CIFAR10_CLASSES

CIFAR10_NAMES = list(CIFAR10_CLASSES)  # what the official batches.meta holds
# ImageFolder fixture: a few classes with distinct solid colours (JPEG keeps them within +-3)
FOLDER_COLORS = {"bird": (200, 30, 30), "airplane": (30, 200, 30), "cat": (30, 30, 200)}
FOLDER_PER_CLASS = 4


@dataclass
class CifarBatches:
    parent: Path  # folder containing cifar-10-batches-py/
    folder: Path  # the cifar-10-batches-py/ folder
    archive: Path  # cifar-10-python.tar.gz of it (in its own folder)
    train_images: np.ndarray  # (N, 32, 32, 3) uint8, expected
    train_labels: np.ndarray  # (N,) int64
    test_images: np.ndarray
    test_labels: np.ndarray


@dataclass
class ImageTree:
    parent: Path  # folder containing cifar10-jpeg/{train,test}/<class>/*.jpg
    root: Path  # the cifar10-jpeg folder
    archive: Path  # .tar.gz of cifar10-jpeg/train only (like the shared archive)
    classes: list[str] = field(default_factory=list)
    colors: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # class -> solid RGB


@dataclass
class ImdbTree:
    parent: Path  # folder containing aclImdb/
    root: Path  # aclImdb/
    archive: Path  # .tar.gz holding aclImdb/ (in its own folder)
    reviews: dict[str, str] = field(default_factory=dict)  # "train/pos/0_9" -> raw text


def _planar_to_hwc(row: np.ndarray) -> np.ndarray:
    """One CIFAR row (3072,) -> (32, 32, 3), written independently of the loader's reshape."""
    out = np.empty((32, 32, 3), dtype=np.uint8)
    for c in range(3):
        for y in range(32):
            out[y, :, c] = row[c * 1024 + y * 32 : c * 1024 + (y + 1) * 32]
    return out


def _tar(src: Path, arcname: str, dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(src, arcname=arcname)
    return dest


@pytest.fixture(scope="session")
def cifar_batches(tmp_path_factory: pytest.TempPathFactory) -> CifarBatches:
    """Official-layout cifar-10-batches-py (5 train batches of 4, test batch of 6) + tar.gz."""
    parent = tmp_path_factory.mktemp("cifar_official")
    folder = parent / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1234)

    def write_batch(name: str, n: int, label: str) -> tuple[np.ndarray, np.ndarray]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)  # channel-planar rows
        labels = rng.integers(0, 10, size=n).tolist()
        batch = {
            b"batch_label": label.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [f"img_{i}.png".encode() for i in range(n)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        images = np.stack([_planar_to_hwc(r) for r in data])
        return images, np.array(labels, dtype=np.int64)

    train = [write_batch(f"data_batch_{i}", 4, f"training batch {i} of 5") for i in range(1, 6)]
    test_images, test_labels = write_batch("test_batch", 6, "testing batch 1 of 1")
    meta = {
        b"num_cases_per_batch": 4,
        b"label_names": [n.encode() for n in CIFAR10_NAMES],
        b"num_vis": 3072,
    }
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    (folder / "readme.html").write_text("<html>CIFAR-10</html>")
    archive = _tar(
        folder,
        "cifar-10-batches-py",
        tmp_path_factory.mktemp("cifar_tar") / "cifar-10-python.tar.gz",
    )
    return CifarBatches(
        parent=parent,
        folder=folder,
        archive=archive,
        train_images=np.concatenate([t[0] for t in train]),
        train_labels=np.concatenate([t[1] for t in train]),
        test_images=test_images,
        test_labels=test_labels,
    )


def _solid_jpeg(path: Path, color: tuple[int, int, int], noise_seed: int) -> None:
    arr = np.empty((32, 32, 3), dtype=np.uint8)
    arr[:] = color
    arr[0, 0] = (noise_seed * 37) % 256  # make files differ
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, format="JPEG", quality=95)


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory: pytest.TempPathFactory) -> ImageTree:
    """cifar10-jpeg/{train,test}/<class>/NNNN.jpg and a .tar.gz of cifar10-jpeg/train only."""
    parent = tmp_path_factory.mktemp("jpeg_tree")
    root = parent / "cifar10-jpeg"
    for split, n in (("train", FOLDER_PER_CLASS), ("test", 2)):
        for k, (cls, color) in enumerate(FOLDER_COLORS.items()):
            for i in range(n):
                _solid_jpeg(root / split / cls / f"{i:04d}.jpg", color, 10 * k + i)
    (root / "README.txt").write_text("not an image")
    archive_dir = tmp_path_factory.mktemp("jpeg_tar")
    archive = archive_dir / "cifar10-jpeg-train.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(root / "train", arcname="cifar10-jpeg/train")
        tf.add(root / "README.txt", arcname="cifar10-jpeg/README.txt")
    return ImageTree(parent=parent, root=root, archive=archive, classes=sorted(FOLDER_COLORS),
                     colors=dict(FOLDER_COLORS))


IMDB_REVIEWS = {
    # numeric ids chosen so that numeric order differs from string order (2 < 10)
    "train/pos/10_8": "Great film!<br /><br />Loved   every minute.",
    "train/pos/2_10": "A masterpiece.<br/>Café scenes were <BR>wonderful.",
    "train/pos/0_9": "Good acting\tand a fine plot.",
    "train/pos/1_7": "Pretty good overall.",
    "train/neg/11_2": "Awful.<br />Just awful.",
    "train/neg/3_4": "Not great,<br /> not terrible.",
    "train/neg/0_1": "The worst film I have seen.",
    "train/unsup/12_0": "Saw it on a Tuesday.<br /><br />No opinion.",
    "train/unsup/5_0": "It is a film.",
    "train/unsup/0_0": "Watched it twice.",
}
IMDB_TEST_REVIEWS = {
    "test/pos/4_9": "Lovely.<br />Simply lovely.",
    "test/neg/7_3": "Boring.",
    "test/neg/6_2": "Dull and slow.",
}


def _write_imdb(root: Path, reviews: dict[str, str]) -> None:
    for rel, text in reviews.items():
        path = root / f"{rel}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "imdb.vocab").write_text("the\nfilm\n")
    (root / "README").write_text("Large Movie Review Dataset v1.0")
    (root / "train" / "urls_pos.txt").write_text("http://www.imdb.com/title/tt0000001/\n")


@pytest.fixture(scope="session")
def imdb_tree(tmp_path_factory: pytest.TempPathFactory) -> ImdbTree:
    """aclImdb/train/{pos,neg,unsup} (no test split, like the shared archive) + .tar.gz."""
    parent = tmp_path_factory.mktemp("imdb_train")
    root = parent / "aclImdb"
    _write_imdb(root, IMDB_REVIEWS)
    archive = _tar(root, "aclImdb", tmp_path_factory.mktemp("imdb_tar") / "aclImdb-train.tar.gz")
    return ImdbTree(parent=parent, root=root, archive=archive, reviews=dict(IMDB_REVIEWS))


@pytest.fixture(scope="session")
def imdb_full(tmp_path_factory: pytest.TempPathFactory) -> ImdbTree:
    """Official-like aclImdb with train and test + aclImdb_v1.tar.gz."""
    parent = tmp_path_factory.mktemp("imdb_full")
    root = parent / "aclImdb"
    reviews = {**IMDB_REVIEWS, **IMDB_TEST_REVIEWS}
    _write_imdb(root, reviews)
    archive = _tar(root, "aclImdb", tmp_path_factory.mktemp("imdb_v1") / "aclImdb_v1.tar.gz")
    return ImdbTree(parent=parent, root=root, archive=archive, reviews=reviews)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """A fresh cache folder per test."""
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Never touch the user's cache or data folders from tests."""
    monkeypatch.setenv("VIT_SERVICE_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.delenv("VIT_SERVICE_DATA_DIR", raising=False)
