"""Explanations you can check: gradient-weighted attention relevance, and how faithful a map is.

**Relevance** (Chefer, Gur & Wolf, ICCV 2021, "Generic Attention-model Explainability for
Interpreting Bi-Modal and Encoder-Decoder Transformers", eq. 5-6 for self-attention). For the
explained class ``c`` (the predicted one unless a target is given), per layer ``l`` with weights
``A_l`` ``(B, H, T, T)`` and ``G_l = d logit_c / d A_l``::

    Abar_l = mean_heads( (G_l * A_l).clamp(min=0) )      # (B, T, T)
    R_0 = I;   R_l = R_{l-1} + Abar_l @ R_{l-1}           # first layer first

then the ``[CLS]`` row of ``R_L`` (or, for a mean-pooling model, the mean of the token rows),
without the ``[CLS]`` column, padding set to 0, renormalised to sum 1 -- the same normalisation
as :mod:`vit_service.attention_maps`, so the maps are comparable.

The gradients are taken with :func:`torch.autograd.grad` with respect to the attention weights
only: no parameter gradient is computed and no ``.grad`` is written, the model is not switched
out of ``eval`` and nothing in it changes, so the same model keeps serving other requests. With
flip test-time augmentation (:mod:`vit_service.tta`) the answer averages two views and picks
the predicted class; the map explains the given view (its own logit is differentiated: the
gradient of the mean is exactly half of it).

**Faithfulness** (deletion / insertion, Petsiuk et al. 2018, as used by Chefer et al. 2021). For a
map and the explained class: remove the patches or tokens most relevant first in ``steps``
equal steps and record the class probability after each (deletion; a faithful map makes it fall
fast, so a *low* area under the curve is good), and reveal them most relevant first starting from
nothing (insertion; *high* area is good). The same curves for a random order are the reference:
a map is better than chance when its deletion AUC is below random's. Images: a removed patch is
filled with the image's own mean colour (per channel, in the normalised input), which keeps the
image's overall statistics and adds no edges of its own beyond the patch borders; texts: a
removed token is dropped from attention with the padding mask (no token is substituted, positions
of the rest are unchanged). Every perturbed input of a batch goes through the model in batched
forwards (chunks of ``chunk`` inputs); AUCs use the trapezoidal rule over the fraction removed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vit_service.attention_maps import Query, normalise_rows, query_row, to_grid
from vit_service.tta import flips, other_views, pool_views, predict

log = logging.getLogger(__name__)

STEPS = 10  # perturbation steps per curve (11 points, 0 % .. 100 %)
RANDOM_SEED = 0  # the random reference order is seeded, so answers are reproducible


# --- relevance -------------------------------------------------------------------------------


def relevance_from_gradients(
    attns: list[Tensor],
    grads: list[Tensor],
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    num_prefix_tokens: int = 1,
    query: Query = "cls",
) -> Tensor:
    """Chefer et al.'s relevance from per-layer weights and their gradients (each
    ``(B, H, T, T)``, first layer first): ``(B, N)``, or ``(B, gh, gw)`` with ``grid``."""
    if len(attns) != len(grads) or not attns:
        raise ValueError("need one gradient per attention layer")
    B, _, T, _ = attns[0].shape
    device = attns[0].device
    # in fp32 whatever the forward ran in: under a bf16 autocast the products would round to
    # bf16 and the map would no longer sum to 1
    with torch.autocast(device.type, enabled=False):
        rel = torch.eye(T, dtype=torch.float32, device=device).expand(B, T, T)
        for a, g in zip(attns, grads, strict=True):
            cam = (g.float() * a.float()).clamp_min(0).mean(dim=1)  # (B, T, T)
            rel = rel + cam @ rel  # (B, T, T)
        row = query_row(rel, query, attention_mask, num_prefix_tokens)[:, num_prefix_tokens:]
        return to_grid(normalise_rows(row, attention_mask, num_prefix_tokens, 0), grid)


@dataclass
class Explanation:
    """One batch explained. ``logits`` ``(B, K)`` (what the model serves, TTA included);
    ``attn`` ``(L, B, H, T, T)`` (the given view); ``relevance`` ``(B, *S)``; ``target`` ``(B,)``:
    the explained class per item."""

    logits: Tensor
    attn: Tensor
    relevance: Tensor
    target: Tensor


def attention_gradients(
    model: nn.Module, inputs: tuple[Tensor, ...], target: Tensor | None = None
) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor]:
    """One forward with the attention weights kept in the graph, one backward to them only.

    ``inputs``: what ``model.attention_graph`` takes (``(x,)`` for a ViT, ``(ids, mask)`` for a
    text model). ``target`` ``(B,)`` class indices, ``-1`` (or ``None`` for all) = predicted.
    Returns detached ``logits`` ``(B, K)`` (what the model answers: TTA included, see
    :mod:`vit_service.tta`), per-layer weights and ``d logit_target / d weights`` of the given
    view (each ``(B, H, T, T)``, over the tokens the attention read: a text model's crop, see
    ``vit_service.pipeline.ReadTokens``) and the target ``(B,)``. Safe inside
    ``torch.inference_mode()``: it leaves it locally and copies inputs created in it.
    """
    with torch.inference_mode(False), torch.enable_grad():
        inputs = tuple(t.clone() if t.is_inference() else t for t in inputs)
        logits, attns = model.attention_graph(*inputs)  # attns: L x (B, H, T, T)
        served = logits.detach()
        if flips(model):  # the other views only move the answer, not the given view's map
            with torch.no_grad():
                served = pool_views(served, model(other_views(model, inputs[0])))
        pred = served.argmax(-1)
        tgt = pred if target is None else torch.where(target.to(pred.device) < 0, pred,
                                                      target.to(pred.device))
        score = logits.gather(1, tgt[:, None]).sum()  # items are independent: one backward
        grads = list(torch.autograd.grad(score, attns))
    return served, [a.detach() for a in attns], grads, tgt


def explain(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    target: Tensor | None = None,
    attention_mask: Tensor | None = None,
    grid: tuple[int, int] | None = None,
    query: Query = "cls",
) -> Explanation:
    """Logits, attention and relevance of a batch from one forward and one backward (see
    :func:`attention_gradients` for ``inputs`` and ``target``)."""
    logits, attns, grads, tgt = attention_gradients(model, inputs, target)
    rel = relevance_from_gradients(attns, grads, attention_mask, grid,
                                   getattr(model, "num_prefix_tokens", 1), query)
    return Explanation(logits, torch.stack(attns), rel, tgt)


# --- faithfulness ----------------------------------------------------------------------------


@dataclass
class Curves:
    """Deletion and insertion curves of one map over a batch: ``fractions`` ``(B, steps+1)``
    (share of items removed / revealed), ``deletion`` / ``insertion`` ``(B, steps+1)``
    probabilities of the explained class, and their areas ``(B,)``."""

    fractions: Tensor
    deletion: Tensor
    insertion: Tensor
    deletion_auc: Tensor
    insertion_auc: Tensor


def auc(fractions: Tensor, curve: Tensor) -> Tensor:
    """Trapezoidal area under ``curve`` over ``fractions`` (both ``(B, P)``): ``(B,)``."""
    dx = fractions[:, 1:] - fractions[:, :-1]
    return (dx * (curve[:, 1:] + curve[:, :-1]) / 2).sum(-1)


def ranking(maps: Tensor, valid: Tensor) -> Tensor:
    """``(B, N)`` maps -> ``(B, N)`` positions most relevant first; invalid positions last."""
    score = maps.float().masked_fill(~valid, float("-inf"))
    return score.argsort(dim=-1, descending=True, stable=True)


def random_ranking(valid: Tensor, seed: int = RANDOM_SEED) -> Tensor:
    """A seeded random order of the valid positions (then the invalid ones); the same for
    every row, so an input's answer does not depend on its place in a batch."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.rand(valid.shape[-1], generator=gen).to(valid.device)  # (N,)
    return ranking(noise.expand(valid.shape), valid)


def step_counts(n_valid: Tensor, steps: int = STEPS) -> Tensor:
    """``(B,)`` -> ``(B, steps+1)`` items affected after each step: ``round(k n / steps)``."""
    k = torch.arange(steps + 1, device=n_valid.device, dtype=torch.float64)
    return (k[None] * n_valid[:, None].double() / steps).round().long()


def keep_masks(order: Tensor, counts: Tensor, insertion: bool) -> Tensor:
    """Which positions are present at each step: ``(B, P, N)`` bool.

    Deletion: the first ``counts[:, p]`` positions of ``order`` are removed. Insertion: only
    they are present. Positions past the valid ones are never present for insertion and never
    removed for deletion (callers mask padding anyway)."""
    B, N = order.shape
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(N, device=order.device).expand(B, N))  # (B, N)
    top = rank[:, None, :] < counts[:, :, None]  # (B, P, N): among the first counts
    return top if insertion else ~top


def faithfulness_curves(
    maps: dict[str, Tensor],
    valid: Tensor,
    probs_of: Callable[[Tensor], Tensor],
    p_full: Tensor,
    steps: int = STEPS,
    seed: int = RANDOM_SEED,
) -> dict[str, Curves]:
    """Deletion and insertion curves for each map in ``maps`` (each ``(B, N)``) and for a
    random order (key ``"random"``).

    ``valid`` ``(B, N)``: real positions (all True for images). ``probs_of(keep)`` gets a
    ``(B, Q, N)`` bool tensor (Q perturbed versions of each item; True = present) and returns the
    explained class's probability for each, ``(B, Q)``. ``p_full`` ``(B,)``: that probability
    for the unperturbed input (deletion starts and insertion ends there, so it is not
    recomputed). The fully removed input is computed once and shared.
    """
    B = valid.shape[0]
    n_valid = valid.sum(-1)
    counts = step_counts(n_valid, steps)  # (B, P)
    orders = {name: ranking(m.reshape(B, -1), valid) for name, m in maps.items()}
    orders["random"] = random_ranking(valid, seed)
    inner = slice(1, steps)  # steps 1 .. steps-1; 0 and steps are the full / empty input
    masks = [torch.zeros_like(valid)[:, None]]  # the empty input, shared
    for order in orders.values():
        masks.append(keep_masks(order, counts, insertion=False)[:, inner])
        masks.append(keep_masks(order, counts, insertion=True)[:, inner])
    keep = torch.cat(masks, dim=1) & valid[:, None]  # (B, Q, N)
    probs = probs_of(keep)  # (B, Q)
    p_empty, rest = probs[:, 0], probs[:, 1:].split(steps - 1, dim=1)
    fractions = counts.float() / n_valid.clamp_min(1)[:, None].float()
    out: dict[str, Curves] = {}
    for i, name in enumerate(orders):
        d_mid, i_mid = rest[2 * i], rest[2 * i + 1]
        deletion = torch.cat([p_full[:, None], d_mid, p_empty[:, None]], dim=1)
        insertion = torch.cat([p_empty[:, None], i_mid, p_full[:, None]], dim=1)
        out[name] = Curves(fractions, deletion, insertion, auc(fractions, deletion),
                           auc(fractions, insertion))
    return out


@dataclass(frozen=True)
class CurveSummary:
    """One map's curves for one item, as plain values."""

    deletion: list[float]
    insertion: list[float]
    deletion_auc: float
    insertion_auc: float


@dataclass(frozen=True)
class FaithfulnessSummary:
    """One item's faithfulness: the explained class, the fractions removed, each map's curves
    (``random`` included), each map's deletion AUC over random's (below 1 beats chance) and
    the most faithful map (``random`` if none beats chance)."""

    target: int
    fractions: list[float]
    removal: str
    maps: dict[str, CurveSummary]
    deletion_ratio: dict[str, float]
    most_faithful: str


def summarise_faithfulness(curves: dict[str, Curves], row: int, target: int, removal: str
                           ) -> FaithfulnessSummary:
    """Item ``row`` of batched curves (see :func:`faithfulness_curves`) as plain values."""
    maps = {name: CurveSummary(c.deletion[row].tolist(), c.insertion[row].tolist(),
                               float(c.deletion_auc[row]), float(c.insertion_auc[row]))
            for name, c in curves.items()}
    rand = maps["random"].deletion_auc
    if rand <= 1e-9:  # nothing to remove (no real token) or a class at probability 0
        ratio = {n: 1.0 for n in maps if n != "random"}
    else:
        ratio = {n: m.deletion_auc / rand for n, m in maps.items() if n != "random"}
    best = min(ratio, key=ratio.__getitem__) if ratio else "random"
    return FaithfulnessSummary(target, curves["random"].fractions[row].tolist(), removal, maps,
                               ratio, best if ratio.get(best, 1.0) < 1.0 else "random")


def _batched_probs(
    forward: Callable[[int, int], Tensor], total: int, target: Tensor, per_item: int,
    chunk: int,
) -> Tensor:
    """Run ``forward(start, stop)`` -> logits over ``total`` perturbed inputs in chunks; the
    probability of item ``i // per_item``'s target class: ``(total,)``."""
    out = []
    tgt = target.repeat_interleave(per_item)
    for s in range(0, total, chunk):
        with torch.no_grad():
            logits = forward(s, min(total, s + chunk)).float()
        out.append(logits.softmax(-1).gather(1, tgt[s:s + logits.shape[0], None])[:, 0])
    return torch.cat(out)


def image_probs_fn(
    model: nn.Module, x: Tensor, target: Tensor, patch_size: int, chunk: int = 256
) -> Callable[[Tensor], Tensor]:
    """``probs_of`` for images ``x`` ``(B, C, S, S)``: a removed patch is filled with the
    image's mean colour; the model's answer (TTA included) gives the probabilities."""
    fill = x.mean(dim=(2, 3), keepdim=True)  # (B, C, 1, 1)

    def probs_of(keep: Tensor) -> Tensor:
        B, Q, N = keep.shape
        g = x.shape[-1] // patch_size
        pix = keep.view(B, Q, g, g).repeat_interleave(patch_size, 2)
        pix = pix.repeat_interleave(patch_size, 3)  # (B, Q, S, S)

        def forward(s: int, e: int) -> Tensor:
            b = torch.arange(s, e, device=x.device) // Q
            m = pix.view(B * Q, 1, *pix.shape[-2:])[s:e]  # (n, 1, S, S)
            return predict(model, torch.where(m, x[b], fill[b]))

        return _batched_probs(forward, B * Q, target, Q, chunk).view(B, Q)

    return probs_of


def text_probs_fn(
    model: nn.Module, ids: Tensor, mask: Tensor, target: Tensor, num_prefix_tokens: int = 1,
    chunk: int = 256,
) -> Callable[[Tensor], Tensor]:
    """``probs_of`` for token ids ``(B, T)`` with ``mask`` ``(B, T)``: a removed token is
    masked out of attention (and pooling); ``[CLS]`` always stays."""

    def probs_of(keep: Tensor) -> Tensor:
        B, Q, N = keep.shape
        prefix = mask[:, None, :num_prefix_tokens].expand(B, Q, num_prefix_tokens)
        full = torch.cat([prefix, keep], dim=2) & mask[:, None]  # (B, Q, T)

        def forward(s: int, e: int) -> Tensor:
            b = torch.arange(s, e, device=ids.device) // Q
            return predict(model, ids[b], full.view(B * Q, -1)[s:e])

        return _batched_probs(forward, B * Q, target, Q, chunk).view(B, Q)

    return probs_of
