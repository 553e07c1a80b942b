"""The dtype the engine computes in; `auto` picks bfloat16 where the CPU multiplies it natively.

As vLLM's CPU build does: AVX-512 BF16 or AMX make bf16 matmuls about twice as fast as fp32
ones, and halve the weights' and the KV cache's bytes. Without either, bf16 is emulated and
slower than fp32, so `auto` keeps fp32 there.
"""
from __future__ import annotations

from pathlib import Path

AUTO = "auto"
DTYPES = ("float32", "float16", "bfloat16")
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")   # /proc/cpuinfo flags of native bf16 dot products
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags the first processor of a /proc/cpuinfo text lists."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def auto_dtype(cpuinfo: str | None = None) -> str:
    """bfloat16 where the CPU has a native bf16 dot product, else float32."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:   # not Linux: no flags to go by
            cpuinfo = ""
    return "bfloat16" if cpu_flags(cpuinfo) & set(BF16_CPU_FLAGS) else "float32"


def resolve_dtype(name: str) -> str:
    """`name` itself, or what `auto` means on this machine; ValueError for anything else."""
    if name == AUTO:
        return auto_dtype()
    if name not in DTYPES:
        raise ValueError(f"dtype must be {AUTO!r} or one of {DTYPES}, got {name!r}")
    return name
