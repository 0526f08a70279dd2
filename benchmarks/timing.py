"""Shared by the micro-benchmarks: mean wall time of a call."""

from __future__ import annotations

import time
from collections.abc import Callable


def ms_per_call(fn: Callable[[], object], n: int = 30, warmup: int = 1) -> float:
    """Mean milliseconds of ``n`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1000
