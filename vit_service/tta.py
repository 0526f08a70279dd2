"""Flip test-time augmentation, applied around a model by evaluation and serving.

A model whose config says ``tta_flip`` (an image model trained with flips) answers with the mean
of the logits of the image and of its mirror image; the model itself always returns the logits
of what it is given. Attention weights (and relevance) are those of the image as given: the
mirror view is a second pass on the model's own attention path, whose weights nobody reads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def flips(model: nn.Module) -> bool:
    """Whether ``model``'s answers average the image and its mirror: ``tta_flip`` in eval mode
    (training sees one view)."""
    return bool(getattr(getattr(model, "config", None), "tta_flip", False)) and not model.training


def mean_of_views(given: Tensor, mirror: Tensor) -> Tensor:
    """``(B, K)`` logits of the two views -> their mean ``(B, K)``."""
    return torch.stack([given, mirror]).mean(0)


def predict(model: nn.Module, *inputs: Tensor) -> Tensor:
    """The logits ``(B, K)`` a model answers with: flip TTA when it :func:`flips` (both views
    in one batch of ``2B``), else its own forward."""
    if not flips(model):
        return model(*inputs)
    x = inputs[0]  # (B, C, H, W)
    logits = model(torch.cat([x, x.flip(-1)]))  # (2B, K)
    return logits.view(2, x.shape[0], -1).mean(0)  # (B, K)


def predict_with_attention(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Logits ``(B, K)`` as :func:`predict` and attention ``(L, B, H, T, T)`` of the inputs as
    given (``model.forward_with_attention``)."""
    logits, attn = model.forward_with_attention(*inputs)
    if flips(model):
        logits = mean_of_views(logits, model(inputs[0].flip(-1)))
    return logits, attn


class Predict(nn.Module):
    """:func:`predict` as a module (what ``serving.compiled`` traces)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> Tensor:
        return predict(self.model, *inputs)


class PredictWithAttention(nn.Module):
    """:func:`predict_with_attention` as a module (what ``serving.compiled`` traces)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        return predict_with_attention(self.model, *inputs)
