"""FP8 codes as bytes in NVIDIA GPU kernels: the cast XLA would write and the values
a code holds, where a kernel compiler's own conversions differ from XLA's.

Shared by the Pallas Triton quantizers (:mod:`fp8jax.kernels.gpu_quantize`)
and the Mosaic GPU ones (:mod:`fp8jax.kernels.mgpu_quantize`): their FP8
conversions saturate (``cvt.rn.satfinite``: +-Inf would become +-max), their
min / max ignore NaN, and Triton's FP8 -> float32 conversion drops a NaN's
sign.  Codes travel as int8 bytes, so no FP8 value (and no NaN payload) is
moved on the way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.inline_ops import isfinite

#: FP8 codes of +-Inf and NaN as XLA's conversion writes them (ml_dtypes' semantics,
#: the sign bit the input's): E4M3 has no Inf and takes its NaN code.
_SPECIAL_CODES = {
    jnp.dtype(jnp.float8_e4m3fn): (0x7F, 0x7F),
    jnp.dtype(jnp.float8_e5m2): (0x7C, 0x7E),
}


def cast_with_specials(xs: jax.Array, y: jax.Array, fmt) -> jax.Array:
    """The bytes (int8) of the saturated quotient ``y`` cast to ``fmt``, +-Inf and NaN
    of ``xs`` as XLA casts them.

    The kernels' float32 -> FP8 conversion (Triton's, Mosaic GPU's) saturates
    (``cvt.rn.satfinite``: +-Inf would become +-max), and their min / max
    ignore NaN (a NaN x gives a finite ``y``).  Finite lanes are cast; the
    others get :data:`_SPECIAL_CODES` with x's sign.  (E5M2 has several NaN
    codes; which one XLA writes for a NaN depends on the payload its
    arithmetic left: see :func:`fp8jax.kernels.gpu_quantize.same_codes`.)
    """
    finite = isfinite(xs)  # False for +-Inf and NaN
    codes = jnp.where(finite, y, jnp.float32(0.0)).astype(fmt)
    code_bits = lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32) & 0xFF
    inf_code, nan_code = _SPECIAL_CODES[jnp.dtype(fmt)]
    sign = (lax.bitcast_convert_type(xs, jnp.int32) >> 24) & 0x80
    special = jnp.where(jnp.isinf(xs), jnp.int32(inf_code), jnp.int32(nan_code)) | sign
    # int32 0..255 to int8 wraps modulo 256: the byte itself.  The kernels store
    # the bytes as int8 and the caller views them as ``fmt``: no FP8 value is
    # moved on the way, so no NaN payload can be rewritten (Pallas' interpreter
    # on CPU turned E5M2's NaN 0x7E into 0x7F when it moved FP8 values).
    return jnp.where(finite, code_bits, special).astype(jnp.int8)


def code_values(code_bytes: jax.Array, fmt) -> jax.Array:
    """FP8 codes of ``fmt``, given as their int8 bytes (or sign-extended in a wider
    integer), as float32 values (exact), a NaN code's sign kept.

    The sign is put back from the byte: Triton's FP8 -> float32 conversion
    gives a NaN code the canonical (positive) NaN, where XLA keeps its sign,
    and the requantized code of a NaN carries the sign of the value it came from.
    """
    value = lax.bitcast_convert_type(code_bytes.astype(jnp.int8), fmt).astype(jnp.float32)
    magnitude = lax.bitcast_convert_type(value, jnp.int32) & 0x7FFFFFFF
    # The sign tested in 32 bits: Mosaic GPU compares no 8-bit integers.
    sign = jnp.where(code_bytes.astype(jnp.int32) < 0, jnp.int32(-(2**31)), jnp.int32(0))
    return lax.bitcast_convert_type(magnitude | sign, jnp.float32)
