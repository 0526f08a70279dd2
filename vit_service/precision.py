"""The precision a trained model answers in: fp32, or bf16 on a CPU that computes bf16 natively.

One definition for everything that runs a trained model forward (serving, ``vit-service
evaluate --precision``, the bf16 validation a training run records for its bundle), so that the
accuracy reported for a precision is the accuracy served in it:

* ``fp32``: the model as trained, fused attention unless the weights are asked for;
* ``bf16``: the same weights under ``torch.autocast("cpu", bfloat16)`` (matmuls and convolutions
  in bf16, softmax / LayerNorm / losses in fp32) on the explicit attention path: PyTorch's CPU
  flash kernel is slower in bf16 than the explicit ``softmax(q k^T) v`` for these short
  sequences (training/step.py). On the AVX-512 BF16 CPU this was measured on, the served
  ``cifar10-vit`` forward (batch 32, flip TTA, traced) ran at 625 img/s against 321 img/s in
  fp32 (docs/serving.md, "bf16 forward").

``auto`` resolves to bf16 only on a CPU with native bf16 (:func:`cpu_has_native_bf16`): elsewhere
bf16 is emulated and slower than fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from vit_service.hardware import cpu_has_native_bf16
from vit_service.models.layers import attention_path

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")


def resolve_precision(choice: str, device: torch.device | str = "cpu") -> Precision:
    """``auto`` -> bf16 on a CPU with native bf16, else fp32; ``fp32`` / ``bf16`` as given
    (bf16 is a CPU autocast here: on CUDA it resolves to fp32)."""
    if choice not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    if torch.device(device).type != "cpu":
        return "fp32"
    if choice == "auto":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return choice  # type: ignore[return-value]


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: no autocast)."""
    return torch.bfloat16 if precision == "bf16" else None


@contextmanager
def inference_precision(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Run ``model`` forward in ``precision`` for a block: bf16 autocast on the explicit
    attention path (each attention module gets its own setting back), or nothing for fp32.
    Outputs of a bf16 block are bf16: callers take ``.float()``."""
    if precision == "fp32":
        yield
        return
    with attention_path(model, fused=False), torch.autocast("cpu", dtype=torch.bfloat16):
        yield
