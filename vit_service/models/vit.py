"""Vision Transformer with a patch-conv embedding (Dosovitskiy et al. 2021).

Patches are cut by a ``Conv2d`` whose kernel = stride = patch size (32x32 image, patch 4 ->
8x8 = 64 patches). The module tree mirrors timm's ``VisionTransformer`` (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.N.*``, ``norm``, ``head``), so a timm state dict of the same
configuration loads with ``load_state_dict`` and gives the same logits (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from vit_service.models.layers import LN_EPS, Block, stack_layers
from vit_service.models.pos_encoding import (
    PosEncoding,
    register_pos_embed,
    resample_grid_pos_embed,
    sinusoidal_table_2d,
)


@dataclass
class ViTConfig:
    img_size: int = 32  # input resolution; CIFAR-10 images are 32x32
    patch_size: int = 4  # conv kernel = stride; 32 / 4 -> an 8x8 grid of 64 patch tokens
    in_chans: int = 3  # RGB
    num_classes: int = 10  # CIFAR-10; 0 gives a headless encoder (features only)
    embed_dim: int = 192  # token width D; sets cost ~ D^2 per token per layer
    depth: int = 12  # number of Transformer blocks
    num_heads: int = 3  # D must divide by heads; head_dim 64 is the usual sweet spot
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * D, as in ViT/timm
    qkv_bias: bool = True  # timm default; needed to load timm checkpoints
    pos_encoding: PosEncoding = "learned"  # learned (ViT) | sinusoidal (2-D sin-cos, fixed)
    drop_rate: float = 0.0  # dropout after attention/MLP projections and before the head
    attn_drop_rate: float = 0.0  # dropout on attention weights
    drop_path_rate: float = 0.1  # stochastic depth, linearly increasing over blocks; key for
    # small-data ViTs
    pool: Literal["cls", "mean"] = "cls"  # head reads the CLS token (timm) or the mean of the
    # patch tokens (Beyer et al. 2022; CLS stays in the sequence, attention maps read the
    # mean of the patch rows)
    stem: Literal["patch", "conv"] = "patch"  # patch: one Conv2d, kernel = stride = patch;
    # conv: 3x3 convs (stride 2 until the patch grid) + BN + ReLU, then a 1x1 projection
    # (Xiao et al. 2021, "Early convolutions help transformers see better")
    stem_width: int = 32  # conv stem: channels of its first conv, doubled at each stride 2
    stem_depth: int = 1  # conv stem: 3x3 convs per resolution (a halving's first one strides 2);
    # more of a CNN's local, data-efficient features before the tokens, at their cost per image
    stem_full_depth: int | None = None  # conv stem: 3x3 convs at full resolution (None:
    # stem_depth); the full-resolution convs are the stem's widest activations, so the
    # costliest per multiply (docs/training.md, "A cheaper full-resolution stem")
    tta_flip: bool = False  # evaluation and serving average the logits of the image and its
    # mirror image (flip test-time augmentation, vit_service.tta); the model itself never does
    tta_shift: bool = False  # with tta_flip: also both views moved one pixel diagonally each
    # way, half the weight (airbench's TTA): the translations training's crops taught, at 3x
    # the flip's inference cost (docs/training.md, "Shifted views at test time")
    patch_dropout: float = 0.0  # training only: each image keeps a random (1 - p) share of its
    # patch tokens (PatchDropout, Liu et al. 2022): steps ~1/(1 - p) cheaper; eval sees all

    @property
    def grid_size(self) -> tuple[int, int]:
        g = self.img_size // self.patch_size
        return g, g

    @property
    def num_patches(self) -> int:
        return self.grid_size[0] * self.grid_size[1]

    def __post_init__(self) -> None:
        if self.img_size % self.patch_size:
            raise ValueError(f"img_size {self.img_size} not divisible by patch {self.patch_size}")
        if not 0.0 <= self.patch_dropout < 1.0:
            raise ValueError(f"patch_dropout must be in [0, 1), got {self.patch_dropout}")
        if self.tta_shift and not self.tta_flip:
            raise ValueError("tta_shift needs tta_flip: the shifted views come in flip pairs")


class PatchEmbed(nn.Module):
    """``(B, C, H, W)`` -> ``(B, N, D)`` with one strided convolution (kernel = stride = patch)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)  # (B, D, Gh, Gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), row-major patch order


class ConvStem(nn.Module):
    """``(B, C, H, W)`` -> ``(B, N, D)``: ``full_depth`` (default ``depth``) 3x3 convs at full
    resolution, then ``depth`` per factor 2 of the patch size (the first strides 2, channels
    doubling), each with BN + ReLU, then a 1x1 ``proj`` to the token width. Same patch grid as
    :class:`PatchEmbed`."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, width: int,
                 depth: int = 1, full_depth: int | None = None) -> None:
        super().__init__()
        n_down = patch_size.bit_length() - 1
        if 2**n_down != patch_size:
            raise ValueError(f"conv stem needs a power-of-two patch size, got {patch_size}")
        def conv_bn_relu(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
                    nn.ReLU(inplace=True)]

        full_depth = depth if full_depth is None else full_depth
        if min(depth, full_depth) < 1:
            raise ValueError("conv stem needs at least one conv per resolution, got "
                             f"{depth} ({full_depth} at full resolution)")
        layers, c = conv_bn_relu(in_chans, width, 1), width  # full resolution
        for _ in range(full_depth - 1):
            layers += conv_bn_relu(c, c, 1)
        for _ in range(n_down):  # (B, c, H, W) -> (B, 2c, H/2, W/2)
            layers += conv_bn_relu(c, 2 * c, 2)
            c *= 2
            for _ in range(depth - 1):
                layers += conv_bn_relu(c, c, 1)
        c_in = c
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(c_in, embed_dim, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        # channels_last: oneDNN's 3x3 convolutions (and above all their backward) run faster
        # on NHWC, and the evaluation forward loses nothing (docs/training.md). Same values,
        # another layout.
        x = x.contiguous(memory_format=torch.channels_last)
        x = self.proj(self.stem(x))  # (B, D, Gh, Gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), row-major patch order


class ViT(nn.Module):
    """ViT classifier: patch embed -> [CLS] + patches + pos -> blocks -> norm -> head(CLS)."""

    num_prefix_tokens = 1  # the CLS token

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed: nn.Module = (
            PatchEmbed(c.patch_size, c.in_chans, c.embed_dim) if c.stem == "patch"
            else ConvStem(c.patch_size, c.in_chans, c.embed_dim, c.stem_width,
                          c.stem_depth, c.stem_full_depth))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim))
        table = self._fixed_positions(c.grid_size) if c.pos_encoding == "sinusoidal" else None
        register_pos_embed(self, c.pos_encoding, c.num_patches + 1, c.embed_dim, table)
        self.pos_drop = nn.Dropout(c.drop_rate)
        dpr = torch.linspace(0, c.drop_path_rate, c.depth).tolist()  # stochastic depth schedule
        self.blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.drop_rate,
                  c.attn_drop_rate, dpr[i])
            for i in range(c.depth)
        )
        self.norm = nn.LayerNorm(c.embed_dim, eps=LN_EPS)
        self._pos_cache: dict[tuple[tuple[int, int], torch.device], Tensor] = {}
        self.head_drop = nn.Dropout(c.drop_rate)
        self.head = nn.Linear(c.embed_dim, c.num_classes) if c.num_classes else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names that should not be weight-decayed (besides norms and biases)."""
        return {"cls_token", "pos_embed"}

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head (fine-tuning on another label set)."""
        self.config.num_classes = num_classes
        self.head = nn.Linear(self.config.embed_dim, num_classes) if num_classes else nn.Identity()
        if num_classes:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def pos_embed_for(self, grid: tuple[int, int]) -> Tensor:
        """Positions ``(1, 1 + Gh*Gw, D)`` for a patch grid, which differs from the config's
        when the image is smaller (a low-resolution training phase): 2-D sin-cos evaluated at
        the coarse patches' centres in the full grid's units, a learned table resized
        bicubically (differentiable: its gradient reaches the full-size table)."""
        c = self.config
        if grid == c.grid_size:
            return self.pos_embed
        if c.pos_encoding == "learned":
            return resample_grid_pos_embed(self.pos_embed, grid, self.num_prefix_tokens)
        key = (grid, self.pos_embed.device)
        if key not in self._pos_cache:
            table = self._fixed_positions(grid, zero=c.pos_encoding == "none")  # (1 + N', D)
            self._pos_cache[key] = table[None].to(self.pos_embed)  # (1, 1 + N', D)
        return self._pos_cache[key]

    def _fixed_positions(self, grid: tuple[int, int], zero: bool = False) -> Tensor:
        """``(1 + Gh*Gw, D)``: a zero row for CLS, then 2-D sin-cos over ``grid`` placed in the
        config grid's units (identical to the plain table on the config grid), or zeros."""
        c = self.config
        if zero:
            table = torch.zeros(grid[0] * grid[1], c.embed_dim)
        else:
            stride = (c.grid_size[0] / grid[0], c.grid_size[1] / grid[1])
            table = sinusoidal_table_2d(*grid, c.embed_dim, stride=stride)  # (N, D)
        return torch.cat([torch.zeros(1, c.embed_dim), table])  # CLS gets a zero position

    def embed(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` -> tokens with CLS and positions, ``(B, 1 + N, D)``; an
        image smaller than ``img_size`` (divisible by the patch) gets a smaller grid."""
        p = self.config.patch_size
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        x = self.patch_embed(x)  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed_for(grid)  # (B, 1 + N, D)
        return self.pos_drop(x)

    def forward_features(
        self, x: Tensor, need_weights: bool = False, leaf_tokens: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Returns normalised tokens ``(B, 1 + N, D)`` and, if asked, per-layer attention
        weights, each ``(B, H, 1 + N, 1 + N)``, from this same forward pass. ``leaf_tokens``:
        the autograd graph starts at the embedded tokens (parameters are never part of it)."""
        x = self.embed(x)
        if self.training and self.config.patch_dropout > 0:
            x = self._drop_patches(x)
        if leaf_tokens:
            x = x.detach().requires_grad_()
        attns: list[Tensor] = []
        for blk in self.blocks:
            x, w = blk(x, need_weights=need_weights)
            if w is not None:
                attns.append(w)
        return self.norm(x), (attns if need_weights else None)

    def _drop_patches(self, x: Tensor) -> Tensor:
        """``(B, 1 + N, D)`` -> ``(B, 1 + K, D)``: the prefix and a random ``K = round((1 - p)
        N)`` of the patch tokens per image (positions were added already, so order is free)."""
        n = self.num_prefix_tokens
        B, T, D = x.shape
        keep = max(1, round((1 - self.config.patch_dropout) * (T - n)))
        idx = torch.rand(B, T - n, device=x.device).argsort(dim=1)[:, :keep]  # (B, K)
        patches = x[:, n:].gather(1, idx[..., None].expand(B, keep, D))  # (B, K, D)
        return torch.cat([x[:, :n], patches], dim=1)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.config.pool == "mean":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)  # patch tokens' mean, (B, D)
        else:
            x = x[:, 0]  # CLS token, (B, D)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, K)`` of the images as given, on the modules' attention path."""
        return self.forward_head(self.forward_features(x)[0])

    def attention_graph(self, x: Tensor, track: bool = True) -> tuple[Tensor, list[Tensor]]:
        """Logits ``(B, K)`` and every layer's attention weights (each ``(B, H, T, T)``) from
        one explicit-attention pass. ``track`` (under grad mode): the weights are in an autograd
        graph that starts at the tokens, which is what relevance differentiates."""
        feats, attns = self.forward_features(x, need_weights=True, leaf_tokens=track)
        assert attns is not None
        return self.forward_head(feats), attns

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, K)`` and attention ``(L, B, H, T, T)`` from one forward pass."""
        logits, attns = self.attention_graph(x, track=False)
        return logits, stack_layers(attns)  # (L, B, H, T, T)
