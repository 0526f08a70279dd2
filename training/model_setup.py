"""The model a recipe trains, built from its config and the data's dimensions (classes,
vocabulary), with the structured initialisations of a model trained from scratch."""

from __future__ import annotations

import logging

import torch
from torch import nn

from training.init import encoder_of
from training.recipes import Recipe
from training.tasks import ImageTask, Task, TextTask
from vit_service.models import ModelConfig, build_model, get_config

log = logging.getLogger(__name__)

WHITEN_IMAGES = 5000  # training images whose patches set init.whiten_patches


def encoder_config(recipe: Recipe, task: Task, num_classes: int) -> ModelConfig:
    """The recipe's model preset with its overrides and the data's dimensions."""
    m = recipe.model
    return get_config(m.name, pos_encoding=m.pos_encoding, num_classes=num_classes,
                      **task.model_fields(), **m.overrides)


def build_task_model(recipe: Recipe, task: Task) -> nn.Module:
    """The classifier, or for ``mae`` / ``mlm`` the pretraining model around a headless
    encoder (``model.encoder``)."""
    if recipe.objective == "mae":
        from vit_service.models.mae import MAE, MAEConfig

        assert recipe.mae is not None
        a, vit = recipe.mae, encoder_config(recipe, task, 0)
        return MAE(MAEConfig(encoder=vit, mask_ratio=a.mask_ratio,  # type: ignore[arg-type]
                             decoder_dim=a.decoder_dim, decoder_depth=a.decoder_depth,
                             decoder_heads=a.decoder_heads, norm_pix_loss=a.norm_pix_loss))
    if recipe.objective == "mlm":
        from vit_service.models.mlm import MLM, MLMConfig

        assert recipe.mlm is not None
        b, text = recipe.mlm, encoder_config(recipe, task, 0)
        return MLM(MLMConfig(encoder=text, mask_prob=b.mask_prob,  # type: ignore[arg-type]
                             replace_mask=b.replace_mask, replace_random=b.replace_random))
    return build_model(encoder_config(recipe, task, task.num_classes))


def structured_init(model: nn.Module, recipe: Recipe, task: Task) -> None:
    """``init.whiten_patches`` / ``init.mimetic`` on a model trained from scratch, and a
    text model's n-gram head fitted (NB-LR) before the Transformer trains."""
    from vit_service.models.initializers import mimetic_init_, whiten_patch_embed_

    spec, enc = recipe.init, encoder_of(model)
    if spec.mimetic:
        g = torch.Generator().manual_seed(recipe.seed)
        log.info("mimetic attention init: %d layers", mimetic_init_(enc, generator=g))
    if spec.whiten_patches:
        assert isinstance(task, ImageTask)  # validated: a ViT on images
        whiten_patch_embed_(enc, task.sample_train_images(WHITEN_IMAGES).cpu())
    head = getattr(model, "ngram_head", None)
    if head is not None:
        assert isinstance(task, TextTask)  # only the text model has one
        task.fit_ngram_head(head)
