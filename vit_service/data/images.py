"""Generic image loading into uint8 arrays: decoding (PIL, or torchvision's batch JPEG decoder)
and the decode cache. The decoded arrays are cached as ``.npz`` (see
:mod:`vit_service.data.cache`), so later calls skip decoding. The ImageFolder loader
(:mod:`vit_service.data.image_folder`) and the CIFAR-10 one (:mod:`vit_service.data.cifar`)
build on this module.
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
from PIL import Image, ImageOps

from vit_service.data import cache

logger = logging.getLogger(__name__)

LOADER_VERSION = "2"  # part of every image cache key: bump to invalidate decoded caches
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


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS) and not os.path.basename(name).startswith(".")


ORIENTATION = 0x0112  # the EXIF tag


def upright(img: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says (a phone photo stands the way it was
    shot, not on its side); a malformed EXIF block leaves it as stored."""
    try:
        if img.getexif().get(ORIENTATION, 1) == 1:  # upright already: no copy
            return img
        return ImageOps.exif_transpose(img)
    except Exception:  # Pillow raises several kinds for a corrupt EXIF block
        return img


def to_8bit(img: Image.Image) -> Image.Image:
    """A 16- or 32-bit integer grayscale image as 8-bit ``L``, its range scaled (Pillow's own
    conversion clips at 255, so a 16-bit scan turned white; nor can it be reduced)."""
    if not (img.mode.startswith("I;16") or img.mode == "I"):
        return img
    a = np.asarray(img).astype(np.int64)  # (H, W)
    top = 65535 if img.mode.startswith("I;16") or a.max(initial=0) > 255 else 255
    a = np.clip(a, 0, top) * 255 // top
    return Image.fromarray(a.astype(np.uint8))  # (H, W) uint8: mode L


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
        out = fit_image(to_8bit(upright(img)), image_size)
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


class ImageDecoder:
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
            # turned by EXIF orientation as the Pillow path and the server turn them
            decoded = self.fast(tensors, apply_exif_orientation=True)  # list of (C, H, W) uint8
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


def stack_images(images: list[np.ndarray], image_size: int) -> np.ndarray:
    if not images:
        return np.zeros((0, image_size, image_size, 3), dtype=np.uint8)
    return np.stack(images)  # (N, S, S, 3) uint8
