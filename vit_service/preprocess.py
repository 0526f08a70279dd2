"""Turning raw inputs into model tensors, from a bundle's own metadata (shared by the trainer's
evaluation helpers, the REST server and the MLflow pyfunc)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from vit_service.bundle import BundleMeta
from vit_service.data.images import to_8bit, upright


class ImageDecodeError(ValueError):
    """The bytes are not a decodable image (corrupt, truncated, or an unknown format)."""


class ImageTooLargeError(ValueError):
    """The image has more pixels than allowed (decompression-bomb guard)."""


# The formats a served image may be in. Pillow opens many more (EPS runs Ghostscript where it
# is installed, and rarer plug-ins are rarer-tested parsers): anything else is a 415-like 400.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")


def image_header(data: bytes) -> tuple[str, int, int]:
    """``(format, width, height)`` from the header alone (nothing decoded); an unknown or
    disallowed format raises :class:`ImageDecodeError`."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            return str(img.format), int(img.width), int(img.height)
    except Image.DecompressionBombError as e:  # Pillow's own (larger) limit
        raise ImageTooLargeError(str(e)) from e
    except Exception as e:  # PIL raises many types for bad data
        raise ImageDecodeError(f"cannot decode image: not a {'/'.join(IMAGE_FORMATS)} image, "
                               "or a corrupt one") from e


def decode_image(data: bytes, max_pixels: int = 4096 * 4096,
                 min_side: int | None = None) -> Image.Image:
    """Decode bytes to an RGB PIL image, fully (so truncation is detected here, not later).

    ``min_side``: the decoded image may be smaller than the original, as long as both sides
    stay at least ``min_side`` (the model's input size, or what an overlay needs): JPEGs are
    decoded at a reduced DCT scale (``draft``) and other formats reduced in their own mode
    (a 1-bit or palette image, before it grows 24-fold into RGB), so memory follows the
    model's size rather than the upload's."""
    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        w, h = img.size
        if w * h > max_pixels:
            raise ImageTooLargeError(
                f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}"
            )
        if min_side is not None and img.format == "JPEG":
            img.draft("RGB", (min_side, min_side))  # keeps both sides >= min_side
        img.load()
        img = to_8bit(upright(img))  # as training decodes it
        if min_side is not None:
            img = _reduce(img, min_side)
        return img.convert("RGB")
    except ImageTooLargeError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageTooLargeError(str(e)) from e
    except Exception as e:  # PIL raises many types for bad data
        raise ImageDecodeError(f"cannot decode image ({type(e).__name__})") from e


def _reduce(img: Image.Image, min_side: int) -> Image.Image:
    """An integer downscale keeping both sides >= ``min_side`` (box filter where the mode has
    one, nearest for 1-bit and palette images)."""
    factor = min(img.width, img.height) // max(1, min_side)
    if factor < 2:
        return img
    if img.mode in ("1", "P"):
        return img.resize((img.width // factor, img.height // factor), Image.NEAREST)
    return img.reduce(factor)


def images_to_tensor(images: Sequence[Image.Image], meta: BundleMeta) -> torch.Tensor:
    """RGB images of any size -> normalised ``(B, 3, S, S)`` float tensor (S = model's size)."""
    p = meta.preprocess
    size = int(p["image_size"])
    arrs = []
    for img in images:
        if img.mode != "RGB":
            img = img.convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.BICUBIC)
        arrs.append(np.asarray(img, dtype=np.uint8))
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float().div_(255)  # (B, 3, S, S)
    mean = torch.tensor(p["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(p["std"]).view(1, 3, 1, 1)
    return (x - mean) / std
