"""Test-time augmentation (flip, and flip + shift), applied around a model by evaluation and
serving.

A model whose config says ``tta_flip`` (an image model trained with flips) answers with the mean
of the logits of the image and of its mirror image. With ``tta_shift`` as well it also sees both
views moved one pixel down-right and one pixel up-left (reflect fill, so no preprocessing
constants are needed), and answers with half the given pair's mean plus half the shifted pairs'
mean (airbench's TTA, Jordan 2024): six views, three times the flip's cost. The model itself
always returns the logits of what it is given. Attention weights (and relevance) are those of
the image as given: the other views are further passes on the model's own path, whose weights
nobody reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _config(model: nn.Module) -> object:
    return getattr(model, "config", None)


def flips(model: nn.Module) -> bool:
    """Whether ``model``'s answers average the image and its mirror: ``tta_flip`` in eval mode
    (training sees one view)."""
    return bool(getattr(_config(model), "tta_flip", False)) and not model.training


def shifts(model: nn.Module) -> bool:
    """Whether ``model``'s answers also average one-pixel shifts: ``tta_shift`` on top of
    :func:`flips`."""
    return flips(model) and bool(getattr(_config(model), "tta_shift", False))


def other_views(model: nn.Module, x: Tensor, shift: bool = True) -> Tensor:
    """The views of ``x`` ``(B, C, H, W)`` besides itself, in :func:`pool_views`' order, as one
    batch ``((V - 1) * B, C, H, W)``: the mirror, and where the model :func:`shifts` (and
    ``shift``) the image and its mirror moved one pixel down-right, then up-left."""
    views = [x.flip(-1)]
    if shift and shifts(model):
        h, w = x.shape[-2:]
        padded = F.pad(x, (1, 1, 1, 1), mode="reflect")  # (B, C, H + 2, W + 2)
        for moved in (padded[..., :h, :w], padded[..., 2:, 2:]):  # content +1 px, then -1 px
            views += [moved, moved.flip(-1)]
    return torch.cat(views)


def pool_views(given: Tensor, others: Tensor) -> Tensor:
    """``(B, K)`` logits of the given view and ``((V - 1) * B, K)`` of :func:`other_views` ->
    the answer ``(B, K)``: the mean of a flip pair (V = 2), or half the given pair's mean plus
    half the mean of the two shifted pairs (V = 6)."""
    b = given.shape[0]
    pairs = torch.cat([given, others]).view(-1, 2, b, given.shape[-1]).mean(1)  # (V/2, B, K)
    if pairs.shape[0] == 1:
        return pairs[0]
    return (pairs[0] + pairs[1:].mean(0)) / 2  # (B, K)


def predict(model: nn.Module, *inputs: Tensor, shift: bool = True) -> Tensor:
    """The logits ``(B, K)`` a model answers with: TTA when it :func:`flips` (every view in one
    batch), else its own forward. ``shift=False`` leaves the shifted views out (training's
    intermediate validation passes, which only draw the curve)."""
    if not flips(model):
        return model(*inputs)
    x = inputs[0]  # (B, C, H, W)
    logits = model(torch.cat([x, other_views(model, x, shift)]))  # (V * B, K)
    b = x.shape[0]
    return pool_views(logits[:b], logits[b:])


def predict_with_attention(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, Tensor]:
    """Logits ``(B, K)`` as :func:`predict` and attention ``(L, B, H, T, T)`` of the inputs as
    given (``model.forward_with_attention``)."""
    logits, attn = model.forward_with_attention(*inputs)
    if flips(model):
        logits = pool_views(logits, model(other_views(model, inputs[0])))
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
