"""How a model runs on a device for a purpose: autocast dtype and attention path, in one value.

:func:`resolve_execution` answers "which dtype, autocast and attention path" once per
(device, purpose) and :meth:`Execution.applied` applies it to a block. The rules:

* ``serve`` (the server, ``vit-service evaluate --precision``, the bf16 validation a training
  run records for its bundle, the pyfunc model): ``fp32`` is the model as trained on the fused
  path; ``bf16`` the same weights under ``torch.autocast("cpu", bfloat16)`` (matmuls and
  convolutions in bf16, softmax / LayerNorm / losses in fp32) on the explicit attention path,
  since PyTorch's CPU flash kernel is slower in bf16 than the explicit ``softmax(q k^T) v`` for
  these short sequences (docs/serving.md, "bf16 forward"). ``auto`` is bf16 only on a CPU with
  native bf16 (elsewhere bf16 is emulated and slower than fp32); off the CPU it is fp32.
* ``train``: CUDA autocasts to bf16 with ``amp``; the CPU with ``cpu_bf16`` where it computes
  bf16 natively (else fp32, with a warning). Attention ``auto`` is fused, except for a bf16 step
  on the CPU, whose flash kernel is slow for short sequences and its bf16 backward far slower
  (docs/training.md, "CPU precision and attention path").
* ``validate``: the fused path, in bf16 only on CUDA with ``amp``: on the CPU it stays fp32,
  which is what serving answers by default; ``as_served=True`` (``val_precision: served``) runs
  it as :func:`resolve_execution` ``("serve", precision="auto")`` does where that is bf16.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vit_service.hardware import cpu_has_native_bf16
from vit_service.models.layers import attention_path

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")
Purpose = Literal["train", "validate", "serve"]


@dataclass(frozen=True)
class Execution:
    """Autocast ``dtype`` on ``device_type`` (None: fp32, no autocast) and whether attention
    takes the fused path."""

    device_type: str
    dtype: torch.dtype | None
    fused_attention: bool

    @property
    def precision(self) -> Precision:
        return "bf16" if self.dtype == torch.bfloat16 else "fp32"

    @classmethod
    def serving(cls, precision: Precision, device_type: str = "cpu") -> Execution:
        """The serving execution of an already resolved ``precision``: fp32 on the fused
        path, bf16 autocast on the explicit one."""
        bf16 = precision == "bf16"
        return cls(device_type, torch.bfloat16 if bf16 else None, fused_attention=not bf16)

    def autocast(self) -> torch.autocast:
        """The autocast of this execution (a disabled one for fp32)."""
        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16,
                              enabled=self.dtype is not None)

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """``model`` runs this way inside the block: every attention module on this path (each
        gets its own setting back afterwards), under this autocast. Outputs of a bf16 block
        are bf16: callers take ``.float()``."""
        with ExitStack() as stack:
            stack.enter_context(attention_path(model, fused=self.fused_attention))
            if self.dtype is not None:
                stack.enter_context(self.autocast())
            yield


def served_precision(choice: str, device: torch.device | str = "cpu",
                     native_bf16: Callable[[], bool] | None = None) -> Precision:
    """``auto`` -> bf16 on a CPU with native bf16, else fp32; ``fp32`` / ``bf16`` as given
    (bf16 is a CPU autocast here: off the CPU it is fp32). ``native_bf16``: the CPU probe
    (default :func:`vit_service.hardware.cpu_has_native_bf16`)."""
    if choice not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    if torch.device(device).type != "cpu":
        return "fp32"
    if choice == "auto":
        return "bf16" if (native_bf16 or cpu_has_native_bf16)() else "fp32"
    return choice  # type: ignore[return-value]


def fused_attention_for(choice: str, device_type: str, dtype: torch.dtype | None) -> bool:
    """A training forward's attention path: ``fused`` / ``explicit`` as given; ``auto``: fused
    except for a bf16 step on the CPU."""
    if choice == "auto":
        return not (device_type == "cpu" and dtype is not None)
    return choice == "fused"


def resolve_execution(
    purpose: Purpose,
    device: torch.device | str = "cpu",
    *,
    precision: str = "auto",
    amp: bool = False,
    cpu_bf16: bool = False,
    attention: str = "auto",
    as_served: bool = False,
    native_bf16: Callable[[], bool] | None = None,
) -> Execution:
    """How a model runs on ``device`` for ``purpose`` (the rules: module docstring).

    ``precision``: serving's choice (``auto`` / ``fp32`` / ``bf16``, ``serve`` only); ``amp``,
    ``cpu_bf16``, ``attention``: the recipe's switches (``train``; ``amp`` for ``validate``
    too); ``as_served``: a validation pass run as the server answers (``val_precision:
    served``); ``native_bf16``: the CPU probe (tests pretend)."""
    dev = torch.device(device)
    probe = native_bf16 or cpu_has_native_bf16
    if purpose == "serve":
        return Execution.serving(served_precision(precision, dev, probe), dev.type)
    if purpose == "validate":
        if as_served and served_precision("auto", dev, probe) == "bf16":
            return Execution.serving("bf16", dev.type)
        return Execution(dev.type, torch.bfloat16 if dev.type == "cuda" and amp else None,
                         fused_attention=True)
    if purpose != "train":
        raise ValueError(f"purpose must be train, validate or serve, got {purpose!r}")
    dtype: torch.dtype | None = None
    if dev.type == "cuda" and amp:
        dtype = torch.bfloat16
    elif dev.type == "cpu" and cpu_bf16:
        if probe():
            dtype = torch.bfloat16
        else:
            log.warning("cpu_bf16: this CPU has no native bf16 (AVX-512 BF16 / AMX): training "
                        "in fp32")
    return Execution(dev.type, dtype, fused_attention_for(attention, dev.type, dtype))
