"""The host CPU: its identity and the instruction sets that decide which CPU path is fast."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Instruction sets with a bfloat16 dot product: x86's AVX512-BF16 (vdpbf16ps)
# and AMX-BF16 tile products, Arm's BF16 extension (bfdot / bfmmla).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first processor's ``/proc/cpuinfo`` block as a dict (empty where there is none).

    One block is enough: a machine has one CPU type.
    """
    fields: dict[str, str] = {}
    try:
        block = _CPUINFO.read_text().split("\n\n")[0]
    except OSError:
        return fields
    for line in block.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> frozenset[str]:
    """Instruction-set flags of the host CPU (x86 ``flags``, Arm ``Features``)."""
    fields = cpu_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model() -> str:
    """The CPU's name as the OS reports it."""
    fields = cpu_fields()
    return (
        fields.get("model name")
        or fields.get("Model")
        or platform.processor()
        or platform.machine()
    )


def has_bf16_dot() -> bool | None:
    """True if the host CPU multiplies bfloat16 in hardware, False if not, None if unknown.

    Unknown: no ``/proc/cpuinfo`` (macOS, Windows).  Without such
    instructions a bfloat16 dot has to be computed in float32 arithmetic, so
    it is not expected to be cheaper than a float32 one (see
    ``fp8jax.gemm.AUTO``, which decides by this).
    """
    flags = cpu_flags()
    if not flags:
        return None
    return any(f in flags for f in BF16_DOT_FLAGS)
