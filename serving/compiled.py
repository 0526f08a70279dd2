"""Traced (TorchScript) forwards for serving, made and checked when a model is loaded.

Why: a worker's inference thread shares the GIL with its event loop, and eager PyTorch takes the
GIL back after every op (a 6-layer ViT forward is a few hundred of them). Measured on the shipped
``cifar10-vit-cpu`` model, batch 8, one thread (``benchmarks/bench_traced.py``; docs/serving.md,
"Traced forwards"): eager fused / attention 57.6 / 62.8 ms alone and 68.7 / 77.2 ms beside a
thread doing Python work; traced 52.5 / 51.3 ms alone and 42.8 / 52.0 ms beside it. A traced
graph runs its ops in C++ without going back to Python between them.

Both serving paths are traced (the fused forward, and ``forward_with_attention``, which returns
the weights of the same pass); relevance (a backward pass) stays eager. The traces are checked
against the eager model on two batch sizes (and, for text, two lengths and padding) before they
are used: a trace that fails or disagrees (more than 1e-4) is dropped with a warning and the
model is served eagerly, so tracing can cost speed but never answers.

In bf16 (:mod:`vit_service.precision`: autocast on the explicit attention path, the default on
a CPU with native bf16) the traces are recorded under autocast with TorchScript's own autocast
pass off, so the casts are baked into the graph; they are checked against the eager model
under the same autocast. Measured on the AVX-512 BF16 CPU, served ``cifar10-vit`` conv-stem
model, batch 32, flip TTA, 2 threads: traced bf16 625 img/s against eager bf16 537, traced fp32
321 and eager fp32 299 (with the attention weights: 598 / 540 / 304). Both callables return
fp32 tensors whatever the precision.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from vit_service.pipeline import Forwards
from vit_service.precision import Precision, inference_precision

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # max |traced - eager| on logits and weights at load


class _WithAttention(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.forward_with_attention(*inputs)


def eager_forwards(model: nn.Module, precision: Precision = "fp32") -> Forwards:
    if precision == "fp32":
        return Forwards.eager(model)

    def plain(*inputs: Tensor) -> Tensor:
        with inference_precision(model, precision):
            return model(*inputs).float()

    def with_attention(*inputs: Tensor) -> tuple[Tensor, Tensor]:
        with inference_precision(model, precision):
            logits, attn = model.forward_with_attention(*inputs)
        return logits.float(), attn.float()

    return Forwards(plain, with_attention, False, precision)


def _as_fp32(plain: Callable[..., Tensor], attn: Callable[..., tuple[Tensor, Tensor]],
             precision: Precision) -> Forwards:
    """Traced callables whose outputs are fp32 (a bf16 trace returns bf16)."""
    if precision == "fp32":
        return Forwards(plain, attn, True)

    def plain32(*inputs: Tensor) -> Tensor:
        return plain(*inputs).float()

    def attn32(*inputs: Tensor) -> tuple[Tensor, Tensor]:
        logits, w = attn(*inputs)
        return logits.float(), w.float()

    return Forwards(plain32, attn32, True, precision)


@contextmanager
def _tracing(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Record a trace in ``precision``: for bf16, under autocast with TorchScript's autocast
    pass off (a global switch, restored), so that the trace holds the casts themselves."""
    if precision == "fp32":
        yield
        return
    before = torch._C._jit_set_autocast_mode(False)
    try:
        with inference_precision(model, precision):
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
    for b, t in ((3, min(7, max_len)), (5, min(12, max_len))):
        ids = torch.randint(5, cfg.vocab_size, (b, t), generator=g)
        lengths = torch.tensor([t, max(1, t - 3), 1, t, 2][:b])
        mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T) True = real token
        out.append((ids.masked_fill(~mask, cfg.pad_id), mask))
    return out


def _max_diff(a: Tensor | tuple[Tensor, ...], b: Tensor | tuple[Tensor, ...]) -> float:
    a, b = (a,) if isinstance(a, Tensor) else a, (b,) if isinstance(b, Tensor) else b
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def trace_forwards(model: nn.Module, task: str, meta_preprocess: dict[str, Any],
                   name: str = "model", precision: Precision = "fp32") -> Forwards:
    """Traced forwards of ``model`` (in eval mode, parameters frozen) in ``precision``, or the
    eager ones when tracing fails or the traces disagree with the model, run eagerly in the
    same precision, on the check inputs."""
    eager = eager_forwards(model, precision)
    try:
        examples = _examples(model, task, meta_preprocess)
        with torch.no_grad(), warnings.catch_warnings(), _tracing(model, precision):
            warnings.simplefilter("ignore")  # TracerWarnings: the checks below decide
            plain = torch.jit.trace(model, examples[0], check_trace=False)
            attn = torch.jit.trace(_WithAttention(model), examples[0], check_trace=False)
        traced = _as_fp32(plain, attn, precision)
        with torch.inference_mode():
            worst = max(max(_max_diff(traced.plain(*ex), eager.plain(*ex)),
                            _max_diff(traced.with_attention(*ex), eager.with_attention(*ex)))
                        for ex in examples)
    except Exception as e:  # noqa: BLE001 - any failure means: serve eagerly
        log.warning("%s: no traced forward (%s: %s); serving the eager model", name,
                    type(e).__name__, e)
        return eager
    if not worst <= TOLERANCE:
        log.warning("%s: the traced forward differs from the model by %.2g; serving the eager "
                    "model", name, worst)
        return eager
    log.info("%s: traced %s forwards checked (max difference %.1g)", name, precision, worst)
    return traced
