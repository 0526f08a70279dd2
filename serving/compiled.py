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
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

TOLERANCE = 1e-4  # max |traced - eager| on logits and weights at load


@dataclass(frozen=True)
class Forwards:
    """What the inference thread calls: ``plain(*inputs) -> logits`` and
    ``with_attention(*inputs) -> (logits, attn (L, B, H, T, T))``."""

    plain: Callable[..., Tensor]
    with_attention: Callable[..., tuple[Tensor, Tensor]]
    traced: bool


class _WithAttention(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        return self.model.forward_with_attention(*inputs)


def eager_forwards(model: nn.Module) -> Forwards:
    return Forwards(model, model.forward_with_attention, False)


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
                   name: str = "model") -> Forwards:
    """Traced forwards of ``model`` (in eval mode, parameters frozen), or the eager ones when
    tracing fails or the traces disagree with the model on the check inputs."""
    try:
        examples = _examples(model, task, meta_preprocess)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings: the checks below decide
            plain = torch.jit.trace(model, examples[0], check_trace=False)
            attn = torch.jit.trace(_WithAttention(model), examples[0], check_trace=False)
        with torch.inference_mode():
            worst = max(max(_max_diff(plain(*ex), model(*ex)),
                            _max_diff(attn(*ex), model.forward_with_attention(*ex)))
                        for ex in examples)
    except Exception as e:  # noqa: BLE001 - any failure means: serve eagerly
        log.warning("%s: no traced forward (%s: %s); serving the eager model", name,
                    type(e).__name__, e)
        return eager_forwards(model)
    if not worst <= TOLERANCE:
        log.warning("%s: the traced forward differs from the model by %.2g; serving the eager "
                    "model", name, worst)
        return eager_forwards(model)
    log.info("%s: traced forwards checked (max difference %.1g)", name, worst)
    return Forwards(plain, attn, True)
