"""CIFAR-10 loading into uint8 arrays, decoded once and cached.

Sources understood by :func:`load_cifar10`, looked for in this order (``data_dir`` may hold
one of them or be one of them):

1. the official pickled batches folder ``cifar-10-batches-py/``;
2. the official archive ``cifar-10-python.tar.gz``;
3. an ImageFolder tree ``<root>/<split>/<class>/*.jpg|png`` (also one level deeper, e.g.
   ``cifar10-jpeg/train/<class>/``, or ``data_dir`` being the split folder itself);
4. a ``.tar.gz`` / ``.tgz`` / ``.tar`` of such a tree (streamed once, never extracted).

ImageFolder sources are read by :mod:`vit_service.data.images`, whose sorted class names equal
the official label order for CIFAR-10. The decoded arrays are cached as ``.npz`` (see
:mod:`vit_service.data.cache`), so later calls skip decoding.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_service.data import cache
from vit_service.data.archive import (
    NotASource,
    SplitMissing,
    first_source,
    is_archive,
    iter_tar_files,
    not_found,
    peek_archive,
    resolve_data_dir,
)
from vit_service.data.errors import CIFAR_HINT, DataNotFoundError
from vit_service.data.image_folder import (
    find_image_folder_roots,
    load_image_folder_archive,
    load_image_folder_dir,
)
from vit_service.data.images import (
    ImageDataset,
    fit_image,
    log_loaded,
    lookup_cached,
    store_cached,
)

logger = logging.getLogger(__name__)

CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)  # official label order (alphabetical, so it matches sorted ImageFolder class folders)
CIFAR10_SPLITS = ("train", "test")
BATCHES_DIR = "cifar-10-batches-py"  # never an ImageFolder root (images.NOT_IMAGE_FOLDERS)
OFFICIAL_ARCHIVE = "cifar-10-python.tar.gz"


# ----------------------------------------------------------------------------- helpers


def _classify_archive(path: Path) -> str | None:
    """'cifar-batches', 'imdb', 'other', or None when not a tar archive."""
    names = peek_archive(path)
    if names is None:
        return None
    parts = {p for n in names for p in n.split("/")}
    if BATCHES_DIR in parts or any(n.endswith(("data_batch_1", "batches.meta")) for n in names):
        return "cifar-batches"
    if "aclImdb" in parts:
        return "imdb"
    return "other"


# ----------------------------------------------------------------------------- official batches


class _BatchUnpickler(pickle.Unpickler):
    """Unpickler for the official CIFAR batches: only numpy arrays and builtins."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")
        if module.startswith("numpy.core"):
            try:  # numpy >= 2 renamed numpy.core -> numpy._core
                return super().find_class("numpy._core" + module[len("numpy.core") :], name)
            except (ImportError, AttributeError):
                pass
        return super().find_class(module, name)


def _unpickle(data: bytes) -> dict[Any, Any]:
    obj = _BatchUnpickler(io.BytesIO(data), encoding="bytes").load()
    if not isinstance(obj, dict):
        raise NotASource("CIFAR batch file does not hold a dict")
    return obj


def _get(d: dict[Any, Any], key: str) -> Any:
    if key.encode() in d:
        return d[key.encode()]
    return d.get(key)


def _batch_names(split: str, available: Sequence[str]) -> list[str]:
    if split == "test":
        return ["test_batch"] if "test_batch" in available else []
    names = [n for n in available if re.fullmatch(r"data_batch_\d+", n)]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]))


def _decode_batches(
    blobs: dict[str, bytes], split: str, image_size: int, source: Path
) -> ImageDataset:
    """Official pickled batches (name -> file bytes) -> ImageDataset."""
    names = _batch_names(split, list(blobs))
    if not names:
        raise SplitMissing(f"{source}: the {split!r} split is not present (no batch files)")
    class_names = list(CIFAR10_CLASSES)
    if "batches.meta" in blobs:
        meta_names = _get(_unpickle(blobs["batches.meta"]), "label_names")
        if meta_names:
            class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta_names]
    images, labels = [], []
    for name in names:
        batch = _unpickle(blobs[name])
        data = np.asarray(_get(batch, "data"), dtype=np.uint8)  # (n, 3072) channel-planar RGB
        lab = _get(batch, "labels")
        if lab is None:
            lab = _get(batch, "fine_labels")
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or lab is None:
            raise NotASource(f"{source}/{name}: not a CIFAR batch (data {data.shape})")
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # (n, 32, 32, 3)
        labels.append(np.asarray(lab, dtype=np.int64))
    imgs = np.ascontiguousarray(np.concatenate(images))  # (N, 32, 32, 3) uint8
    if image_size != 32:
        imgs = np.stack([np.asarray(fit_image(Image.fromarray(im), image_size)) for im in imgs])
    return ImageDataset(imgs, np.concatenate(labels), class_names, source=str(source))


def _load_batches_dir(
    folder: Path, split: str, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    names = _batch_names(split, [p.name for p in folder.iterdir() if p.is_file()])
    if not names:
        raise SplitMissing(f"{folder}: the {split!r} split is not present (no batch files)")
    files = [folder / n for n in [*names, "batches.meta"] if (folder / n).is_file()]
    fp = {"files": [cache.fingerprint(f) for f in files]}
    params = {"loader": "cifar-batches", "split": split, "image_size": image_size}
    path, hit = lookup_cached(cache_dir, folder, fp, params)
    if hit is not None:
        return hit
    ds = _decode_batches({f.name: f.read_bytes() for f in files}, split, image_size, folder)
    store_cached(path, ds)
    return ds


def _load_batches_archive(
    archive: Path, split: str, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    params = {"loader": "cifar-batches", "split": split, "image_size": image_size}
    path, hit = lookup_cached(cache_dir, archive, cache.fingerprint(archive), params)
    if hit is not None:
        return hit

    def want(name: str) -> bool:
        base = os.path.basename(name)
        return base == "batches.meta" or bool(_batch_names(split, [base]))

    blobs = {
        os.path.basename(name): data
        for name, data in iter_tar_files(archive, want)
        if data is not None
    }
    ds = _decode_batches(blobs, split, image_size, archive)
    store_cached(path, ds)
    return ds


# ----------------------------------------------------------------------------- CIFAR-10


def _cifar_candidates(
    root: Path, split: str, looked: list[str], details: list[str]
) -> Iterator[tuple[str, Path]]:
    """(kind, path) of possible CIFAR-10 sources under/at ``root``, in preference order."""
    if root.is_dir():
        looked.append(str(root / BATCHES_DIR))
        if (root / "data_batch_1").is_file() or (root / "test_batch").is_file():
            yield "batches-dir", root
        if (root / BATCHES_DIR).is_dir():
            yield "batches-dir", root / BATCHES_DIR
        looked.append(str(root / OFFICIAL_ARCHIVE))
        if (root / OFFICIAL_ARCHIVE).is_file():
            yield "batches-archive", root / OFFICIAL_ARCHIVE
        looked.append(f"{root}/[*/]{split}/<class>/*.jpg|png (ImageFolder tree)")
        roots = find_image_folder_roots(root)
        for r in roots:
            if r.name == split:
                yield "imagefolder-dir", r
        if roots and not any(r.name == split for r in roots):
            details.append(
                f"{root}: ImageFolder tree(s) at {', '.join(map(str, roots))} but the "
                f"{split!r} split is not present"
            )
        archives = sorted(
            (
                p
                for p in root.iterdir()
                if p.is_file() and is_archive(p) and p.name != OFFICIAL_ARCHIVE
            ),
            key=lambda p: ("cifar" not in p.name.lower(), p.name),
        )
        if not archives:
            looked.append(f"{root}/*.tar.gz|*.tgz|*.tar (none found)")
        candidates = archives
    elif root.is_file():
        candidates = [root]
    else:
        looked.append(f"{root} (does not exist)")
        return
    for archive in candidates:
        looked.append(str(archive))
        kind = _classify_archive(archive)
        if kind is None:
            details.append(f"{archive}: unreadable tar archive")
        elif kind == "imdb":
            details.append(f"{archive}: holds aclImdb (text), skipped")
        elif kind == "cifar-batches":
            yield "batches-archive", archive
        else:
            yield "imagefolder-archive", archive


def _download_cifar10(root: Path) -> Path:
    """Fetch the official archive with torchvision into ``root`` (needs network)."""
    from torchvision.datasets import CIFAR10  # heavy import, only when downloading

    root.mkdir(parents=True, exist_ok=True)
    logger.info("downloading CIFAR-10 into %s", root)
    CIFAR10(str(root), train=True, download=True)
    return root / BATCHES_DIR


def load_cifar10(
    data_dir: str | Path | None,
    split: str = "train",
    *,
    image_size: int = 32,
    cache_dir: str | Path | None = None,
    download: bool = False,
) -> ImageDataset:
    """Load a CIFAR-10 split as ``(N, image_size, image_size, 3)`` uint8 images + labels.

    ``data_dir`` (None: ``$VIT_SERVICE_DATA_DIR``) holds or is one of: ``cifar-10-batches-py/``,
    ``cifar-10-python.tar.gz``, an ImageFolder tree, or a tar of one. Decoded data is cached
    under ``cache_dir`` (see :func:`vit_service.data.cache.resolve_cache_dir`). With
    ``download=True`` and nothing found, torchvision fetches the official archive into
    ``data_dir``. Raises :class:`DataNotFoundError` listing every path looked at.
    """
    if split not in CIFAR10_SPLITS:
        raise ValueError(f"split must be one of {CIFAR10_SPLITS}, got {split!r}")
    if image_size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")
    t0 = time.perf_counter()
    root = resolve_data_dir(data_dir, CIFAR_HINT)
    looked: list[str] = []
    details: list[str] = []

    def load(kind: str, path: Path) -> ImageDataset:
        if kind == "batches-dir":
            return _load_batches_dir(path, split, image_size, cache_dir)
        if kind == "batches-archive":
            return _load_batches_archive(path, split, image_size, cache_dir)
        if kind == "imagefolder-dir":
            return load_image_folder_dir(path, image_size, cache_dir)
        return load_image_folder_archive(path, split, image_size, cache_dir)

    def fetch() -> ImageDataset:
        return _load_batches_dir(_download_cifar10(root), split, image_size, cache_dir)

    ds = first_source(_cifar_candidates(root, split, looked, details), load, details,
                      folder_kinds=("batches-dir", "imagefolder-dir"),
                      download=fetch if download else None)
    if ds is None:
        raise DataNotFoundError(not_found("CIFAR-10", split, root, details), looked,
                                CIFAR_HINT, details)
    if ds.num_classes != len(CIFAR10_CLASSES):
        logger.warning("%s has %d classes, CIFAR-10 has 10", ds.source, ds.num_classes)
    log_loaded(f"loaded CIFAR-10 {split}", ds, t0)
    return ds
