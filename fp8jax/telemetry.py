"""What quantization did to one operand: amax, saturated and flushed fractions.

The one definition of each, used by the layers' telemetry, the numerics lab
and the experiments:

* **saturated**: the fraction of elements whose scaled magnitude |x / s|
  exceeds the format's largest finite value by more than rounding to nearest
  would absorb, i.e. |x / s| > max + ulp(max) / 2 (464 for E4M3, 61440 for
  E5M2).  Those are exactly the values a saturating cast clips: anything
  below that bound rounds to +-max anyway (an online scale maps a tile's amax
  onto max only up to one float32 rounding, so the amax itself never counts).
* **flushed**: the fraction of elements that are finite and non-zero in x
  but whose code is zero (underflow below half the smallest subnormal).

Both are float32 scalars over all elements of the operand: exact counts, each
divided by the element count and rounded once (NaN elements count
as neither), for every format: each element's scale comes from its scheme
(:func:`fp8jax.schemes.element_scale`).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import platforms
from fp8jax.formats import IEEE_FP8, KERNEL_FLOATS, float64_magnitude, fmt_max
from fp8jax.inline_ops import traced_inline
from fp8jax.kernels import tpu_telemetry
from fp8jax.quant import QTensor, divide_by_scale, is_quantized, scale_values
from fp8jax.scaling import (
    amax_input,
    exact_div,
    finite_amax,
    finite_magnitude_bits,
    magnitude_bits_value,
)
from fp8jax.schemes import element_scale


def clip_threshold(fmt) -> float:
    """max + ulp(max) / 2: the smallest |x / s| that a saturating cast clips."""
    m = fmt_max(fmt)
    # ulp at max: 2^(floor(log2 max) - mantissa bits).
    ulp = 2.0 ** (math.floor(math.log2(m)) - int(jnp.finfo(fmt).nmant))
    return m + ulp / 2


def _clip_test(platform: str) -> str:
    """How ``platform`` tests for clipping: where float64 costs XLA least to compile (a
    CPU), the exact product; elsewhere the quotient the quantizer casts.  The same answers."""
    return "product" if platform == "cpu" else "quotient"


def _clipped_as(how: str, xf: jax.Array, q: QTensor) -> jax.Array:
    """:func:`_clipped` by the test ``how`` ("product" or "quotient")."""
    s = jnp.broadcast_to(element_scale(q), xf.shape)
    test = _clipped_by_product if how == "product" else _clipped_by_quotient
    return test(xf, s, t=clip_threshold(q.data.dtype))


def _clipped(xf: jax.Array, q: QTensor) -> jax.Array:
    """Per element of float32 ``xf``: whether the saturating cast of ``q`` clips it."""
    return platforms.choose(_clip_test, lambda how: partial(_clipped_as, how), (xf, q))


@traced_inline
def _clipped_by_quotient(xf: jax.Array, s: jax.Array, t: float) -> jax.Array:
    """|x / s| > t with the quantizer's own quotient (:func:`fp8jax.quant.divide_by_scale`)."""
    # The quantizer's own division: a plain one would flush a subnormal scale
    # to zero on CPU, and every element of its group would read as clipped.
    y = divide_by_scale(jnp.where(jnp.isfinite(xf), xf, 0.0), s)
    # Positive scales only, read on the bit patterns (a subnormal one counts).
    has_scale = lax.bitcast_convert_type(s, jnp.int32) > 0
    return (jnp.abs(y) > t) & has_scale


@traced_inline
def _clipped_by_product(xf: jax.Array, s: jax.Array, t: float) -> jax.Array:
    """:func:`_clipped_by_quotient`'s answer as |x| > (t + ulp(t) / 2) * s, exact in float64.

    The correctly rounded quotient exceeds t (whose last significand bit is
    0, so a tie rounds down to it) exactly where the real one exceeds the
    midpoint t + ulp(t) / 2, a number of 25 significant bits at most: its
    product with a 24-bit scale is exact in float64, and so is |x|
    (:func:`fp8jax.formats.float64_magnitude`, subnormals included).  NaN
    and +-Inf elements, and elements without a positive scale, are not clipped.
    """
    midpoint = float(np.float32(t)) + float(np.spacing(np.float32(t))) / 2
    bits = lax.bitcast_convert_type(xf, jnp.int32) & 0x7FFFFFFF
    has_scale = lax.bitcast_convert_type(s, jnp.int32) > 0
    with jax.enable_x64(True):
        over = float64_magnitude(xf) > np.float64(midpoint) * float64_magnitude(s)
    return over & (bits < 0x7F800000) & has_scale


def _flushed(magnitude_bits: jax.Array, y: jax.Array) -> jax.Array:
    """Per element of x: finite and non-zero, but zero in ``y``.

    ``magnitude_bits``: :func:`fp8jax.scaling.finite_magnitude_bits` of x.
    Finite and non-zero is read on x's bit patterns: XLA's CPU compares a
    subnormal with zero as zero in some kernels and not in others.
    """
    zero = jnp.asarray(y).astype(jnp.float32) == 0
    return (magnitude_bits > 0) & zero


def saturated_fraction(x: jax.Array, q: QTensor) -> jax.Array:
    """Fraction of x clipped by the saturating cast of ``q`` (see module docstring).

    |x / s| with each element's own scale s (:func:`fp8jax.schemes.element_scale`),
    the same correctly rounded quotient the FP8 quantizer casts; an element
    without a positive float32 scale (a block format's all-zero or NaN block)
    is not counted.
    """
    return _share(jnp.sum(_clipped(x.astype(jnp.float32), q).astype(jnp.int32)), x.size)


def flushed_fraction(x: jax.Array, y: jax.Array) -> jax.Array:
    """Fraction of all elements of ``x`` that are finite and non-zero but zero in ``y``.

    ``y``: the codes of x's quantization, or the values they represent (the
    same zeros: scales are positive), or any cast of x.  The denominator is
    every element (not only the non-zero ones), as for ``saturated``: the
    two are shares of the same population, add up across a tensor's parts,
    and a tensor's exact zeros (padding, masked rows) lower the share of its
    inputs that lost their value, as they lower the damage done.  Computed
    in float32: float64 inputs below float32's range count as zeros.
    """
    xf = jnp.asarray(x).astype(jnp.float32)
    return _share(jnp.sum(_flushed(finite_magnitude_bits(xf), y).astype(jnp.int32)), xf.size)


def _share(count: jax.Array, n: int) -> jax.Array:
    """count / n, correctly rounded to float32 (an exact count of elements: below 2^31)."""
    # exact_div: XLA would turn a division by the constant n into a multiply
    # by its rounded reciprocal, an ulp off in some cases.
    return exact_div(count.astype(jnp.float32), jnp.float32(max(n, 1)))


@traced_inline
def operand_stats(x: jax.Array, op) -> dict[str, jax.Array]:
    """{"amax", "saturated", "flushed"} of one GEMM operand (x before, ``op`` after quantization).

    An operand that was not quantized (a plain array) reports zeros for both
    fractions.  A quantized one: the three in one reduction over x (a compiler
    pays per kernel, and a model has three such operands per GEMM): the max
    of the finite magnitudes' bit patterns (:func:`fp8jax.scaling.finite_amax`'s
    value) and integer counts of the clipped and flushed elements, each
    divided by the element count and rounded once to float32: the values of
    :func:`saturated_fraction` and :func:`flushed_fraction`.  On a TPU, an
    operand in 1x128 tiles along its last axis or in 128x128 blocks is
    counted by a Pallas kernel (:mod:`fp8jax.kernels.tpu_telemetry`, the same
    integers), which reads each tile's scale where XLA would write every
    element's to HBM first.
    """
    zero = jnp.zeros((), jnp.float32)
    if x.size == 0:
        return {"amax": zero, "saturated": zero, "flushed": zero}
    if not is_quantized(op):
        return {"amax": finite_amax(x), "saturated": zero, "flushed": zero}
    x = amax_input(x)
    kernel = _kernel_fits(x, op)
    # One platform choice for the whole count (the clip test's, a TPU's kernel).
    bits, clipped, flushed = platforms.choose(
        lambda p: "tpu kernel" if kernel and p == "tpu" else _clip_test(p),
        lambda how: _counts_tpu if how == "tpu kernel" else partial(_counts, how=how),
        (x, op),
    )
    return {
        "amax": magnitude_bits_value(bits, x.dtype),
        "saturated": _share(clipped, x.size),
        "flushed": _share(flushed, x.size),
    }


def _counts(
    x: jax.Array, op: QTensor, how: str = "product"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(max finite magnitude bits in x's width, clipped count, flushed count), int32, by
    XLA's reduction; ``how``: the clip test (:func:`_clip_test`; a CPU's by default)."""
    xf = x.astype(jnp.float32)
    mag = finite_magnitude_bits(x)
    parts = (
        mag.astype(jnp.int32),
        _clipped_as(how, xf, op).astype(jnp.int32),
        _flushed(mag, op.data).astype(jnp.int32),
    )

    def combine(a, b):
        return (jnp.maximum(a[0], b[0]), a[1] + b[1], a[2] + b[2])

    zeros = tuple(jnp.int32(0) for _ in parts)
    return lax.reduce(parts, zeros, combine, tuple(range(x.ndim)))


def _kernel_fits(x: jax.Array, op: QTensor) -> bool:
    """Whether the TPU kernel counts ``op``: FP8 codes of bfloat16 / float32 values in
    1x128 tiles along the last axis or in 128x128 blocks."""
    lay = op.layout
    return (
        op.scheme == "fp8"
        and op.tensor_scale is None
        and x.ndim >= 2
        and lay.tile == tpu_telemetry.GROUP
        and (lay.blocked or (lay.tiled and lay.axis == x.ndim - 1))
        and jnp.dtype(op.data.dtype) in IEEE_FP8
        and jnp.dtype(x.dtype) in KERNEL_FLOATS
        and op.data.shape == x.shape
    )


def _kernel_rows(x: jax.Array, op: QTensor) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x, codes, each row's scale per 128-column group) as the TPU kernel's 2-D arrays
    (an operand :func:`_kernel_fits`)."""
    c = x.shape[-1]
    scale = scale_values(op)
    if op.layout.blocked:
        # A block's scale on each of its rows: (..., R, groups).
        scale = jnp.repeat(scale, tpu_telemetry.GROUP, axis=-2)[..., : x.shape[-2], :]
    groups = -(-c // tpu_telemetry.GROUP)
    return x.reshape(-1, c), op.data.reshape(-1, c), scale.reshape(-1, groups)


def _kernel_counts(
    x: jax.Array, op: QTensor, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_counts` by the Pallas TPU kernel (``interpret``: its interpret mode)."""
    count = partial(
        tpu_telemetry.operand_counts,
        threshold=clip_threshold(op.data.dtype),
        interpret=interpret,
    )
    bits, clipped, flushed = count(*_kernel_rows(x, op))
    # The kernel reduces float32 bit patterns: a 16-bit value's are its own,
    # shifted up by 16 (exact), so shifting back gives x's width.
    if jnp.dtype(x.dtype).itemsize == 2:
        bits = lax.shift_right_logical(bits, jnp.int32(16))
    return bits, clipped, flushed


def _counts_tpu(x: jax.Array, op: QTensor) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`_kernel_counts`, traced and lowered for TPU only."""
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return platforms.only_on(("tpu",), _kernel_counts, x, op, out_shape=(scalar,) * 3)


def merge_operand_stats(
    stats_S: dict[str, jax.Array], n_S: jax.Array, n_valid_S: jax.Array | None = None
) -> dict[str, jax.Array]:
    """One operand's telemetry from its S shards' (each entry's leading axis: the shard).

    ``n_S``: the elements each shard's fractions are over; ``n_valid_S``:
    how many of them are the operand's own (default: all).  The rest are
    padding (the empty rows of an expert-parallel receive buffer), exact
    zeros, which are neither saturated nor flushed: the merged fractions are
    sum_s(fraction_s * n_s) / sum_s(n_valid_s), the shares of the operand's
    own elements, as one device holding all of them reports.  amax: the
    largest over the shards.  float32 throughout.
    """
    n = jnp.asarray(n_S, jnp.float32)
    valid = n if n_valid_S is None else jnp.asarray(n_valid_S, jnp.float32)
    total = jnp.sum(valid)
    # No elements anywhere: zero fractions, as operand_stats gives an empty operand.
    denom = jnp.where(total > 0, total, 1.0)

    def share(frac_S):
        return jnp.sum(frac_S.astype(jnp.float32) * n) / denom

    return {
        "amax": jnp.max(stats_S["amax"].astype(jnp.float32)),
        "saturated": share(stats_S["saturated"]),
        "flushed": share(stats_S["flushed"]),
    }
