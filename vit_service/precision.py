"""The precision a trained model answers in, by name (``fp32`` / ``bf16``): the names the CLI,
the settings, the bundle's metadata and the training code use, on top of
:mod:`vit_service.execution`, which holds the rules and applies them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from vit_service.execution import PRECISIONS, Execution, Precision, resolve_execution
from vit_service.hardware import cpu_has_native_bf16

__all__ = ["PRECISIONS", "Precision", "autocast_dtype", "inference_precision",
           "resolve_precision", "serving_execution"]


def resolve_precision(choice: str, device: torch.device | str = "cpu") -> Precision:
    """``auto`` -> bf16 on a CPU with native bf16, else fp32; ``fp32`` / ``bf16`` as given
    (bf16 is a CPU autocast here: on CUDA it resolves to fp32)."""
    return resolve_execution("serve", device, precision=choice,
                             native_bf16=cpu_has_native_bf16).precision


def serving_execution(precision: Precision, device: torch.device | str = "cpu") -> Execution:
    """The execution of an already resolved serving ``precision``."""
    return Execution.serving(precision, torch.device(device).type)


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: no autocast)."""
    return serving_execution(precision).dtype


@contextmanager
def inference_precision(model: nn.Module, precision: Precision) -> Iterator[None]:
    """Run ``model`` forward in ``precision`` for a block: bf16 is
    :meth:`Execution.applied` (autocast on the explicit attention path); fp32 leaves the model
    as it is (its own attention path)."""
    if precision == "fp32":
        yield
        return
    with serving_execution(precision).applied(model):
        yield
