"""What the CPU computes natively, read once: whether bf16 matmuls run in hardware.

On a CPU with AVX-512 BF16 (``avx512_bf16``) or AMX (``amx_bf16``) oneDNN runs bf16 GEMMs
faster than fp32 (docs/training.md, "CPU precision and attention path"); elsewhere bf16 is
emulated and slower than fp32, so callers fall back to fp32.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty off Linux)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if platform.system() != "Linux" or not path.exists():
            return set()
        cpuinfo = path.read_text(errors="replace")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU does bf16 arithmetic in hardware (AVX-512 BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def has_cxx_compiler() -> bool:
    """True when a C++ compiler is on ``PATH`` (``$CXX``, g++, c++ or clang++): TorchInductor
    compiles its CPU kernels with it, so ``torch.compile`` on the CPU needs one."""
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


def cpu_model(cpuinfo: str | None = None) -> str:
    """The ``model name`` of the first processor in ``/proc/cpuinfo`` (else the platform's
    processor string)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if platform.system() != "Linux" or not path.exists():
            return platform.processor() or platform.machine()
        cpuinfo = path.read_text(errors="replace")
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.machine()


def machine_params() -> dict[str, str | int | bool]:
    """What a run's figures depend on besides the recipe, for MLflow: the CPU, whether it has
    native bf16 (AVX-512 BF16) or AMX, whether it has AVX-512 at all (an fp32 step runs at
    different speeds with and without it), and its core count, so that runs on different
    machines can be compared."""
    flags = cpu_flags()
    return {"machine.cpu": cpu_model(), "machine.cpu_count": os.cpu_count() or 0,
            "machine.avx512": "avx512f" in flags,
            "machine.avx512_bf16": "avx512_bf16" in flags, "machine.amx": "amx_bf16" in flags,
            "machine.native_bf16": any(f in flags for f in BF16_FLAGS)}
