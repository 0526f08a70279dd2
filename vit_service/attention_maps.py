"""Attention maps from the weights a model returns with ``forward_with_attention``.

Input everywhere: ``attn`` of shape ``(L, B, H, T, T)`` (layers, batch, heads, query, key), the
rows of each ``(T, T)`` matrix being softmax distributions over keys; token 0 is ``[CLS]`` and the
other ``N = T - 1`` tokens are image patches (row-major over the grid) or text tokens.

Three views, all of the ``[CLS]`` query's row (or, for a model that pools the mean of its
tokens, ``query="mean"``: the mean of the token rows, padding excluded):

* :func:`attention_rollout` (Abnar & Zuidema, 2020, "Quantifying Attention Flow in
  Transformers"): per layer, fuse the heads (``mean`` by default, ``max`` or ``min``), add the
  identity for the residual connection, renormalise every row to sum 1 (so
  ``A_l = (W_l + I) / rowsum``; with ``mean`` fusion that is exactly ``0.5 W_l + 0.5 I``), then
  multiply across layers, last layer on the left: ``R = A_L @ ... @ A_1``. Every row of ``R``
  sums to 1.
* :func:`layer_maps`: per layer, the ``[CLS]`` row of the head-averaged weights (no rollout).
* :func:`head_maps`: per layer and head, the ``[CLS]`` row of that head's weights.

**Normalisation (the same for all three).** The returned map is the ``[CLS]`` row *without* the
``[CLS]`` column (and without padded positions, which are set to exactly 0), renormalised so
that it sums to 1 over the ``N`` patches / real tokens. The share the ``[CLS]`` token keeps for
itself is therefore dropped, which makes maps of different layers and models comparable. The
only exception is a row whose mass is entirely on ``[CLS]`` (nothing to renormalise): it is
returned as all zeros.

Images: pass ``grid=(gh, gw)`` (e.g. ``(8, 8)``) to get maps shaped as the patch grid. Text: pass
``attention_mask`` ``(B, T)`` (True = real token) so padding is excluded; one weight per token
position ``1..T-1`` is returned.

:func:`overlay_heatmap` renders a map over the input image as PNG bytes. Nothing here imports
the web layer.
"""

from __future__ import annotations

import functools
import logging
import struct
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch import Tensor

log = logging.getLogger(__name__)

HeadFusion = Literal["mean", "max", "min"]
Query = Literal["cls", "mean"]  # whose row is read: [CLS]'s, or the mean of the token rows
# (a model that pools the mean of its tokens, ``pool="mean"``, decides from all of them)
HEAD_FUSIONS: tuple[str, ...] = ("mean", "max", "min")


def _as_5d(attn: Tensor) -> Tensor:
    """Accept ``(L, B, H, T, T)`` or a single item ``(L, H, T, T)``; return 5-D float."""
    if attn.ndim == 4:
        attn = attn.unsqueeze(1)
    if attn.ndim != 5 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"expected attention of shape (L, B, H, T, T), got {tuple(attn.shape)}")
    return attn.detach().float()


def fuse_heads(attn: Tensor, fusion: HeadFusion = "mean") -> Tensor:
    """``(..., H, T, T)`` -> ``(..., T, T)``: mean, max or min over the heads dimension."""
    if fusion == "mean":
        return attn.mean(dim=-3)
    if fusion == "max":
        return attn.amax(dim=-3)
    if fusion == "min":
        return attn.amin(dim=-3)
    raise ValueError(f"unknown head fusion {fusion!r}; choose from {HEAD_FUSIONS}")


def rollout_matrix(
    attn: Tensor, head_fusion: HeadFusion = "mean", residual: bool = True
) -> Tensor:
    """Joint attention ``R = A_L @ ... @ A_1`` of shape ``(B, T, T)``; each row sums to 1.

    ``A_l`` = heads fused, plus the identity if ``residual``, rows renormalised to sum 1.
    """
    a = fuse_heads(_as_5d(attn), head_fusion)  # (L, B, T, T)
    T = a.shape[-1]
    eye = torch.eye(T, dtype=a.dtype, device=a.device)
    joint = eye.expand(a.shape[1], T, T)
    for layer in a:  # first layer first; later layers multiply from the left
        if residual:
            layer = layer + eye
        layer = layer / layer.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        joint = layer @ joint  # (B, T, T)
    return joint


def query_row(m: Tensor, query: Query, attention_mask: Tensor | None,
              num_prefix_tokens: int) -> Tensor:
    """``(B, *extra, T, T)`` -> ``(B, *extra, T)``: the ``[CLS]`` row, or the mean of the rows of
    the non-prefix tokens (real tokens only when ``attention_mask`` ``(B, T)`` is given)."""
    if query == "cls":
        return m[..., 0, :]
    if query != "mean":
        raise ValueError(f"unknown query {query!r}; use cls or mean")
    rows = m[..., num_prefix_tokens:, :]  # (B, *extra, N, T)
    if attention_mask is None:
        return rows.mean(dim=-2)
    w = mean_query_weights(attention_mask, num_prefix_tokens, m.dtype, m.device)  # (B, N)
    w = w.view(w.shape[0], *([1] * (m.ndim - 3)), 1, w.shape[-1])  # (B, *1, 1, N)
    return (w @ rows).squeeze(-2)  # a weighted sum of rows, without a (B, *extra, N, T) temp


def mean_query_weights(attention_mask: Tensor, num_prefix_tokens: int, dtype: torch.dtype,
                       device: torch.device) -> Tensor:
    """``(B, N)``: 1 / (number of real tokens) on the real non-prefix tokens, 0 on padding."""
    w = attention_mask[:, num_prefix_tokens:].to(device=device, dtype=dtype)  # (B, N)
    return w / w.sum(-1, keepdim=True).clamp_min(1.0)


def normalise_rows(
    rows: Tensor, attention_mask: Tensor | None, num_prefix_tokens: int, extra_dims: int
) -> Tensor:
    """Zero padded positions and renormalise the last dim to sum 1 (all zeros if it sums 0).

    ``rows``: ``(B, *extra, N)``; ``attention_mask``: ``(B, T)`` over all tokens.
    """
    if attention_mask is not None:
        mask = attention_mask[:, num_prefix_tokens:].to(device=rows.device, dtype=rows.dtype)
        mask = mask.view(mask.shape[0], *([1] * extra_dims), mask.shape[-1])
        rows = rows * mask
    total = rows.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, rows / total.clamp_min(1e-30), torch.zeros_like(rows))


def to_grid(maps: Tensor, grid: tuple[int, int] | None) -> Tensor:
    """Reshape the last dim ``N`` into ``(gh, gw)`` (row-major patches); ``None``: unchanged."""
    if grid is None:
        return maps
    gh, gw = grid
    if maps.shape[-1] != gh * gw:
        raise ValueError(f"{maps.shape[-1]} tokens do not form a {gh}x{gw} grid")
    return maps.reshape(*maps.shape[:-1], gh, gw)


def attention_rollout(
    attn: Tensor,
    head_fusion: HeadFusion = "mean",
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    residual: bool = True,
    query: Query = "cls",
) -> Tensor:
    """Rollout map of the ``[CLS]`` token (or, ``query="mean"``, of the mean token row):
    ``(B, N)``, or ``(B, gh, gw)`` with ``grid``.

    Each map sums to 1 over the ``N`` non-``[CLS]`` tokens (padding excluded, set to 0).
    """
    fused = fuse_heads(_as_5d(attn), head_fusion)  # (L, B, T, T)
    return _rollout_map(fused, attention_mask, grid, num_prefix_tokens, residual, query)


def _rollout_map(fused: Tensor, attention_mask: Tensor | None, grid: tuple[int, int] | None,
                 n: int, residual: bool, query: Query) -> Tensor:
    """:func:`attention_rollout` from head-fused weights ``(L, B, T, T)``. Only one row of
    ``R`` is read, so it is carried as a row vector from the last layer down,
    ``q^T A_L ... A_1`` (L vector-matrix products instead of L matrix products; the same
    numbers as :func:`rollout_matrix`'s row, tested)."""
    L, B, T, _ = fused.shape
    v = fused.new_zeros(B, T)  # (B, T): the query's weights over the rows of R
    if query == "cls":
        v[:, 0] = 1.0
    elif query == "mean":
        v[:, n:] = (1.0 / max(T - n, 1) if attention_mask is None else
                    mean_query_weights(attention_mask, n, fused.dtype, fused.device))
    else:
        raise ValueError(f"unknown query {query!r}; use cls or mean")
    # Per layer v^T D^-1 (A + I) with D the row sums of A + I, computed as u^T A + u^T with
    # u = v / rowsum: the same numbers without materialising A + I or its normalised copy
    for layer in reversed(fused):  # last layer first: v^T A_L, then (v^T A_L) A_{L-1}, ...
        rowsum = layer.sum(dim=-1)  # (B, T)
        u = v / (rowsum + 1.0 if residual else rowsum.clamp_min(1e-12))  # (B, T)
        v = torch.bmm(u[:, None, :], layer)[:, 0]  # (B, T)
        if residual:
            v = v + u
    return to_grid(normalise_rows(v[:, n:], attention_mask, n, 0), grid)


def layer_maps(
    attn: Tensor,
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    head_fusion: HeadFusion = "mean",
    query: Query = "cls",
) -> Tensor:
    """Per layer, the ``[CLS]`` (or mean token) row of the head-fused weights: ``(B, L, N)``
    or ``(B, L, gh, gw)``; each map sums to 1 over the non-``[CLS]`` tokens."""
    fused = fuse_heads(_as_5d(attn), head_fusion)  # (L, B, T, T)
    return _layer_maps(fused, attention_mask, grid, num_prefix_tokens, query)


def _layer_maps(fused: Tensor, attention_mask: Tensor | None, grid: tuple[int, int] | None,
                n: int, query: Query) -> Tensor:
    rows = query_row(fused.transpose(0, 1), query, attention_mask, n)[..., n:]  # (B, L, N)
    return to_grid(normalise_rows(rows, attention_mask, n, 1), grid)


def head_maps(
    attn: Tensor,
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    query: Query = "cls",
) -> Tensor:
    """Per layer and head, the ``[CLS]`` (or mean token) row: ``(B, L, H, N)`` or
    ``(B, L, H, gh, gw)``; each map sums to 1 over the non-``[CLS]`` tokens."""
    a = _as_5d(attn).transpose(0, 1)  # (B, L, H, T, T)
    rows = query_row(a, query, attention_mask, num_prefix_tokens)[..., num_prefix_tokens:]
    return to_grid(normalise_rows(rows, attention_mask, num_prefix_tokens, 2), grid)


@dataclass
class AttentionMaps:
    """All views of one batch. ``rollout`` ``(B, *S)``, ``layers`` ``(B, L, *S)``, ``heads``
    ``(B, L, H, *S)`` or None, where ``S`` is ``(gh, gw)`` for images and ``(N,)`` for text."""

    rollout: Tensor
    layers: Tensor
    heads: Tensor | None = None


def compute_attention_maps(
    attn: Tensor,
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    with_heads: bool = False,
    head_fusion: HeadFusion = "mean",
    num_prefix_tokens: int = 1,
    query: Query = "cls",
) -> AttentionMaps:
    """Rollout + per-layer maps (+ per-head maps if ``with_heads``) in one call; ``query``:
    the model's pooling (``cls`` or ``mean``)."""
    n = num_prefix_tokens
    a = _as_5d(attn)
    fused = fuse_heads(a, head_fusion)  # (L, B, T, T), shared by rollout and layers
    return AttentionMaps(
        rollout=_rollout_map(fused, attention_mask, grid, n, True, query),
        layers=_layer_maps(fuse_heads(a) if head_fusion != "mean" else fused, attention_mask,
                           grid, n, query),
        heads=head_maps(a, attention_mask, grid, n, query=query) if with_heads else None,
    )


# --- overlay ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _colormap_lut(name: str) -> np.ndarray:
    """``(256, 3)`` uint8: matplotlib's colormap ``name`` sampled at 256 levels (a built-in
    blue-red ramp if matplotlib is missing); read-only, shared by every render."""
    v = np.linspace(0.0, 1.0, 256)
    try:
        from matplotlib import colormaps

        lut = (colormaps[name](v)[:, :3] * 255).round().astype(np.uint8)  # (256, 3)
    except ImportError:  # pragma: no cover - matplotlib is a declared dependency
        blue, red = np.array([0, 0, 160.0]), np.array([255, 230, 0.0])
        lut = ((1 - v[:, None]) * blue + v[:, None] * red).round().astype(np.uint8)
    lut.flags.writeable = False
    return lut


def _colormap(values: np.ndarray, name: str) -> np.ndarray:
    """``(h, w)`` floats in [0, 1] -> ``(h, w, 3)`` uint8, quantised to the 256 levels of
    ``name`` (what an 8-bit image holds anyway)."""
    idx = (np.clip(values, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)  # (h, w)
    return _colormap_lut(name)[idx]  # (h, w, 3)


def heatmap_image(
    heat: Tensor | np.ndarray, size: tuple[int, int], colormap: str = "inferno"
) -> Image.Image:
    """A 2-D map -> RGB image of ``size`` (w, h): min-max scaled to [0, 1], bilinearly
    upsampled, coloured."""
    h = np.asarray(heat.detach().cpu() if isinstance(heat, Tensor) else heat, dtype=np.float32)
    if h.ndim != 2:
        raise ValueError(f"heatmap must be 2-D, got shape {h.shape}")
    lo, hi = float(h.min()), float(h.max())
    h = (h - lo) / (hi - lo) if hi > lo else np.zeros_like(h)
    up = np.asarray(Image.fromarray(h).resize(size, Image.BILINEAR))
    return Image.fromarray(_colormap(up, colormap))


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png_bytes(rgb: np.ndarray, level: int = 1) -> bytes:
    """``(h, w, 3)`` uint8 -> an 8-bit RGB PNG. Every row uses the "Up" filter (the byte
    difference to the row above), then zlib at ``level``: on a smooth overlay about as small as
    PIL's adaptive filters at level 6, and much faster (docs/serving.md)."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected (h, w, 3) uint8, got {rgb.dtype} {rgb.shape}")
    h, w, _ = rgb.shape
    rows = rgb.reshape(h, w * 3)  # (h, 3w)
    up = rows.copy()
    up[1:] -= rows[:-1]  # uint8 wraps: the PNG "Up" filter
    raw = np.concatenate([np.full((h, 1), 2, np.uint8), up], axis=1)  # filter byte 2 per row
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit, RGB, deflate, no interlace
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", zlib.compress(raw.tobytes(), level)) + _chunk(b"IEND", b""))


def overlay_heatmap(
    image: Image.Image,
    heat: Tensor | np.ndarray,
    alpha: float = 0.5,
    colormap: str = "inferno",
    min_side: int = 224,
    max_side: int = 512,
) -> bytes:
    """PNG bytes of ``heat`` (a 2-D map such as a rollout grid) blended over ``image``.

    The image is resized so that its longer side lies in ``[min_side, max_side]`` (a 32x32
    CIFAR image becomes 224x224; a photo is shrunk to at most 512), the map is min-max scaled,
    bilinearly upsampled to that size, coloured with ``colormap`` and blended with weight
    ``alpha``. The numbers in the map itself are not changed by this rendering.
    """
    img = image.convert("RGB")
    w, h = img.size
    longest = max(w, h)
    scale = min(max(1.0, min_side / longest), max_side / longest)
    if scale != 1.0:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
    heat_img = heatmap_image(heat, img.size, colormap)
    return png_bytes(np.asarray(Image.blend(img, heat_img, alpha)))
