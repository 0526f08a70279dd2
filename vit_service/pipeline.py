"""One batch explained: predictions, attention maps, relevance and faithfulness, as tensors.

:func:`explain_batch` is what a served request runs (``serving.inference`` calls it once per
batch group and formats its :class:`ExplainResult` once). A batch takes one of three forward
paths (:class:`ForwardPath`): no maps (the fused fast path), attention maps
(``forward_with_attention``: explicit attention, weights returned from the very pass that gives
the logits), and relevance (the same pass with the weights kept in the graph and one backward
to them, :func:`vit_service.explain.explain`). Faithfulness curves, where asked for, run their
perturbed inputs in batched forwards right after. Nothing here knows about HTTP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import torch
from torch import Tensor, nn

from vit_service.attention_maps import AttentionMaps, Query, compute_attention_maps
from vit_service.execution import Execution, Precision
from vit_service.explain import (
    FaithfulnessSummary,
    explain,
    faithfulness_curves,
    image_probs_fn,
    summarise_faithfulness,
    text_probs_fn,
)
from vit_service.tta import flips, predict, predict_with_attention


class ForwardPath(Enum):
    """How a batch goes through the model (batches are grouped by it)."""

    FUSED = "fused"  # no maps: the fused fast path
    ATTENTION = "attention"  # explicit attention, the weights of the pass that gives the logits
    RELEVANCE = "relevance"  # the same, weights kept in the graph, one backward to them


@dataclass(frozen=True)
class ExplainSpec:
    """What one request asks. ``maps``: any attention at all (else the fused fast path);
    ``heads``: per-head maps; ``relevance``: the gradient pass; ``faithfulness``:
    deletion/insertion curves; ``target``: the class index to explain (None: predicted)."""

    maps: bool = True
    heads: bool = False
    relevance: bool = False
    faithfulness: bool = False
    target: int | None = None

    @property
    def path(self) -> ForwardPath:
        if self.relevance:
            return ForwardPath.RELEVANCE
        return ForwardPath.ATTENTION if self.maps else ForwardPath.FUSED

    @property
    def primary(self) -> str:
        """The single map an overlay draws: relevance when asked for, else rollout."""
        return "relevance" if self.relevance else "rollout"


@dataclass(frozen=True)
class Forwards:
    """What a batch's forward calls: ``plain(*inputs) -> logits`` and
    ``with_attention(*inputs) -> (logits, attn (L, B, H, T, T))``, both fp32 whatever
    ``execution`` they run in (``serving.compiled`` traces them); relevance and faithfulness
    run in that execution too."""

    plain: Callable[..., Tensor]
    with_attention: Callable[..., tuple[Tensor, Tensor]]
    traced: bool
    execution: Execution = Execution.serving("fp32")

    @property
    def precision(self) -> Precision:
        return self.execution.precision

    @classmethod
    def eager(cls, model: nn.Module) -> Forwards:
        """The model's own forwards, flip TTA applied (:mod:`vit_service.tta`)."""
        if not flips(model):
            return cls(model, model.forward_with_attention, False)
        return cls(functools.partial(predict, model),
                   functools.partial(predict_with_attention, model), False)


def model_grid(model: nn.Module) -> tuple[int, int] | None:
    """An image model's patch grid ``(gh, gw)``; None for a text model."""
    grid = getattr(getattr(model, "config", None), "grid_size", None)
    return (int(grid[0]), int(grid[1])) if grid is not None else None


@dataclass(frozen=True)
class ReadTokens:
    """The tokens a model's attention read, out of an input ``length`` long: their ``mask``
    ``(B, W)`` (None for images) and their ``positions`` in the input ``(B, W)`` (None: the
    input's own). Maps are computed over them (W x W weights, never the input's T x T) and
    :meth:`place`\ d back at the input's positions, 0 at the tokens not read."""

    mask: Tensor | None
    positions: Tensor | None = None
    length: int = 0
    prefix: int = 1

    def place(self, maps: Tensor) -> Tensor:
        """``(B, ..., W - prefix)`` maps over the read tokens -> ``(B, ..., length - prefix)``."""
        if self.positions is None:
            return maps
        assert self.mask is not None
        p, B = self.prefix, maps.shape[0]
        shape = (B,) + (1,) * (maps.dim() - 2) + (self.positions.shape[1] - p,)
        index = (self.positions[:, p:] - p).clamp_min(0).view(shape).expand_as(maps)
        # slots past a short input repeat its last position: their (zero) values add nothing
        values = maps * self.mask[:, p:].view(shape).to(maps.dtype)
        return maps.new_zeros(*maps.shape[:-1], self.length - p).scatter_add(-1, index, values)

    def place_maps(self, maps: AttentionMaps) -> AttentionMaps:
        return AttentionMaps(self.place(maps.rollout), self.place(maps.layers),
                             None if maps.heads is None else self.place(maps.heads))


def read_tokens(model: nn.Module, ids: Tensor, mask: Tensor, width: int | None = None
                ) -> ReadTokens:
    """What a text model's attention read of ``ids`` / ``mask`` ``(B, T)``: the whole input,
    or the crop of a model whose Transformer reads one (``width``: that of the weights at
    hand; default the eager model's)."""
    fn = getattr(model, "read_tokens", None)
    read, pos = (mask, None) if fn is None else fn(ids, mask, width)
    return ReadTokens(read, pos, ids.shape[1], getattr(model, "num_prefix_tokens", 1))


def model_query(model: nn.Module) -> Query:
    """Whose attention row the maps read: ``cls``, or ``mean`` for a mean-pooling model."""
    return "mean" if getattr(model.config, "pool", "cls") == "mean" else "cls"


# --- inputs, per modality --------------------------------------------------------------------


@dataclass(frozen=True)
class ImageInputs:
    """Normalised images ``x`` ``(B, C, S, S)``; a removed patch is filled with its image's mean
    colour."""

    x: Tensor
    removal: ClassVar[str] = "mean_colour"

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return (self.x,)

    def read(self, model: nn.Module, width: int | None = None) -> ReadTokens:
        return ReadTokens(None)

    def valid(self, model: nn.Module) -> Tensor:
        gh, gw = model_grid(model) or (1, 1)
        return torch.ones(self.x.shape[0], gh * gw, dtype=torch.bool)  # (B, N)

    def probs_fn(self, model: nn.Module, rows: list[int], target: Tensor
                 ) -> Callable[[Tensor], Tensor]:
        _, gw = model_grid(model) or (1, 1)
        return image_probs_fn(model, self.x[rows], target, self.x.shape[-1] // gw)

    def ngram_shares(self, model: nn.Module, explained: Tensor) -> Tensor | None:
        return None


@dataclass(frozen=True)
class TextInputs:
    """Token ids ``(B, T)`` and their mask ``(B, T)`` (True = real); a removed token is masked
    out of attention."""

    ids: Tensor
    mask: Tensor
    removal: ClassVar[str] = "attention_mask"

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return (self.ids, self.mask)

    def read(self, model: nn.Module, width: int | None = None) -> ReadTokens:
        return read_tokens(model, self.ids, self.mask, width)

    def valid(self, model: nn.Module) -> Tensor:
        return self.mask[:, getattr(model, "num_prefix_tokens", 1):]  # (B, N)

    def probs_fn(self, model: nn.Module, rows: list[int], target: Tensor
                 ) -> Callable[[Tensor], Tensor]:
        return text_probs_fn(model, self.ids[rows], self.mask[rows], target,
                             getattr(model, "num_prefix_tokens", 1))

    def ngram_shares(self, model: nn.Module, explained: Tensor) -> Tensor | None:
        """``(B, N)``: each token's share (after the prefix) of the served logit of the class
        ``explained`` ``(B,)`` that comes from the model's n-gram head; None without one."""
        fn = getattr(model, "ngram_contributions", None)
        shares = fn(self.ids, self.mask) if fn is not None else None  # (B, T, K)
        if shares is None:
            return None
        index = explained[:, None, None].expand(-1, shares.shape[1], 1)  # (B, T, 1)
        return shares.gather(2, index)[..., 0][:, getattr(model, "num_prefix_tokens", 1):]


Inputs = ImageInputs | TextInputs


# --- one batch -------------------------------------------------------------------------------


@dataclass
class ExplainResult:
    """One batch explained: probabilities ``(B, K)``, maps (None on the fused path), relevance
    ``(B, *S)``, the n-gram head's shares ``(B, N)`` (with maps, for a text model with the
    head), the class those two explain per row ``(B,)`` (None without either), and
    faithfulness by row for the rows that asked for it."""

    probs: Tensor
    maps: AttentionMaps | None
    relevance: Tensor | None
    target: Tensor | None
    ngram: Tensor | None = None
    faithfulness: dict[int, FaithfulnessSummary] = field(default_factory=dict)


def _no_lap(stage: str) -> None:
    pass


def _row_specs(spec: ExplainSpec | Sequence[ExplainSpec], n: int) -> list[ExplainSpec]:
    specs = [spec] * n if isinstance(spec, ExplainSpec) else list(spec)
    if len(specs) != n:
        raise ValueError(f"{len(specs)} specs for a batch of {n}")
    if len({s.path for s in specs}) > 1:
        raise ValueError("one batch takes one forward path: group the rows by spec.path")
    return specs


def explain_batch(
    model: nn.Module,
    inputs: Inputs,
    spec: ExplainSpec | Sequence[ExplainSpec],
    forwards: Forwards | None = None,
    lap: Callable[[str], None] = _no_lap,
) -> ExplainResult:
    """Run ``inputs`` through ``model`` on ``spec``'s path (one spec for the batch or one per
    row, all on the same path) and compute what the rows ask for. ``forwards``: the (traced)
    forwards to call and the precision everything runs in (default: the eager fp32 model).
    ``lap(stage)`` is called after each stage (forward / relevance, maps, faithfulness)."""
    B = inputs.tensors[0].shape[0]
    specs = _row_specs(spec, B)
    path = specs[0].path if specs else ForwardPath.FUSED
    fwd = forwards or Forwards.eager(model)
    grid, query = model_grid(model), model_query(model)
    requested = torch.tensor([-1 if s.target is None else s.target for s in specs],
                             dtype=torch.long)  # (B,): -1 = the predicted class
    rel = target = None
    with torch.inference_mode():
        if path is ForwardPath.RELEVANCE:  # in the served precision: the plain path's probs
            read = inputs.read(model)  # the eager model's view: relevance runs eagerly
            with fwd.execution.applied(model):
                ex = explain(model, inputs.tensors, requested, read.mask, grid, query)
            logits, target = ex.logits, ex.target
            attn, rel = ex.attn.float(), read.place(ex.relevance.float())
        elif path is ForwardPath.ATTENTION:
            logits, attn = fwd.with_attention(*inputs.tensors)  # attn (L, B, H, W, W)
            read = inputs.read(model, attn.shape[-1])  # a trace's view may be wider
        else:
            logits, attn = fwd.plain(*inputs.tensors), None
        probs = logits.float().softmax(-1)  # (B, K)
        lap("relevance" if path is ForwardPath.RELEVANCE else "forward")
        maps = None if attn is None else read.place_maps(compute_attention_maps(
            attn, attention_mask=read.mask, grid=grid, with_heads=any(s.heads for s in specs),
            query=query))
        # the class followed: relevance's target, else the requested one, else the predicted
        explained = target if target is not None else torch.where(
            requested < 0, probs.argmax(-1), requested)  # (B,)
        ngram = None if maps is None else inputs.ngram_shares(model, explained)  # (B, N)
        if maps is not None:
            lap("maps")
    result = ExplainResult(probs, maps, rel, target if ngram is None else explained, ngram)
    rows = [r for r, s in enumerate(specs) if s.faithfulness]
    if rows and maps is not None:
        result.faithfulness = _faithfulness(model, inputs, result, rows, explained[rows],
                                            fwd.execution)
        lap("faithfulness")
    return result


def _faithfulness(model: nn.Module, inputs: Inputs, res: ExplainResult, rows: list[int],
                  target: Tensor, execution: Execution) -> dict[int, FaithfulnessSummary]:
    """Faithfulness of the maps of ``rows`` (relevance exists only on the gradient path)."""
    assert res.maps is not None
    p_full = res.probs[rows].gather(1, target[:, None])[:, 0]  # (n,)
    maps = {"rollout": res.maps.rollout[rows].reshape(len(rows), -1)}  # each (n, N)
    if res.relevance is not None:
        maps["relevance"] = res.relevance[rows].reshape(len(rows), -1)
    if res.ngram is not None:
        maps["ngram"] = res.ngram[rows]
    with torch.inference_mode(), execution.applied(model):
        curves = faithfulness_curves(maps, inputs.valid(model)[rows],
                                     inputs.probs_fn(model, rows, target), p_full)
    return {row: summarise_faithfulness(curves, k, int(target[k]), inputs.removal)
            for k, row in enumerate(rows)}
