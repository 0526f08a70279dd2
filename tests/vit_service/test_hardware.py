"""What the machine facts read from ``/proc/cpuinfo``."""

from __future__ import annotations

from vit_service.hardware import cpu_flags, cpu_model

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16
"""


def test_cpu_model_and_flags_come_from_the_first_processor() -> None:
    assert cpu_model(CPUINFO) == "AMD EPYC 9R14 96-Core Processor"
    assert {"avx512_bf16", "avx2"} <= cpu_flags(CPUINFO)
    assert "amx_bf16" not in cpu_flags(CPUINFO)


def test_a_cpuinfo_without_a_model_name_falls_back_to_the_architecture() -> None:
    assert cpu_model("processor\t: 0\nflags\t: fpu\n")  # e.g. some ARM kernels
