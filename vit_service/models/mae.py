"""Masked autoencoder (He et al. 2022) for self-supervised ViT pretraining.

The encoder *is* a :class:`~vit_service.models.vit.ViT` (same module names, so after pretraining
``mae.encoder.state_dict()`` loads straight into a classifier); it sees only the visible patches.
A light decoder reconstructs the pixels of the masked patches; the loss counts masked patches only,
on per-patch normalised pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vit_service.models.layers import LN_EPS, Block
from vit_service.models.pos_encoding import sinusoidal_table_2d
from vit_service.models.vit import ViT, ViTConfig


@dataclass
class MAEConfig:
    encoder: ViTConfig = field(default_factory=ViTConfig)  # the ViT being pretrained
    mask_ratio: float = 0.75  # fraction of patches hidden from the encoder
    decoder_dim: int = 128  # decoder width; light, it is thrown away after pretraining
    decoder_depth: int = 2  # decoder blocks
    decoder_heads: int = 4  # decoder attention heads
    norm_pix_loss: bool = True  # normalise each target patch by its own mean/std (MAE paper)


def random_masking(
    num_patches: int, batch: int, mask_ratio: float, device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample random masking with exactly ``round(N * (1 - ratio))`` visible patches.

    Returns ``(ids_keep (B, K), mask (B, N) with 1 = masked, ids_restore (B, N))``.
    """
    keep = int(round(num_patches * (1 - mask_ratio)))
    if not 0 < keep <= num_patches:
        raise ValueError(f"mask_ratio {mask_ratio} leaves {keep} of {num_patches} patches")
    noise = torch.rand(batch, num_patches, device=device, generator=generator)  # (B, N)
    ids_shuffle = noise.argsort(dim=1)
    ids_restore = ids_shuffle.argsort(dim=1)
    ids_keep = ids_shuffle[:, :keep]  # (B, K)
    mask = torch.ones(batch, num_patches, device=device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # (B, N), back in patch order
    return ids_keep, mask, ids_restore


def patchify(imgs: Tensor, p: int) -> Tensor:
    """``(B, C, H, W)`` -> ``(B, N, p*p*C)`` in the patch conv's row-major order."""
    B, C, H, W = imgs.shape
    x = imgs.reshape(B, C, H // p, p, W // p, p)  # (B, C, Gh, p, Gw, p)
    x = x.permute(0, 2, 4, 3, 5, 1)  # (B, Gh, Gw, p, p, C)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(x: Tensor, p: int, grid: tuple[int, int], chans: int = 3) -> Tensor:
    """Inverse of :func:`patchify`."""
    B = x.shape[0]
    gh, gw = grid
    x = x.reshape(B, gh, gw, p, p, chans).permute(0, 5, 1, 3, 2, 4)  # (B, C, Gh, p, Gw, p)
    return x.reshape(B, chans, gh * p, gw * p)


class MAE(nn.Module):
    def __init__(self, config: MAEConfig) -> None:
        super().__init__()
        self.config = c = config
        self.encoder = ViT(c.encoder)
        e = c.encoder
        self.decoder_embed = nn.Linear(e.embed_dim, c.decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.decoder_dim))
        nn.init.normal_(self.mask_token, std=0.02)
        table = torch.cat([torch.zeros(1, c.decoder_dim),
                           sinusoidal_table_2d(*e.grid_size, c.decoder_dim)])
        self.register_buffer("decoder_pos_embed", table[None], persistent=False)  # (1, 1+N, Dd)
        self.decoder_blocks = nn.ModuleList(
            Block(c.decoder_dim, c.decoder_heads) for _ in range(c.decoder_depth)
        )
        self.decoder_norm = nn.LayerNorm(c.decoder_dim, eps=LN_EPS)
        self.decoder_pred = nn.Linear(c.decoder_dim, e.patch_size**2 * e.in_chans)

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"mask_token"}

    def forward_encoder(self, imgs: Tensor, ids_keep: Tensor) -> Tensor:
        enc = self.encoder
        x = enc.patch_embed(imgs) + enc.pos_embed[:, 1:]  # (B, N, D)
        D = x.shape[-1]
        x = torch.gather(x, 1, ids_keep[..., None].expand(-1, -1, D))  # (B, K, D) visible only
        cls = (enc.cls_token + enc.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)  # (B, 1 + K, D)
        for blk in enc.blocks:
            x, _ = blk(x)
        return enc.norm(x)

    def forward_decoder(self, x: Tensor, ids_restore: Tensor) -> Tensor:
        x = self.decoder_embed(x)  # (B, 1 + K, Dd)
        B, N = ids_restore.shape
        masks = self.mask_token.expand(B, N + 1 - x.shape[1], -1)  # (B, N - K, Dd)
        patches = torch.cat([x[:, 1:], masks], dim=1)  # (B, N, Dd) in shuffled order
        idx = ids_restore[..., None].expand(-1, -1, patches.shape[-1])
        patches = torch.gather(patches, 1, idx)  # (B, N, Dd) back in patch order
        x = torch.cat([x[:, :1], patches], dim=1) + self.decoder_pos_embed  # (B, 1 + N, Dd)
        for blk in self.decoder_blocks:
            x, _ = blk(x)
        return self.decoder_pred(self.decoder_norm(x))[:, 1:]  # (B, N, p*p*C)

    def loss(self, imgs: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
        """Mean squared error on masked patches only (``mask`` 1 = masked)."""
        target = patchify(imgs, self.config.encoder.patch_size)  # (B, N, p*p*C)
        if self.config.norm_pix_loss:
            mean = target.mean(-1, keepdim=True)
            var = target.var(-1, keepdim=True)
            target = (target - mean) / (var + 1e-6).sqrt()
        per_patch = (pred - target).pow(2).mean(-1)  # (B, N)
        return (per_patch * mask).sum() / mask.sum()

    def forward(
        self, imgs: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(loss, pred (B, N, p*p*C), mask (B, N))``."""
        e = self.config.encoder
        ids_keep, mask, ids_restore = random_masking(
            e.num_patches, imgs.shape[0], self.config.mask_ratio, imgs.device, generator
        )
        latent = self.forward_encoder(imgs, ids_keep)
        pred = self.forward_decoder(latent, ids_restore)
        return self.loss(imgs, pred, mask), pred, mask

    def reconstruct(self, imgs: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
        """Images with masked patches replaced by the (de-normalised) prediction."""
        p = self.config.encoder.patch_size
        target = patchify(imgs, p)
        if self.config.norm_pix_loss:
            mean = target.mean(-1, keepdim=True)
            std = (target.var(-1, keepdim=True) + 1e-6).sqrt()
            pred = pred * std + mean
        m = mask[..., None]
        return unpatchify(target * (1 - m) + pred * m, p, self.config.encoder.grid_size)
