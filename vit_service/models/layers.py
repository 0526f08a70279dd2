"""Transformer building blocks shared by the ViT and the text encoder.

One attention module with two paths (timm style):

* fused: ``F.scaled_dot_product_attention`` — fast, used for training;
* explicit: ``softmax(q k^T / sqrt(d) + mask) v`` — also returns the weights ``(B, H, T, T)``,
  used whenever attention maps are asked for.

Both paths apply the same masks to the scores before the softmax, so they agree (tested).
Parameter names follow timm's ``VisionTransformer`` (``qkv``, ``proj``, ``norm1``, ``mlp.fc1``...)
so timm checkpoints load with ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LN_EPS = 1e-6  # timm's ViT LayerNorm epsilon; must match for identical logits


def build_attn_bias(
    key_padding_mask: Tensor | None,
    causal: bool,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor | None:
    """Additive bias broadcastable to ``(B, H, Tq, Tk)``; ``-inf`` where attention is forbidden.

    ``key_padding_mask`` is ``(B, Tk)`` bool, **True for real tokens** (False = padding).
    """
    bias: Tensor | None = None
    if key_padding_mask is not None:
        bias = torch.zeros(key_padding_mask.shape, dtype=dtype, device=device)
        bias = bias.masked_fill(~key_padding_mask, float("-inf"))[:, None, None, :]  # (B,1,1,Tk)
    if causal:
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(1)
        c = torch.zeros(q_len, k_len, dtype=dtype, device=device).masked_fill(future, float("-inf"))
        bias = c[None, None] if bias is None else bias + c[None, None]  # (B|1,1,Tq,Tk)
    return bias


def _safe_bias(bias: Tensor) -> tuple[Tensor, Tensor]:
    """Neutralise query rows whose keys are all masked; return ``(bias, dead_rows)``.

    Such a row would give ``softmax([-inf, ...]) = NaN``. Its bias is set to zeros (finite), and
    the caller zeroes its weights and output using ``dead_rows``: it attends to nothing.
    """
    dead = torch.isinf(bias).all(dim=-1, keepdim=True)  # (B|1,1|H,Tq|1,1)
    return bias.masked_fill(dead, 0.0), dead


class Attention(nn.Module):
    """Multi-head scaled dot-product self-attention with a fused and an explicit path."""

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        # True: F.scaled_dot_product_attention; False: explicit path (returns weights).
        self.fused_attn = True
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """``x``: ``(B, T, C)``. Returns ``(out (B, T, C), weights (B, H, T, T) | None)``.

        ``need_weights=True`` (or ``fused_attn=False``) takes the explicit path; the weights
        returned are the very tensor the output is computed from (relevance differentiates the
        logits with respect to them)."""
        B, T, C = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, D)
        bias = build_attn_bias(key_padding_mask, causal, T, T, q.dtype, q.device)
        dead = None
        if bias is not None:
            bias, dead = _safe_bias(bias)

        weights: Tensor | None = None
        if self.fused_attn and not need_weights:
            out = self._fused(q, k, v, bias)  # (B, H, T, D)
        else:
            out, weights = self._explicit(q, k, v, bias, dead)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)  # fully-masked queries attend to nothing
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.proj_drop(self.proj(out)), weights

    def _fused(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.attn_drop.p if self.training else 0.0
        )  # (B, H, T, D)

    def _explicit(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                  dead: Tensor | None) -> tuple[Tensor, Tensor]:
        scores = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, T, T)
        if bias is not None:
            scores += bias  # in place: one (B, H, T, T) buffer fewer (matmul's backward
            # needs q and k, not its output)
        weights = scores.softmax(dim=-1)  # (B, H, T, T)
        if dead is not None:  # in place unless autograd needs softmax's output (training)
            weights = (weights.masked_fill(dead, 0.0) if torch.is_grad_enabled()
                       else weights.masked_fill_(dead, 0.0))
        return self.attn_drop(weights) @ v, weights  # (B, H, T, D), (B, H, T, T)


def stack_layers(attns: list[Tensor]) -> Tensor:
    """Per-layer weights ``L x (B, H, T, T)`` -> ``(L, B, H, T, T)``; one layer is a view."""
    return attns[0].unsqueeze(0) if len(attns) == 1 else torch.stack(attns)


class Mlp(nn.Module):
    """Linear -> GELU -> Dropout -> Linear -> Dropout."""

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample with probability ``p``."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)  # (B, 1, 1)
        return x * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
        drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, num_heads, qkv_bias, attn_drop=attn_drop, proj_drop=drop)
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path2 = DropPath(drop_path)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        a, w = self.attn(self.norm1(x), key_padding_mask, causal, need_weights)
        x = x + self.drop_path1(a)
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x, w


def set_fused_attn(model: nn.Module, enabled: bool) -> None:
    """Switch every :class:`Attention` in ``model`` between the fused and explicit path."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = enabled


@contextmanager
def attention_path(model: nn.Module, fused: bool) -> Iterator[None]:
    """Every :class:`Attention` in ``model`` on one path for a block; each gets its own setting
    back afterwards."""
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    before = [m.fused_attn for m in attns]
    for m in attns:
        m.fused_attn = fused
    try:
        yield
    finally:
        for m, f in zip(attns, before, strict=True):
            m.fused_attn = f
