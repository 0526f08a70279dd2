"""Data-aware and structured initialisations for training from scratch.

* :func:`whiten_patch_embed_` - the first convolution's filters become the PCA-whitening
  directions of training patches (airbench's largest single gain for small CNNs): its output
  channels are decorrelated with unit variance on the training data from step 0.
* :func:`mimetic_init_` - attention weights set so that ``W_q W_k^T ~ a1 Z + b1 I`` (each token
  attends to itself and similar tokens) and ``W_v W_o ~ a2 Z - b2 I``, with ``Z`` Gaussian
  (Trockman & Kolter 2023, "Mimetic initialization of self-attention layers").

Both act in place on a ViT built by :mod:`vit_service.models.vit` and return what they did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit_service.models.layers import Attention

log = logging.getLogger(__name__)


def first_conv(model: nn.Module) -> nn.Conv2d:
    """The convolution that sees pixels: the patch projection, or the conv stem's first conv."""
    embed = model.patch_embed
    stem = getattr(embed, "stem", None)
    conv = stem[0] if stem is not None else embed.proj
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"expected a Conv2d, got {type(conv).__name__}")
    return conv


def extract_patches(images: Tensor, kernel: int, stride: int, padding: int = 0) -> Tensor:
    """``(B, C, H, W)`` -> ``(B * P, C * k * k)``: every window a convolution would see."""
    cols = F.unfold(images, kernel, padding=padding, stride=stride)  # (B, C*k*k, P)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])  # (B*P, C*k*k)


@dataclass
class Whitening:
    directions: int  # eigen-directions written into filters
    signed: bool  # each direction also written negated (before a ReLU)
    eigenvalues: Tensor  # of the patch covariance, largest first


@torch.no_grad()
def whiten_patch_embed_(model: nn.Module, images: Tensor, eps: float = 1e-2,
                        max_patches: int = 200_000) -> Whitening:
    """Set the first conv's filters to ``v_i / sqrt(lambda_i + eps)`` for the top eigenvectors
    ``v_i`` of the covariance of (normalised) training patches, and its bias to centre them.

    A plain patch embedding (a linear map) gets ``min(C*k*k, D)`` directions. A conv stem's first
    conv is followed by BN + ReLU, so each direction is written twice, ``+v`` and ``-v``
    (airbench), to let both signs through the ReLU. Remaining filters keep their initialisation.
    ``images``: ``(N, C, H, W)`` float, normalised as in training.
    """
    conv = first_conv(model)
    k, s = conv.kernel_size[0], conv.stride[0]
    pad = conv.padding[0] if isinstance(conv.padding, tuple) else 0
    x = extract_patches(images.float(), k, s, pad)  # (M, C*k*k)
    if x.shape[0] > max_patches:
        g = torch.Generator().manual_seed(0)
        x = x[torch.randperm(x.shape[0], generator=g)[:max_patches]]
    mean = x.mean(0)
    xc = x - mean
    cov = xc.T @ xc / (x.shape[0] - 1)  # (d, d)
    evals, evecs = torch.linalg.eigh(cov.double())  # ascending
    evals, evecs = evals.flip(0).float(), evecs.flip(1).float()  # largest first
    signed = conv is not getattr(model.patch_embed, "proj", None)
    out = conv.out_channels
    n = min(x.shape[1], out // 2 if signed else out)
    filters = (evecs[:, :n] / (evals[:n] + eps).sqrt()).T  # (n, d)
    w = conv.weight  # (out, C, k, k)
    w[:n] = filters.view(n, *w.shape[1:])
    if signed:
        w[n : 2 * n] = -filters.view(n, *w.shape[1:])
    if conv.bias is not None:
        rows = 2 * n if signed else n
        conv.bias[:rows] = -(w[:rows].flatten(1) @ mean)  # zero-mean outputs
    log.info("whitened %d of %d filters of %s from %d patches", 2 * n if signed else n, out,
             "the conv stem" if signed else "the patch embedding", x.shape[0])
    return Whitening(n, signed, evals)


def _factor(m: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``A (D, r)``, ``B (D, r)`` with ``A @ B.T`` the best rank-``r`` approximation of ``m``."""
    u, sv, vh = torch.linalg.svd(m)
    root = sv[:rank].sqrt()
    return u[:, :rank] * root, vh[:rank].T * root


@torch.no_grad()
def mimetic_init_(model: nn.Module, alpha1: float = 0.7, beta1: float = 0.7,
                  alpha2: float = 0.4, beta2: float = 0.4,
                  generator: torch.Generator | None = None) -> int:
    """Mimetic initialisation of every :class:`Attention` in ``model``; returns how many.

    With ``x`` a row of tokens and torch's ``Linear`` convention (``y = x W^T``):

    * per head ``h``, ``Wq_h^T Wk_h`` is the best rank-``head_dim`` approximation of
      ``alpha1 Z + beta1 I`` (``Z`` i.i.d. ``N(0, 1/D)``, a fresh one per head), so the
      pre-softmax scores ``x Wq_h^T Wk_h x'^T`` favour similar tokens;
    * ``Wv^T Wproj^T = alpha2 Z' - beta2 I`` exactly (the value and output projections
      together start near a negative identity, as in trained ViTs).
    Biases of q, k, v and proj are zeroed."""
    count = 0
    for attn in model.modules():
        if not isinstance(attn, Attention):
            continue
        D, H, dh = attn.qkv.in_features, attn.num_heads, attn.head_dim
        w = attn.qkv.weight  # (3D, D): rows q | k | v, head h at rows h*dh:(h+1)*dh
        eye = torch.eye(D)
        for h in range(H):
            z = torch.randn(D, D, generator=generator) / D**0.5
            a, b = _factor(alpha1 * z + beta1 * eye, dh)  # (D, dh) each
            w[h * dh : (h + 1) * dh] = a.T  # Wq_h (dh, D)
            w[D + h * dh : D + (h + 1) * dh] = b.T  # Wk_h (dh, D)
        z = torch.randn(D, D, generator=generator) / D**0.5
        a, b = _factor(alpha2 * z - beta2 * eye, D)  # a @ b.T = Wv^T Wproj^T
        w[2 * D :] = a.T  # Wv (D, D)
        attn.proj.weight.copy_(b)  # Wproj (D, D): Wproj^T = b.T
        if attn.qkv.bias is not None:
            attn.qkv.bias.zero_()
        attn.proj.bias.zero_()
        count += 1
    return count
