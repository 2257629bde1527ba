"""What quantization did to one operand: amax, saturated and flushed fractions.

The one definition of each, used by the layers' telemetry, the numerics lab
and the experiments:

* **saturated**: the fraction of elements whose scaled magnitude |x / s|
  exceeds the format's largest finite value by more than rounding to nearest
  would absorb, i.e. |x / s| > max + ulp(max) / 2 (464 for E4M3, 61440 for
  E5M2).  Those are exactly the values a saturating cast clips: anything
  below that bound rounds to +-max anyway (an online scale maps a tile's amax
  onto max only up to one float32 rounding, so the amax itself never counts).
* **flushed**: the fraction of elements that are non-zero in x but whose code
  is zero (underflow below half the smallest subnormal).

Both are float32 scalars over all elements of the operand (NaN elements count
as neither).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.formats import fmt_max
from fp8jax.quant import QTensor, expand_scale
from fp8jax.scaling import exact_div, finite_amax


def clip_threshold(fmt) -> float:
    """max + ulp(max) / 2: the smallest |x / s| that a saturating cast clips."""
    m = fmt_max(fmt)
    # ulp at max: 2^(floor(log2 max) - mantissa bits).
    ulp = 2.0 ** (math.floor(math.log2(m)) - int(jnp.finfo(fmt).nmant))
    return m + ulp / 2


def saturated_fraction(x: jax.Array, q: QTensor) -> jax.Array:
    """Fraction of x clipped by the saturating cast of ``q`` (see module docstring)."""
    xf = x.astype(jnp.float32)
    s = expand_scale(q.scale, q.data.shape, q.granularity, q.axis, q.tile)
    # The same correctly rounded quotient the quantizer casts.
    y = exact_div(jnp.where(jnp.isfinite(xf), xf, 0.0), jnp.broadcast_to(s, xf.shape))
    return jnp.mean((jnp.abs(y) > clip_threshold(q.data.dtype)).astype(jnp.float32))


def flushed_fraction(x: jax.Array, q: QTensor) -> jax.Array:
    """Fraction of x that is non-zero but quantized to a zero code."""
    xf = x.astype(jnp.float32)
    zero_code = q.data.astype(jnp.float32) == 0
    return jnp.mean(((xf != 0) & ~jnp.isnan(xf) & zero_code).astype(jnp.float32))


def operand_stats(x: jax.Array, op) -> dict[str, jax.Array]:
    """{"amax", "saturated", "flushed"} of one GEMM operand (x before, ``op`` after quantization).

    An operand that was not quantized (a plain array) reports zeros for both fractions.
    """
    zero = jnp.zeros((), jnp.float32)
    if x.size == 0:
        return {"amax": zero, "saturated": zero, "flushed": zero}
    amax = finite_amax(x)
    if not isinstance(op, QTensor):
        return {"amax": amax, "saturated": zero, "flushed": zero}
    return {
        "amax": amax,
        "saturated": saturated_fraction(x, op),
        "flushed": flushed_fraction(x, op),
    }
