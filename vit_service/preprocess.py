"""Turning raw inputs into model tensors, from a bundle's own metadata (shared by the trainer's
evaluation helpers, the REST server and the MLflow pyfunc)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from vit_service.bundle import BundleMeta


class ImageDecodeError(ValueError):
    """The bytes are not a decodable image (corrupt, truncated, or an unknown format)."""


class ImageTooLargeError(ValueError):
    """The image has more pixels than allowed (decompression-bomb guard)."""


def decode_image(data: bytes, max_pixels: int = 4096 * 4096) -> Image.Image:
    """Decode bytes to an RGB PIL image, fully (so truncation is detected here, not later)."""
    try:
        img = Image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > max_pixels:
            raise ImageTooLargeError(
                f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}"
            )
        img.load()
        return img.convert("RGB")
    except ImageTooLargeError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageTooLargeError(str(e)) from e
    except Exception as e:  # PIL raises many types for bad data
        raise ImageDecodeError(f"cannot decode image: {e}") from e


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
