"""Generic image loading into uint8 arrays: decoding (PIL, or torchvision's batch JPEG decoder),
the decode cache, and ImageFolder trees (``[<root>/][<split>/]<class>/*.jpg|png``) or tar
archives of one (streamed once, never extracted).

Class names of ImageFolder trees are sorted by name (as torchvision's ``ImageFolder``). The
decoded arrays are cached as ``.npz`` (see :mod:`vit_service.data.cache`), so later calls skip
decoding. The CIFAR-10 loader (:mod:`vit_service.data.cifar`) builds on this module.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vit_service.data import cache
from vit_service.data.archive import (
    ARCHIVE_ERRORS,
    NotASource,
    SplitMissing,
    is_archive,
    iter_tar_files,
    peek_archive,
)
from vit_service.data.errors import IMAGE_FOLDER_HINT, DataNotFoundError

logger = logging.getLogger(__name__)

LOADER_VERSION = "1"  # part of every image cache key: bump to invalidate decoded caches
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
USE_TORCHVISION_JPEG = True  # batch-decode JPEGs with torchvision.io when importable
# folders never taken for an ImageFolder root: the official CIFAR-10 pickled batches folder
NOT_IMAGE_FOLDERS = frozenset({"cifar-10-batches-py"})


@dataclass
class ImageDataset:
    """Decoded images with integer labels."""

    images: np.ndarray  # (N, H, W, 3) uint8
    labels: np.ndarray  # (N,) int64, index into class_names
    class_names: list[str]
    source: str = ""  # where the data came from (path of the folder or archive)
    from_cache: bool = False  # True when the arrays were read from the decode cache

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, indices: Sequence[int] | np.ndarray) -> ImageDataset:
        """A new dataset with the rows at ``indices`` (ints or a boolean mask)."""
        idx = np.asarray(indices)
        return ImageDataset(
            images=self.images[idx],
            labels=self.labels[idx],
            class_names=list(self.class_names),
            source=self.source,
            from_cache=self.from_cache,
        )


# ----------------------------------------------------------------------------- helpers


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS) and not os.path.basename(name).startswith(".")


def fit_image(img: Image.Image, size: int) -> Image.Image:
    """RGB, shorter side resized to ``size`` then centre-cropped to ``size`` x ``size``."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    if (w, h) == (size, size):
        return img
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return img.crop((left, top, left + size, top + size))


def decode_image(data: bytes, image_size: int) -> np.ndarray:
    """Encoded image bytes -> (image_size, image_size, 3) uint8 RGB (with PIL)."""
    with Image.open(io.BytesIO(data)) as img:
        if img.format == "JPEG" and min(img.size) > image_size:
            img.draft("RGB", (image_size, image_size))  # let libjpeg downscale by 1/2..1/8
        out = fit_image(img, image_size)
        return np.asarray(out, dtype=np.uint8)


def _jpeg_batch_decoder() -> Any | None:
    """torchvision's C++ batch JPEG decoder, or None when unavailable/disabled."""
    if not USE_TORCHVISION_JPEG:
        return None
    try:
        from torchvision.io import decode_jpeg
    except (ImportError, OSError, RuntimeError):  # any import problem disables the fast path
        return None
    return decode_jpeg


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers


def jpeg_shape(data: bytes) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG's start-of-frame header; None if not found."""
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in _SOF_MARKERS:
            if i + 10 > n:
                return None
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            return height, width, data[i + 9]
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


class _Decoder:
    """Decodes many images, batching JPEGs through torchvision's decoder when available.

    Only JPEGs whose header says (image_size, image_size, 3 components) take the fast path
    (3x less CPU than Pillow for 32x32 images; torchvision and Pillow both use libjpeg-turbo
    with the same defaults, so the pixels are identical - checked in the tests). Everything
    else (other sizes, grayscale/CMYK, PNG, decode errors) goes through :func:`decode_image`.
    Undecodable files are skipped with a warning.
    """

    def __init__(self, image_size: int, batch: int = 1024) -> None:
        self.image_size = image_size
        self.batch = batch
        self.fast = _jpeg_batch_decoder()
        self.pending: list[tuple[Any, bytes]] = []
        self.results: list[tuple[Any, np.ndarray]] = []  # (key, (S, S, 3) uint8)
        self.failed: list[str] = []

    def add(self, key: Any, data: bytes) -> None:
        s = self.image_size
        if self.fast is not None and jpeg_shape(data) == (s, s, 3):
            self.pending.append((key, data))
            if len(self.pending) >= self.batch:
                self._flush()
        else:
            self._slow(key, data)

    def _slow(self, key: Any, data: bytes) -> None:
        try:
            self.results.append((key, decode_image(data, self.image_size)))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            self.failed.append(f"{key}: {exc}")

    def _flush(self) -> None:
        import torch

        pending, self.pending = self.pending, []
        if not pending:
            return
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for _, d in pending]
        try:
            decoded = self.fast(tensors)  # list of (C, H, W) uint8
        except RuntimeError:
            decoded = [None] * len(pending)
        s = self.image_size
        ok = [i for i, t in enumerate(decoded) if t is not None and tuple(t.shape) == (3, s, s)]
        if ok:
            chw = torch.stack([decoded[i] for i in ok]).numpy()  # (B, 3, S, S) uint8
            arr = np.ascontiguousarray(chw.transpose(0, 2, 3, 1))  # (B, S, S, 3) uint8
            self.results.extend((pending[i][0], arr[j]) for j, i in enumerate(ok))
        for i in sorted(set(range(len(pending))) - set(ok)):
            self._slow(*pending[i])

    def finish(self) -> list[tuple[Any, np.ndarray]]:
        self._flush()
        if self.failed:
            logger.warning(
                "skipped %d undecodable image(s), e.g. %s", len(self.failed), self.failed[:3]
            )
        return self.results


def log_loaded(what: str, ds: ImageDataset, t0: float) -> None:
    logger.info(
        "%s: %d images %s, %d classes, from %s (%s) in %.2fs",
        what,
        len(ds),
        tuple(ds.images.shape[1:]),
        ds.num_classes,
        ds.source,
        "cache" if ds.from_cache else "decoded",
        time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------- cache


def lookup_cached(
    cache_dir: str | Path | None, source: Path, fp: dict[str, Any], params: dict[str, Any]
) -> tuple[Path, ImageDataset | None]:
    key = cache.cache_key(fp, version=LOADER_VERSION, params=params)
    path = cache.cache_file(cache_dir, "images", source, key, ".npz")
    arrays = cache.load_npz(path)
    if arrays is None or not {"images", "labels", "class_names"} <= arrays.keys():
        return path, None
    logger.debug("image cache hit %s", path)
    ds = ImageDataset(
        images=arrays["images"],
        labels=arrays["labels"].astype(np.int64, copy=False),
        class_names=[str(c) for c in arrays["class_names"]],
        source=str(source),
        from_cache=True,
    )
    return path, ds


def store_cached(path: Path, ds: ImageDataset) -> None:
    ok = cache.save_npz(
        path,
        {
            "images": ds.images,
            "labels": ds.labels,
            "class_names": np.array(ds.class_names, dtype=str),
        },
    )
    if ok:
        logger.debug("wrote image cache %s", path)


def _stack(images: list[np.ndarray], image_size: int) -> np.ndarray:
    if not images:
        return np.zeros((0, image_size, image_size, 3), dtype=np.uint8)
    return np.stack(images)  # (N, S, S, 3) uint8


# ----------------------------------------------------------------------------- ImageFolder


def _has_image_file(folder: Path) -> bool:
    try:
        with os.scandir(folder) as it:
            return any(e.is_file() and _is_image_name(e.name) for e in it)
    except OSError:
        return False


def _subdirs(folder: Path) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return sorted(Path(e.path) for e in it if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def find_image_folder_roots(path: Path, max_depth: int = 2) -> list[Path]:
    """Folders at most ``max_depth`` below ``path`` whose subfolders (classes) hold images.

    Returned shallowest first, then by name. A found root is not searched further.
    """
    roots: list[Path] = []
    level = [path]
    for _depth in range(max_depth + 1):
        nxt: list[Path] = []
        for folder in level:
            if folder.name in NOT_IMAGE_FOLDERS:
                continue
            subs = _subdirs(folder)
            if any(_has_image_file(s) for s in subs):
                roots.append(folder)
            else:
                nxt.extend(subs)
        level = nxt
    return roots


def _choose_root(roots: Sequence[str], split: str | None, where: Path) -> str:
    """Pick the ImageFolder root for ``split`` among relative root paths ('' = top level)."""
    if split is not None:
        matching = [r for r in roots if r.split("/")[-1] == split]
        if not matching:
            found = sorted({r.split("/")[-1] or "<top level>" for r in roots})
            raise SplitMissing(
                f"{where}: the {split!r} split is not present "
                f"(ImageFolder tree has only: {', '.join(found)})"
            )
        return min(matching, key=lambda r: (r.count("/"), r))
    if len(roots) == 1:
        return roots[0]
    shallow = min(r.count("/") if r else -1 for r in roots)
    top = [r for r in roots if (r.count("/") if r else -1) == shallow]
    if len(top) == 1:
        return top[0]
    raise ValueError(
        f"{where} holds several ImageFolder roots ({', '.join(sorted(top))}); pass split="
    )


def _assemble(
    items: list[tuple[str, str, np.ndarray]], image_size: int, source: Path
) -> ImageDataset:
    """(class, file name, image) triples -> dataset sorted by class then file name."""
    class_names = sorted({c for c, _, _ in items})
    index = {c: i for i, c in enumerate(class_names)}
    items = sorted(items, key=lambda t: (t[0], t[1]))
    images = _stack([im for _, _, im in items], image_size)
    labels = np.array([index[c] for c, _, _ in items], dtype=np.int64)  # (N,)
    return ImageDataset(images, labels, class_names, source=str(source))


def load_image_folder_dir(
    root: Path, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    fp = cache.fingerprint(root)
    params = {"loader": "imagefolder", "image_size": image_size}
    path, hit = lookup_cached(cache_dir, root, fp, params)
    if hit is not None:
        return hit
    decoder = _Decoder(image_size)
    for class_dir in _subdirs(root):
        for entry in sorted(os.scandir(class_dir), key=lambda e: e.name):
            if entry.is_file() and _is_image_name(entry.name):
                decoder.add((class_dir.name, entry.name), Path(entry.path).read_bytes())
    items = [(cls, fname, im) for (cls, fname), im in decoder.finish()]
    if not items:
        raise NotASource(f"{root}: no images in class folders")
    ds = _assemble(items, image_size, root)
    store_cached(path, ds)
    return ds


def _split_member(name: str) -> tuple[str, str, str] | None:
    """Tar member name -> (root, class, file) for ``[root/]class/file.<image ext>``."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if len(parts) < 2 or not _is_image_name(parts[-1]):
        return None
    return "/".join(parts[:-2]), parts[-2], parts[-1]


def load_image_folder_archive(
    archive: Path, split: str | None, image_size: int, cache_dir: str | Path | None
) -> ImageDataset:
    """Stream a tar of an ImageFolder tree once, decoding members of the requested root."""
    fp = cache.fingerprint(archive)
    manifest_key = cache.cache_key(fp, version=LOADER_VERSION, params={"what": "roots"})
    manifest_path = cache.cache_file(cache_dir, "images", archive, manifest_key, ".roots.json")
    manifest = cache.load_json(manifest_path)
    chosen: str | None = None
    if isinstance(manifest, list):
        if not manifest:
            raise NotASource(f"{archive}: no ImageFolder images in this archive")
        chosen = _choose_root(manifest, split, archive)  # raises SplitMissing early
    params = {"loader": "imagefolder", "image_size": image_size, "split": split}
    path, hit = lookup_cached(cache_dir, archive, fp, params)
    if hit is not None:
        return hit

    def wanted(root: str) -> bool:
        if chosen is not None:
            return root == chosen
        return split is None or root.split("/")[-1] == split

    roots: set[str] = set()
    decoder = _Decoder(image_size)
    parsed_names: dict[str, tuple[str, str, str] | None] = {}

    def want(name: str) -> bool:
        parsed = parsed_names[name] = _split_member(name)
        return parsed is not None and wanted(parsed[0])

    for name, data in iter_tar_files(archive, want):
        parsed = parsed_names.pop(name, None)
        if parsed is None:
            continue
        roots.add(parsed[0])
        if data is not None:
            decoder.add(parsed, data)
    items: dict[str, list[tuple[str, str, np.ndarray]]] = {}
    for (root, cls, fname), im in decoder.finish():
        items.setdefault(root, []).append((cls, fname, im))
    cache.save_json(manifest_path, sorted(roots))
    if not roots:
        raise NotASource(f"{archive}: no ImageFolder images in this archive")
    chosen = _choose_root(sorted(roots), split, archive)
    if chosen not in items:
        raise NotASource(f"{archive}: no decodable images under {chosen or '<top level>'}")
    ds = _assemble(items[chosen], image_size, archive)
    store_cached(path, ds)
    return ds


def load_image_folder(
    path: str | Path,
    split: str | None = None,
    image_size: int = 32,
    cache_dir: str | Path | None = None,
) -> ImageDataset:
    """Load any ImageFolder tree (``[<root>/][<split>/]<class>/*.jpg``) or a tar archive of one.

    With ``split`` given, the class folders are those of the folder named ``split``; without,
    the tree must have a single (shallowest) root. Images are converted to RGB, resized so the
    shorter side is ``image_size`` and centre-cropped. Decoded arrays are cached.
    """
    t0 = time.perf_counter()
    src = Path(path).expanduser()
    try:
        if src.is_file():
            if not is_archive(src) and peek_archive(src) is None:
                raise NotASource(f"{src}: neither a folder nor a tar archive")
            try:
                ds = load_image_folder_archive(src, split, image_size, cache_dir)
            except ARCHIVE_ERRORS as exc:
                raise NotASource(f"{src}: unreadable tar archive ({exc})") from None
        elif src.is_dir():
            rel_roots = {
                os.path.relpath(r, src).replace(os.sep, "/"): r
                for r in find_image_folder_roots(src)
            }
            rel_roots = {("" if k == "." else k): v for k, v in rel_roots.items()}
            if not rel_roots:
                raise NotASource(f"{src}: no <class>/<image> folders within two levels")
            if split is not None and src.name == split and "" in rel_roots:
                chosen = ""
            else:
                chosen = _choose_root(sorted(rel_roots), split, src)
            ds = load_image_folder_dir(rel_roots[chosen], image_size, cache_dir)
        else:
            raise NotASource(f"{src}: does not exist")
    except NotASource as exc:
        raise DataNotFoundError(
            f"No ImageFolder data found at {src}", [src], IMAGE_FOLDER_HINT, [str(exc)]
        ) from None
    log_loaded("loaded ImageFolder", ds, t0)
    return ds


def load_image_folder_train(
    path: str | Path, image_size: int = 32, cache_dir: str | Path | None = None
) -> ImageDataset:
    """A training run's ``data.path``: an ImageFolder tree or a tar of one; when it has several
    roots (``train/``, ``test/``...), its ``train`` root."""
    try:
        return load_image_folder(path, None, image_size=image_size, cache_dir=cache_dir)
    except ValueError as e:
        if "several ImageFolder roots" not in str(e):
            raise
        return load_image_folder(path, "train", image_size=image_size, cache_dir=cache_dir)
