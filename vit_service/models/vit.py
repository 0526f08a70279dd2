"""Vision Transformer with a patch-conv embedding (Dosovitskiy et al. 2021).

Patches are cut by a ``Conv2d`` whose kernel = stride = patch size (32x32 image, patch 4 ->
8x8 = 64 patches). The module tree mirrors timm's ``VisionTransformer`` (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.N.*``, ``norm``, ``head``), so a timm state dict of the same
configuration loads with ``load_state_dict`` and gives the same logits (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vit_service.models.layers import LN_EPS, Block
from vit_service.models.pos_encoding import PosEncoding, register_pos_embed, sinusoidal_table_2d


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


class PatchEmbed(nn.Module):
    """``(B, C, H, W)`` -> ``(B, N, D)`` with one strided convolution (kernel = stride = patch)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)  # (B, D, Gh, Gw)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), row-major patch order


class ViT(nn.Module):
    """ViT classifier: patch embed -> [CLS] + patches + pos -> blocks -> norm -> head(CLS)."""

    num_prefix_tokens = 1  # the CLS token

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = PatchEmbed(c.patch_size, c.in_chans, c.embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim))
        table = None
        if c.pos_encoding == "sinusoidal":
            grid = sinusoidal_table_2d(*c.grid_size, c.embed_dim)  # (N, D)
            table = torch.cat([torch.zeros(1, c.embed_dim), grid])  # CLS gets a zero position
        register_pos_embed(self, c.pos_encoding, c.num_patches + 1, c.embed_dim, table)
        self.pos_drop = nn.Dropout(c.drop_rate)
        dpr = torch.linspace(0, c.drop_path_rate, c.depth).tolist()  # stochastic depth schedule
        self.blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.drop_rate,
                  c.attn_drop_rate, dpr[i])
            for i in range(c.depth)
        )
        self.norm = nn.LayerNorm(c.embed_dim, eps=LN_EPS)
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

    def embed(self, x: Tensor) -> Tensor:
        """Images ``(B, C, H, W)`` -> tokens with CLS and positions, ``(B, 1 + N, D)``."""
        x = self.patch_embed(x)  # (B, N, D)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, 1 + N, D)
        return self.pos_drop(x)

    def forward_features(
        self, x: Tensor, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Returns normalised tokens ``(B, 1 + N, D)`` and, if asked, per-layer attention
        weights, each ``(B, H, 1 + N, 1 + N)``, from this same forward pass."""
        x = self.embed(x)
        attns: list[Tensor] = []
        for blk in self.blocks:
            x, w = blk(x, need_weights=need_weights)
            if w is not None:
                attns.append(w)
        return self.norm(x), (attns if need_weights else None)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(x[:, 0])  # CLS token, (B, D)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x)[0])

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Logits ``(B, K)`` and attention ``(L, B, H, T, T)`` from one forward pass."""
        feats, attns = self.forward_features(x, need_weights=True)
        return self.forward_head(feats), torch.stack(attns)  # (L, B, H, T, T)
