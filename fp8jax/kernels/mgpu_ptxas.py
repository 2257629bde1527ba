"""Mosaic GPU's question to ptxas, asked once per process instead of once per FP8 conversion.

Lowering a Mosaic GPU kernel, every conversion to or from an 8-bit type (each
FP8 code a quantizer writes or a GEMM kernel reads) asks the CUDA plugin's
``_get_ptxas_isa_version``, which runs the ``ptxas`` binary to learn its PTX
ISA version (Mosaic GPU avoids some conversion patterns that older ptxas
releases miscompile).  On the 2-core AMD EPYC that is about 11 ms per
question: 134 questions and 1.5 s of the small MoE step's deviceless H100
lowering.  The answer is the installed ptxas's, the same for the whole
process, so :func:`ask_ptxas_once` has it asked once and remembered; the
kernels lowered afterwards are the same modules.  A failed question (no
ptxas) is not remembered: it is asked, and fails, as before.
"""

from __future__ import annotations

import functools
from typing import Any

_REMEMBERED = "_fp8jax_asked_once"


def _plugin_extension() -> Any:
    """The CUDA plugin's Mosaic GPU extension Mosaic GPU's lowering calls, or None."""
    try:
        from jax._src.lib import mosaic_gpu as mgpu_lib
    except ImportError:
        return None
    return getattr(mgpu_lib, "_mosaic_gpu_ext", None)


def ask_ptxas_once(extension: Any = None) -> bool:
    """Remember the answer of ``extension._get_ptxas_isa_version`` (default: the
    CUDA plugin's Mosaic GPU extension) after its first success; True when the
    question is (now) asked once, False where there is none to ask."""
    ext = _plugin_extension() if extension is None else extension
    ask = getattr(ext, "_get_ptxas_isa_version", None)
    if ask is None:
        return False
    if getattr(ask, _REMEMBERED, False):
        return True
    once = functools.cache(ask)
    setattr(once, _REMEMBERED, True)
    ext._get_ptxas_isa_version = once
    return True
