"""Rounding of float32 values to a low-precision format's grid.

Two rules, both saturating (a finite value past the format's largest finite
value ``M`` becomes ``+-M``; +-Inf becomes +-M; NaN stays NaN where the format
has one):

* ``round_nearest``: round-to-nearest, ties to even (the clip-then-cast of
  ``formats.saturating_cast``; unlike the FP8 quantizers, which turn +-Inf
  into the format's Inf or NaN code, the block formats saturate it).
* ``round_stochastic``: for ``|x| <= M`` between two neighbouring grid points
  ``lo <= |x| < hi = lo + ulp``, round up with probability
  ``p = (|x| - lo) / ulp``, down otherwise, so that ``E[q] = x``.  A value on
  the grid is returned unchanged.

How the stochastic rule is computed (exactly, in float32 bit arithmetic):
``ulp = 2^(max(floor(log2 |x|), emin) - mant_bits)`` is the spacing of the
grid at ``|x|`` (``emin`` the exponent of the smallest normal, so subnormals
share the spacing of the first binade).  ``y = |x| / ulp`` is exact (a power
of two scaling), ``f = y - floor(y)`` is exact, and one uniform 32-bit
integer ``r`` per element decides: up iff ``r < f * 2^32``.  Hence
``P(up) = ceil(f * 2^32) / 2^32``, which equals ``f`` whenever ``f`` is a
multiple of ``2^-32`` (every float32 input at or above ``2^-32`` ulp; below
that the bias is under ``2^-32`` ulp per element).  The random bits come
from a JAX PRNG key: same key, same result.

Float32 subnormal inputs are flushed to (signed) zero first, as XLA on CPU
does anyway, so that CPU and GPU agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

from fp8jax.formats import as_format, fmt_max, saturating_cast

_F32_TINY = float(jnp.finfo(jnp.float32).tiny)
_TWO_32 = 4294967296.0


def flush_subnormals(x: jnp.ndarray) -> jnp.ndarray:
    """float32 ``x`` with subnormals replaced by zero of the same sign.

    XLA on CPU treats float32 subnormals as zero (DAZ/FTZ); doing it
    explicitly makes the result the same on every backend and lets a numpy
    reference reproduce it.  ``x * 0`` keeps the sign; NaN is not below tiny.
    """
    x = x.astype(jnp.float32)
    return jnp.where(jnp.abs(x) < _F32_TINY, x * 0.0, x)


def pow2_int(e: jnp.ndarray) -> jnp.ndarray:
    """float32 2^e for integer e in [-126, 127], built from its bit pattern (exact)."""
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def floor_log2(a: jnp.ndarray) -> jnp.ndarray:
    """floor(log2 a) as int32 for positive normal float32 ``a`` (exponent field - 127).

    Zero and subnormals give -127 (their exponent field is 0).
    """
    bits = lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def round_nearest(x: jnp.ndarray, fmt) -> jnp.ndarray:
    """Saturating round-to-nearest-even of float32 ``x`` to ``fmt`` (returns ``fmt``)."""
    # Block formats saturate +-Inf to +-M (module docstring): the clip-only cast.
    return saturating_cast(flush_subnormals(x), fmt, assume_finite=True)


def round_stochastic_with_bits(x: jnp.ndarray, fmt, bits: jnp.ndarray) -> jnp.ndarray:
    """Stochastic rounding of ``x`` to ``fmt`` driven by uint32 ``bits`` (x's shape).

    See the module docstring for the rule; ``round_stochastic`` draws ``bits``
    from a key.  Exposed so that a reference can be fed the same bits.
    """
    fmt = as_format(fmt)
    info = ml_dtypes.finfo(fmt)
    m = fmt_max(fmt)
    if bits.shape != x.shape:
        raise ValueError(f"bits shape {bits.shape} != x shape {x.shape}")
    xf = flush_subnormals(x)
    # Clip first: past the largest finite value there is no upper neighbour,
    # so saturation is deterministic; NaN passes through clip unchanged.
    a = jnp.clip(jnp.abs(xf), 0.0, m)
    e_ulp = jnp.maximum(floor_log2(a), info.minexp) - info.nmant
    # Dividing by a power of two by multiplying with its inverse is exact;
    # both 2^e and 2^-e are normal float32 for every format here.
    y = a * pow2_int(-e_ulp)
    fl = jnp.floor(y)
    frac = y - fl
    # frac * 2^32 is exact; r < frac * 2^32  <=>  r < ceil(frac * 2^32) for
    # integer r, and ceil(...) <= 2^32 - 2^8 fits in uint32.
    thresh = jnp.ceil(frac * _TWO_32).astype(jnp.uint32)
    up = bits.astype(jnp.uint32) < thresh
    q = (fl + up.astype(jnp.float32)) * pow2_int(e_ulp)
    q = jnp.where(jnp.signbit(xf), -q, q)
    q = jnp.where(jnp.isnan(xf), xf, q)
    # q is on the grid and within +-max: the cast below is exact (+-Inf saturates).
    return saturating_cast(q, fmt, assume_finite=True)


def round_stochastic(x: jnp.ndarray, fmt, key: jax.Array) -> jnp.ndarray:
    """Unbiased stochastic rounding of float32 ``x`` to ``fmt``, seeded by ``key``."""
    bits = jax.random.bits(key, x.shape, jnp.uint32)
    return round_stochastic_with_bits(x, fmt, bits)


def round_to_format(x: jnp.ndarray, fmt, key: jax.Array | None = None) -> jnp.ndarray:
    """Round-to-nearest-even when ``key`` is None, stochastic rounding otherwise."""
    if key is None:
        return round_nearest(x, fmt)
    return round_stochastic(x, fmt, key)
