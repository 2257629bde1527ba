"""FP8 / low-precision formats and the saturating cast.

A *format* here is a numpy/ml_dtypes dtype (``fp8jax.E4M3`` is
``ml_dtypes.float8_e4m3fn``).  ``fmt_max(fmt)`` is the largest finite value.

Why a saturating cast: ``x.astype(float8_e4m3fn)`` does not saturate; values
past the largest finite value become NaN on CPU (E4M3FN has no Inf), and to
Inf for E5M2.  FP8 training wants saturation: a value above the range is
clipped to +-max, the nearest representable value in magnitude.

``saturating_cast`` semantics (all formats):

* finite x: clipped to [-max, max], then rounded to nearest-even;
* NaN stays NaN;
* +-Inf becomes +-max (saturation: Inf is "larger than max"), so a single
  overflowing activation does not poison a whole tile with NaN.  Scale
  computation treats Inf separately (see ``scaling``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3 = jnp.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = jnp.dtype(ml_dtypes.float8_e5m2)
E4M3FNUZ = jnp.dtype(ml_dtypes.float8_e4m3fnuz)
E5M2FNUZ = jnp.dtype(ml_dtypes.float8_e5m2fnuz)
E8M0 = jnp.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = jnp.dtype(jnp.bfloat16)

FORMATS: dict[str, jnp.dtype] = {
    "e4m3": E4M3,
    "e5m2": E5M2,
    "e4m3fnuz": E4M3FNUZ,
    "e5m2fnuz": E5M2FNUZ,
    "e8m0": E8M0,
}

FP8_FORMATS = (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ)


def as_format(fmt: str | np.dtype | type) -> jnp.dtype:
    """Resolve a format name ("e4m3", "e5m2", ...) or dtype to a dtype."""
    if isinstance(fmt, str):
        key = fmt.lower().replace("float8_", "").replace("fn", "")
        key = {"e4m3": "e4m3", "e5m2": "e5m2", "e4m3uz": "e4m3fnuz", "e5m2uz": "e5m2fnuz"}.get(
            key, key
        )
        if fmt.lower() in FORMATS:
            return FORMATS[fmt.lower()]
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(f"unknown format {fmt!r}; known: {sorted(FORMATS)}")
    return jnp.dtype(fmt)


def fmt_max(fmt) -> float:
    """Largest finite value of a format (E4M3: 448, E5M2: 57344)."""
    return float(ml_dtypes.finfo(as_format(fmt)).max)


def fmt_tiny(fmt) -> float:
    """Smallest positive subnormal of a format (E4M3: 2^-9)."""
    return float(ml_dtypes.finfo(as_format(fmt)).smallest_subnormal)


def fmt_min_normal(fmt) -> float:
    """Smallest positive normal of a format (E4M3: 2^-6)."""
    return float(ml_dtypes.finfo(as_format(fmt)).smallest_normal)


def saturating_cast(x: jnp.ndarray, fmt) -> jnp.ndarray:
    """Cast to ``fmt`` with saturation (see module docstring).

    Finite values are clipped to +-max before the cast so that the cast's
    round-to-nearest-even never sees a value outside the range; NaN passes
    through ``clip`` unchanged and is cast to the format's NaN; +-Inf clips
    to +-max.
    """
    fmt = as_format(fmt)
    m = fmt_max(fmt)
    # Clip in the input's own precision when it is float32/float64 so that the
    # rounding of the cast happens exactly once (from x), never twice.
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits < 32:
        x = x.astype(jnp.float32)
    return jnp.clip(x, -m, m).astype(fmt)


# E5M6 (DeepSeek-V3's cache format for the input of the linear after
# attention): 5 exponent bits (bias 15, E5M2's range), 6 mantissa bits.
E5M6_MANTISSA_BITS = 6
E5M6_MIN_EXP = -14
E5M6_MAX = (2.0 - 2.0**-E5M6_MANTISSA_BITS) * 2.0**15


def round_to_e5m6(x: jnp.ndarray) -> jnp.ndarray:
    """x rounded to nearest-even on the E5M6 grid (emulated), float32 in and out.

    Normal values keep 6 mantissa bits; below 2^-14 the grid is the format's
    subnormal spacing 2^-20; finite values beyond the largest (65024)
    saturate to it; NaN and +-Inf pass through.  Every E5M6 value is exact in
    bfloat16 and float32.
    """
    xf = x.astype(jnp.float32)
    _, e = jnp.frexp(xf)
    # frexp's exponent is floor(log2|x|) + 1; below the normal range the
    # spacing stays that of the smallest normal binade.
    exp = jnp.maximum(e - 1, E5M6_MIN_EXP)
    quantum = jnp.ldexp(jnp.float32(1.0), exp - E5M6_MANTISSA_BITS)
    # Division and multiplication by a power of two are exact; round is half-to-even.
    y = jnp.round(xf / quantum) * quantum
    return jnp.where(jnp.isfinite(xf), jnp.clip(y, -E5M6_MAX, E5M6_MAX), xf)
