"""Named model presets: ``create_model(name, **overrides)`` and ``list_models()``.

A preset is a config; overrides replace its fields (``create_model("vit_tiny_patch4_32",
pos_encoding="sinusoidal")``). ``config_to_dict`` / ``build_model_from_dict`` turn a model into the
plain dict saved with checkpoints and logged to MLflow, and back.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, fields, replace
from typing import Any

from torch import nn

from vit_service.models.text import TextConfig, TextTransformer
from vit_service.models.vit import ViT, ViTConfig
from vit_service.value_types import type_problem

ModelConfig = ViTConfig | TextConfig

_ARCHS: dict[str, tuple[type, type[nn.Module]]] = {
    "vit": (ViTConfig, ViT),
    "text": (TextConfig, TextTransformer),
}

_PRESETS: dict[str, tuple[str, ModelConfig, str]] = {}


def register_preset(name: str, config: ModelConfig, description: str) -> None:
    arch = next(a for a, (cfg_cls, _) in _ARCHS.items() if isinstance(config, cfg_cls))
    _PRESETS[name] = (arch, config, description)


# CIFAR-sized ViTs (32x32 input, patch 4 -> 64 tokens + CLS), smallest to largest.
register_preset("vit_test", ViTConfig(patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                      drop_path_rate=0.0), "2-block toy ViT for tests")
register_preset("vit_nano_patch4_32", ViTConfig(embed_dim=128, depth=6, num_heads=4,
                                                mlp_ratio=2.0, drop_path_rate=0.0),
                "CPU-budget ViT, 6x128")
register_preset("vit_nano_convstem_32", ViTConfig(embed_dim=128, depth=6, num_heads=4,
                                                  mlp_ratio=2.0, drop_path_rate=0.0,
                                                  stem="conv", stem_width=32),
                "CPU-budget ViT, 6x128, conv stem (3x3 convs to the 8x8 grid)")
register_preset("vit_micro_patch4_32", ViTConfig(embed_dim=192, depth=6, num_heads=3,
                                                 drop_path_rate=0.05), "6x192")
register_preset("vit_tiny_patch4_32", ViTConfig(embed_dim=192, depth=12, num_heads=3,
                                                drop_path_rate=0.1), "ViT-Ti/4 (12x192)")
register_preset("vit_small_patch4_32", ViTConfig(embed_dim=384, depth=12, num_heads=6,
                                                 drop_path_rate=0.1), "ViT-S/4 (12x384)")
# Sentiment encoders.
register_preset("text_test", TextConfig(vocab_size=1000, max_len=64, embed_dim=32, depth=2,
                                        num_heads=2, drop_rate=0.0), "2-block toy encoder")
register_preset("text_small", TextConfig(vocab_size=16000, max_len=256, embed_dim=256, depth=4,
                                         num_heads=4), "4x256 encoder")
register_preset("text_base", TextConfig(vocab_size=32000, max_len=512, embed_dim=512, depth=6,
                                        num_heads=8), "6x512 encoder")


def list_models(arch: str | None = None) -> list[str]:
    """Preset names, optionally only those of one architecture (``vit`` or ``text``)."""
    return sorted(n for n, (a, _, _) in _PRESETS.items() if arch is None or a == arch)


def describe_models() -> list[dict[str, Any]]:
    """One row per preset: name, architecture, description, and the full config."""
    return [
        {"name": n, "arch": a, "description": d, "config": asdict(c)}
        for n, (a, c, d) in sorted(_PRESETS.items())
    ]


def get_config(name: str, **overrides: Any) -> ModelConfig:
    if name not in _PRESETS:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    _, config, _ = _PRESETS[name]
    valid = {f.name for f in fields(config)}
    unknown = set(overrides) - valid
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)} for {name}; valid: {sorted(valid)}")
    check_types(type(config), overrides)
    out = replace(config, **overrides)
    check_sizes(out)
    return out


# a size of 0 builds nothing or divides by zero, a negative one fails deep in torch
POSITIVE = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads",
            "mlp_ratio", "vocab_size", "max_len", "stem_width", "stem_depth",
            "stem_full_depth")
RATES = ("drop_rate", "attn_drop_rate", "drop_path_rate", "patch_dropout")  # in [0, 1)


def check_types(config_cls: type, values: dict[str, Any]) -> None:
    """Refuse a value not of its field's type as written (``depth: true``, ``depth: "3"``,
    ``pool: 3``): a dataclass takes anything, and the model would fail or silently take
    ``true`` as 1 (ValueError naming the field)."""
    hints = typing.get_type_hints(config_cls)
    for key, value in values.items():
        if key in hints and (problem := type_problem(value, hints[key])) is not None:
            raise ValueError(f"{key}: {problem}")


def check_sizes(config: ModelConfig) -> None:
    """Refuse a config no model can be built from: a number that is not finite, a size below
    1, a negative count, a rate outside [0, 1) (ValueError naming the field; a job override
    gets a 422 before it runs)."""
    for f in fields(config):
        v = getattr(config, f.name)
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        if isinstance(v, float) and not math.isfinite(v):  # a JSON job body's 1e999 is inf
            raise ValueError(f"{f.name} must be a finite number, got {v}")
        if f.name in POSITIVE and not v > 0:
            raise ValueError(f"{f.name} must be > 0, got {v}")
        if f.name in RATES and not 0 <= v < 1:
            raise ValueError(f"{f.name} must be in [0, 1), got {v}")
        if not v >= 0:
            raise ValueError(f"{f.name} must be >= 0, got {v}")


def build_model(config: ModelConfig) -> nn.Module:
    for cfg_cls, model_cls in _ARCHS.values():
        if isinstance(config, cfg_cls):
            return model_cls(config)
    raise TypeError(f"not a model config: {type(config).__name__}")


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build the preset ``name`` with some config fields replaced."""
    return build_model(get_config(name, **overrides))


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """Plain dict with an ``arch`` key: what checkpoints and MLflow store."""
    arch = next(a for a, (cfg_cls, _) in _ARCHS.items() if isinstance(config, cfg_cls))
    return {"arch": arch, **asdict(config)}


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    d = dict(d)
    arch = d.pop("arch")
    cfg_cls, _ = _ARCHS[arch]
    return cfg_cls(**d)


def build_model_from_dict(d: dict[str, Any]) -> nn.Module:
    return build_model(config_from_dict(d))


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
