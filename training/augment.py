"""Batched, on-device image augmentation for uint8 batches ``(B, 3, H, W)``.

Random numbers: per-sample tensors (crop offsets, flips) come from torch's default generator on
the batch's device; per-batch scalars (apply CutMix?, lambda, box) from Python's ``random``. Both
are seeded by the trainer and saved in checkpoints, so a resumed run draws the same numbers.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def random_crop(x: Tensor, padding: int, generator: torch.Generator | None = None) -> Tensor:
    """Zero-pad by ``padding`` and cut a random ``H x W`` window per image (torchvision's
    ``RandomCrop(size, padding)`` for a whole batch at once)."""
    if padding <= 0:
        return x
    B, C, H, W = x.shape
    xp = F.pad(x, (padding, padding, padding, padding))  # (B, C, H + 2p, W + 2p)
    off = torch.randint(0, 2 * padding + 1, (2, B), device=x.device, generator=generator)
    rows = off[0, :, None] + torch.arange(H, device=x.device)  # (B, H)
    cols = off[1, :, None] + torch.arange(W, device=x.device)  # (B, W)
    b = torch.arange(B, device=x.device)[:, None, None]  # (B, 1, 1)
    out = xp.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()  # (B, C, H, W)


def random_hflip(x: Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image left-right with probability ``p``."""
    flip = torch.rand(x.shape[0], device=x.device, generator=generator) < p  # (B,)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def normalize(x: Tensor, mean: Tensor, std: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 ``(B, C, H, W)`` -> ``(x / 255 - mean) / std`` in ``dtype``."""
    return ((x.to(dtype) / 255.0) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def token_dropout(mask: Tensor, p: float, generator: torch.Generator | None = None) -> Tensor:
    """Word dropout on an attention mask ``(B, T)`` (True = real token): each real token after
    position 0 (``[CLS]``) is masked out with probability ``p``; a row keeps at least its first
    real token after ``[CLS]`` so that mean pooling always has something to average."""
    if p <= 0:
        return mask
    drop = torch.rand(mask.shape, device=mask.device, generator=generator) < p  # (B, T)
    drop[:, :2] = False  # [CLS] and the first token stay
    return mask & ~drop


def smooth(targets: Tensor, smoothing: float) -> Tensor:
    """Label smoothing of soft targets ``(B, K)``: ``(1 - s) * p + s/K`` (a one-hot row gives
    what :func:`smooth_one_hot` gives)."""
    return targets * (1.0 - smoothing) + smoothing / targets.shape[-1]


def smooth_one_hot(y: Tensor, num_classes: int, smoothing: float = 0.0) -> Tensor:
    """Hard labels ``(B,)`` -> soft targets ``(B, K)``: ``1 - s + s/K`` on the label, ``s/K``
    elsewhere."""
    off = smoothing / num_classes
    out = torch.full((y.shape[0], num_classes), off, device=y.device)
    return out.scatter_(1, y.long()[:, None], 1.0 - smoothing + off)


def rand_bbox(h: int, w: int, lam: float, rng: Any = random) -> tuple[int, int, int, int]:
    """Box of area ``(1 - lam) * h * w`` at a uniform centre, clipped to the image:
    ``(y0, y1, x0, x1)``."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = rng.randrange(h), rng.randrange(w)
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    return y0, y1, x0, x1


class CutMix:
    """CutMix (Yun et al. 2019), optionally falling back to Mixup (Zhang et al. 2018).

    With probability ``prob`` a batch gets CutMix: a box from the batch reversed (image ``i``
    pairs with ``B - 1 - i``) is pasted in, and the label weight is the pasted area *after*
    clipping the box to the image. Otherwise, if ``mixup_alpha > 0``, the batch is blended with
    its reverse (Mixup); else it is returned as is. Targets are label-smoothed soft labels.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        prob: float = 1.0,
        num_classes: int = 10,
        label_smoothing: float = 0.0,
        mixup_alpha: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.alpha, self.prob, self.num_classes = alpha, prob, num_classes
        self.label_smoothing, self.mixup_alpha = label_smoothing, mixup_alpha
        self.rng: Any = rng if rng is not None else random  # default: the module-level RNG
        self.last_lam = 1.0  # label weight of the original image in the last call

    def __call__(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, C, H, W)`` (any dtype), ``y`` ``(B,)`` -> mixed ``x``, soft ``(B, K)``."""
        y_soft = smooth_one_hot(y, self.num_classes, self.label_smoothing)
        lam = 1.0
        if self.prob > 0 and self.rng.random() < self.prob:
            lam = self.rng.betavariate(self.alpha, self.alpha)
            H, W = x.shape[-2:]
            y0, y1, x0, x1 = rand_bbox(H, W, lam, self.rng)
            if y1 > y0 and x1 > x0:
                x = x.clone()
                x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / (H * W)  # the area actually pasted
        elif self.mixup_alpha > 0:
            lam = self.rng.betavariate(self.mixup_alpha, self.mixup_alpha)
            x = x * lam + x.flip(0) * (1.0 - lam)
        self.last_lam = lam
        if lam < 1.0:
            y_soft = y_soft * lam + y_soft.flip(0) * (1.0 - lam)
        return x, y_soft


def rand_augment(x: Tensor, num_ops: int, magnitude: int, chunk: int = 16) -> Tensor:
    """torchvision's RandAugment on uint8 ``(B, C, H, W)``, one op draw per ``chunk`` images
    (v2 transforms share their random op across a batch; chunks keep it cheap yet varied)."""
    if num_ops <= 0:
        return x
    from torchvision.transforms import v2

    ra = v2.RandAugment(num_ops=num_ops, magnitude=magnitude)
    return torch.cat([ra(c) for c in x.split(chunk)])


class ImageAugment:
    """uint8 batch -> augmented, normalised float batch: crop, flip, RandAugment, normalise."""

    def __init__(
        self,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        crop_padding: int = 0,
        hflip: bool = False,
        randaugment_ops: int = 0,
        randaugment_magnitude: int = 9,
        device: torch.device | str = "cpu",
    ) -> None:
        self.mean = torch.tensor(mean, device=device)
        self.std = torch.tensor(std, device=device)
        self.crop_padding, self.hflip = crop_padding, hflip
        self.ra_ops, self.ra_mag = randaugment_ops, randaugment_magnitude

    def __call__(self, x: Tensor, train: bool = True) -> Tensor:
        if train:
            x = random_crop(x, self.crop_padding)
            if self.hflip:
                x = random_hflip(x)
            x = rand_augment(x, self.ra_ops, self.ra_mag)
        return normalize(x, self.mean, self.std)
