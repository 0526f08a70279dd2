"""Pretrained weights from timm into our :class:`ViT`.

``vit_from_timm("vit_small_patch16_224.augreg_in21k", img_size=32, patch_size=4, num_classes=10)``
builds a ViT with the timm model's width/depth/heads at the new resolution and patch size, loads
the weights (from the hub when online, or from a local file with ``file=``), resamples the
positional embedding to the new patch grid, resamples the patch-embedding kernel (FlexiViT-style
pseudo-inverse) when the patch size changes, and starts a fresh zero-initialised head.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from vit_service.models.vit import ViT, ViTConfig

log = logging.getLogger(__name__)


def _timm_state_dict(name: str, file: str | Path | None) -> tuple[dict[str, torch.Tensor], Any]:
    import timm

    kwargs: dict[str, Any] = {"pretrained": True, "num_classes": 0}
    if file is not None:
        kwargs["pretrained_cfg_overlay"] = {"file": str(file)}
    try:
        ref = timm.create_model(name, **kwargs)
    except Exception as e:  # no network, unknown name, bad file
        where = f"file {file}" if file else "the Hugging Face hub"
        raise RuntimeError(
            f"could not load timm weights {name!r} from {where}: {e}. Offline, save the weights "
            f"once (timm.create_model(name, pretrained=True).state_dict()) and pass init.timm_file"
        ) from e
    return ref.state_dict(), ref


def vit_from_timm(
    name: str,
    *,
    img_size: int = 32,
    patch_size: int = 4,
    num_classes: int = 10,
    file: str | Path | None = None,
    pos_encoding: str = "learned",
    **overrides: Any,
) -> ViT:
    """A :class:`ViT` initialised from timm's ``name`` weights, adapted to a new input size."""
    state, ref = _timm_state_dict(name, file)
    if getattr(ref, "global_pool", "token") != "token" or getattr(ref, "cls_token", None) is None:
        raise ValueError(f"{name}: only class-token ViTs are supported")
    blk = ref.blocks[0]
    cfg = ViTConfig(
        img_size=img_size,
        patch_size=patch_size,
        num_classes=num_classes,
        embed_dim=ref.embed_dim,
        depth=len(ref.blocks),
        num_heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.fc1.out_features / ref.embed_dim,
        qkv_bias=blk.attn.qkv.bias is not None,
        pos_encoding=pos_encoding,
        **overrides,
    )
    model = ViT(cfg)
    adapted = adapt_timm_state_dict(state, cfg)
    missing, unexpected = model.load_state_dict(adapted, strict=False)
    allowed_missing = {"head.weight", "head.bias"} | (
        {"pos_embed"} if pos_encoding != "learned" else set()
    )
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"timm weights do not fit: missing {missing}, unexpected {unexpected}")
    if pos_encoding != "learned":
        log.warning("pos_encoding=%s: the pretrained learned positions are discarded", pos_encoding)
    log.info(
        "initialised %s from timm %s (grid %s, patch %d)",
        type(model).__name__,
        name,
        cfg.grid_size,
        patch_size,
    )
    return model


def adapt_timm_state_dict(
    state: dict[str, torch.Tensor], cfg: ViTConfig
) -> dict[str, torch.Tensor]:
    """Resample ``pos_embed`` and the patch kernel to ``cfg``; drop the old head."""
    from timm.layers import resample_abs_pos_embed, resample_patch_embed

    out = {k: v for k, v in state.items() if not k.startswith(("head.", "fc_norm."))}
    w = out["patch_embed.proj.weight"]  # (D, C, p, p)
    if w.shape[-1] != cfg.patch_size:
        out["patch_embed.proj.weight"] = resample_patch_embed(w, [cfg.patch_size] * 2)
    pe = out["pos_embed"]  # (1, 1 + G*G, D)
    if pe.shape[1] != cfg.num_patches + 1:
        out["pos_embed"] = resample_abs_pos_embed(pe, list(cfg.grid_size), num_prefix_tokens=1)
    if cfg.pos_encoding != "learned":
        out.pop("pos_embed")
    return out
