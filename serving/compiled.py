"""Traced (TorchScript) forwards for serving, made and checked when a model is loaded.

Why: a worker's inference thread shares the GIL with its event loop, and eager PyTorch takes the
GIL back after every op (a 6-layer ViT forward is a few hundred of them); a traced graph runs
its ops in C++ without going back to Python between them (``benchmarks/bench_traced.py``;
docs/serving.md, "Traced forwards").

Both serving paths are traced, TTA included (:mod:`vit_service.tta`): the fused forward,
and ``forward_with_attention``, which returns the weights of the same pass; relevance (a
backward pass) stays eager. The traces are checked against the eager model on two batch sizes
(and, for text, two lengths and padding) before they are used: a trace that fails or disagrees
(more than 1e-4) is dropped with a warning and the model is served eagerly, so tracing can cost
speed but never answers.

In bf16 (:class:`vit_service.execution.Execution`: autocast on the explicit attention path,
the default on a CPU with native bf16) the traces are recorded under autocast with
TorchScript's own autocast pass off, so the casts are baked into the graph (docs/serving.md,
"bf16 forward"); they are checked against the eager model under the same autocast. Both
callables return fp32 tensors whatever the precision.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from vit_service.data.tokenized import padding_mask
from vit_service.execution import Execution, Precision
from vit_service.pipeline import Forwards
from vit_service.tta import Predict, PredictWithAttention, predict, predict_with_attention

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # max |traced - eager| on logits and weights at load


def _execution(precision: Precision | Execution) -> Execution:
    return precision if isinstance(precision, Execution) else Execution.serving(precision)


def eager_forwards(model: nn.Module, precision: Precision | Execution = "fp32") -> Forwards:
    ex = _execution(precision)
    if ex.dtype is None:  # the model as loaded: the fused path
        return Forwards.eager(model)

    def plain(*inputs: Tensor) -> Tensor:
        with ex.applied(model):
            return predict(model, *inputs).float()

    def with_attention(*inputs: Tensor) -> tuple[Tensor, Tensor]:
        with ex.applied(model):
            logits, attn = predict_with_attention(model, *inputs)
        return logits.float(), attn.float()

    return Forwards(plain, with_attention, False, ex)


def _as_fp32(plain: Callable[..., Tensor], attn: Callable[..., tuple[Tensor, Tensor]],
             ex: Execution) -> Forwards:
    """Traced callables whose outputs are fp32 (a bf16 trace returns bf16)."""
    if ex.dtype is None:
        return Forwards(plain, attn, True, ex)

    def plain32(*inputs: Tensor) -> Tensor:
        return plain(*inputs).float()

    def attn32(*inputs: Tensor) -> tuple[Tensor, Tensor]:
        logits, w = attn(*inputs)
        return logits.float(), w.float()

    return Forwards(plain32, attn32, True, ex)


@contextmanager
def _tracing(model: nn.Module, ex: Execution) -> Iterator[None]:
    """Record a trace in ``ex``: under autocast, with TorchScript's autocast pass off (a global
    switch, restored), so that the trace holds the casts themselves."""
    if ex.dtype is None:
        yield
        return
    before = torch._C._jit_set_autocast_mode(False)
    try:
        with ex.applied(model):
            yield
    finally:
        torch._C._jit_set_autocast_mode(before)


def _examples(model: nn.Module, task: str, meta_preprocess: dict[str, Any]
              ) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    if task == "image":
        s = int(meta_preprocess["image_size"])
        return [(torch.randn(b, 3, s, s, generator=g),) for b in (3, 5)]
    out = []
    max_len = int(meta_preprocess.get("max_len", cfg.max_len))
    crop = int(getattr(cfg, "student_len", 0) or 0)
    # a model whose Transformer reads a crop is traced on inputs longer than the crop (the
    # trace keeps the path it saw) and checked on short ones too
    sizes = ((3, crop + 5), (5, min(crop, 7))) if crop else ((3, 7), (5, 12))
    for b, t in ((b, min(t, max_len)) for b, t in sizes):
        ids = torch.randint(5, cfg.vocab_size, (b, t), generator=g)
        lengths = torch.tensor([t, max(1, t - 3), 1, t, 2][:b])
        mask = padding_mask(lengths, t)  # (B, T) True = real token
        out.append((ids.masked_fill(~mask, cfg.pad_id), mask))
    return out


def _max_diff(a: Tensor | tuple[Tensor, ...], b: Tensor | tuple[Tensor, ...]) -> float:
    a, b = (a,) if isinstance(a, Tensor) else a, (b,) if isinstance(b, Tensor) else b
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _weights_diff(model: nn.Module, a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]
                  ) -> float:
    """:func:`_max_diff` of two ``(logits, weights)``. A model reading a crop, traced on a
    long input, reads a short one at the crop's width (slots past the input are padding, which
    no map reads: ``vit_service.pipeline.ReadTokens``), where the eager model reads the input's
    own: the weights are compared over the tokens both read."""
    (la, wa), (lb, wb) = a, b
    if getattr(model.config, "student_len", 0) and wa.shape[:-2] == wb.shape[:-2]:
        w = min(wa.shape[-1], wb.shape[-1])
        wa, wb = wa[..., :w, :w], wb[..., :w, :w]
    return _max_diff((la, wa), (lb, wb))


def trace_forwards(model: nn.Module, task: str, meta_preprocess: dict[str, Any],
                   name: str = "model", precision: Precision | Execution = "fp32"
                   ) -> Forwards:
    """Traced forwards of ``model`` (in eval mode, parameters frozen) in ``precision``, or the
    eager ones when tracing fails or the traces disagree with the model, run eagerly in the
    same precision, on the check inputs."""
    ex = _execution(precision)
    eager = eager_forwards(model, ex)
    try:
        examples = _examples(model, task, meta_preprocess)
        with torch.no_grad(), warnings.catch_warnings(), _tracing(model, ex):
            warnings.simplefilter("ignore")  # TracerWarnings: the checks below decide
            plain = torch.jit.trace(Predict(model), examples[0], check_trace=False)
            attn = torch.jit.trace(PredictWithAttention(model), examples[0], check_trace=False)
        traced = _as_fp32(plain, attn, ex)
        with torch.inference_mode():
            worst = max(max(_max_diff(traced.plain(*x), eager.plain(*x)),
                            _weights_diff(model, traced.with_attention(*x),
                                          eager.with_attention(*x)))
                        for x in examples)
    except Exception as e:  # noqa: BLE001 - any failure means: serve eagerly
        log.warning("%s: no traced forward (%s: %s); serving the eager model", name,
                    type(e).__name__, e)
        return eager
    if not worst <= TOLERANCE:
        log.warning("%s: the traced forward differs from the model by %.2g; serving the eager "
                    "model", name, worst)
        return eager
    log.info("%s: traced %s forwards checked (max difference %.1g)", name, ex.precision, worst)
    return traced
