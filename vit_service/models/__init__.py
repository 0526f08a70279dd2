"""Models: the attention layers, the patch-conv ViT, the text encoder, and the preset registry."""

from vit_service.models.layers import Attention, Block, DropPath, Mlp, set_fused_attn
from vit_service.models.pos_encoding import (
    register_pos_embed,
    resample_grid_pos_embed,
    sinusoidal_table,
    sinusoidal_table_2d,
)
from vit_service.models.registry import (
    ModelConfig,
    build_model,
    build_model_from_dict,
    config_from_dict,
    config_to_dict,
    count_parameters,
    create_model,
    describe_models,
    get_config,
    list_models,
    register_preset,
)
from vit_service.models.text import TextConfig, TextTransformer
from vit_service.models.vit import ViT, ViTConfig

__all__ = [
    "Attention", "Block", "DropPath", "Mlp", "ModelConfig", "TextConfig", "TextTransformer", "ViT",
    "ViTConfig", "build_model", "build_model_from_dict", "config_from_dict", "config_to_dict",
    "count_parameters", "create_model", "describe_models", "get_config", "list_models",
    "register_pos_embed", "register_preset", "resample_grid_pos_embed", "set_fused_attn",
    "sinusoidal_table", "sinusoidal_table_2d",
]
