"""Scales: online (current) scaling, power-of-two rounding, delayed scaling state.

Convention: ``x ~= data * scale`` with ``data = cast(x / scale)``; the scale
maps the tensor's amax onto the format's largest finite value:

    scale = max(amax, amax_floor) / fmt_max            (float32, correctly rounded)

Guards, and why:

* ``amax == 0`` (an all-zero tile) gives scale 1: any scale reproduces zeros.
* Tiny amax: the scale follows the same formula into float32's subnormal
  range (DeepSeek's act_quant does the same on a GPU).  XLA on CPU flushes
  subnormal operands to zero, so these scales are computed with integer
  arithmetic on the bit patterns (:func:`scale_from_amax`) and never depend
  on the backend's flush-to-zero mode.  A quotient that would round to 0 (amax
  below ~1e-43) gets the smallest subnormal, so no scale is ever 0.
* Huge amax: a scale is at most the largest float32 whose product with
  fmt_max is finite, so dequantizing the largest code never overflows; the
  few values of a tile with amax within an ulp of float32's max (within a
  factor 1.2 of it for power-of-two scales) saturate at fmt_max * scale.
* Non-finite elements are excluded from amax: the tile's scale comes from its
  finite elements, and NaN / Inf elements propagate as NaN / Inf codes (see
  :mod:`fp8jax.formats`).

``amax_floor``: an optional lower bound on amax, off (0) by default and in
every training preset.  :data:`DEEPSEEK_AMAX_FLOOR` (1e-4) is DeepSeek's
inference floor: ``act_quant`` clamps amax to 1e-4 since 2025-08-27
(DeepSeek-V3 ``inference/kernel.py``; V3.2-Exp), as DeepGEMM's
``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8`` do; DeepSeek-V3's 2024
``act_quant`` and the paper's training recipe have none.  A floor is harmful
for gradients, whose tiles are often far below 1e-4: the floor makes their
scale too large and flushes their elements to zero.

Power-of-two scales (``pow2=True``, DeepSeek's UE8M0) round the scale *up* to
``2^ceil(log2 scale)``, so ``x / scale`` never exceeds ``fmt_max`` (except
for the saturating cap above).

Delayed scaling (Transformer Engine / Flax fp8_ops): the scale used at step t
comes from an amax history of steps < t.  See :class:`DelayedState`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from fp8jax import platforms
from fp8jax.formats import (
    float32_bits_of_float64,
    float32_from_parts,
    float32_parts,
    float64_magnitude,
    fmt_max,
    ldexp_exact,
)
from fp8jax.inline_ops import clip, isfinite, isinf, traced_inline, where

if TYPE_CHECKING:
    # Type hints only: scaling sits below recipes and never imports it at run
    # time; it reads the few fields it needs (fmt, pow2, amax_floor, the
    # delayed settings) from the objects it is given.
    from fp8jax.recipes import DelayedConfig, QuantSpec, Recipe

# DeepSeek's inference amax floor (module docstring): act_quant since 2025-08-27, DeepGEMM.
DEEPSEEK_AMAX_FLOOR = 1e-4
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)
_ONE_BITS = 0x3F800000


#: The correctly rounded division of a kernel being traced, the division it takes
#: where a quotient is corrected afterwards, and whether it keeps subnormals
#: (see :func:`ieee_division`).
_DIVISIONS: list[tuple[Callable, Callable | None, bool]] = []


@contextmanager
def ieee_division(
    divide: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray],
    corrected: Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray] | None = None,
    *,
    keeps_subnormals: bool = False,
) -> Iterator[None]:
    """:func:`exact_div` traced inside the block is ``divide(num, den)``.

    For a kernel whose compiler lowers a float32 ``/`` to an approximation
    (Pallas Triton and Mosaic GPU: PTX ``div.full.f32``, up to 2 ulp off): it
    traces the quantizer's body here with the IEEE division its target has.
    ``corrected``: the division for quotients an integer remainder corrects
    afterwards (:func:`_subnormal_scale_bits`; any within one of the floor
    will do), where ``divide`` does not lower; by default ``divide``.
    ``keeps_subnormals``: ``divide`` is IEEE for subnormal operands and
    results too (PTX ``div.rn.f32``, no ``.ftz``), so :func:`divide_offset`
    divides directly, without its offset for tiny scales.
    The division is read when a body is traced and is no part of jax's trace
    caches' keys: trace the body inside the block itself, not a ``jax.jit``
    of a function that may have been traced (and cached) outside it.
    """
    _DIVISIONS.append((divide, corrected, keeps_subnormals))
    try:
        yield
    finally:
        _DIVISIONS.pop()


def exact_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """Correctly rounded ``num / den`` under XLA (or the division of :func:`ieee_division`).

    XLA rewrites ``a / broadcast(b)`` and ``a / constant`` into a multiply by
    the reciprocal, which is off by one ulp in about half the cases.  Adding
    ``num * 0`` makes the divisor an elementwise operand the simplifier cannot
    hoist, so the division is the IEEE one.  (``num`` must be finite where the
    result matters: ``inf * 0`` is NaN.)
    """
    if _DIVISIONS:
        return _DIVISIONS[-1][0](num, den)
    return num / (den + num * 0)


def _corrected_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """``num / den`` within one of its floor (for a quotient below 2^23), for callers that
    correct it with the integer remainder: :func:`exact_div` unless a kernel being
    traced gives another (:func:`ieee_division`)."""
    if _DIVISIONS and _DIVISIONS[-1][1] is not None:
        return _DIVISIONS[-1][1](num, den)
    return exact_div(num, den)


# Below this scale an element's quotient can be lost to flush-to-zero
# (|x| < 2^-126 and |x / scale| >= 2^-30): :func:`divide_offset` shifts it.
OFFSET_SCALE = 2.0**-96
OFFSET_SCALE_BITS = int(np.float32(OFFSET_SCALE).view(np.int32))
OFFSET = 64


@traced_inline
def divide_offset(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """x / scale (broadcasting) in float32, correctly rounded under flush-to-zero too
    wherever |x / scale| >= 2^-30 (a smaller quotient may come out as zero).

    Where a scale is below 2^-96 the group is divided as (x * 2^64) /
    (scale * 2^64), both factors formed exactly (:func:`shift_offset`): the
    same quotient, which flush-to-zero cannot lose.
    +-Inf elements stay +-Inf.  The quantizer's division on CPUs and TPUs.
    """
    if _DIVISIONS and _DIVISIONS[-1][2]:
        # A kernel's division that keeps subnormals: the same correctly rounded
        # quotient without the offset (a third of the per-element code).
        return where(isinf(x), x, exact_div(x, scale))
    # Branch-free: every group is shifted by k = 64 (tiny scale) or 0 (an
    # exact identity), so the whole division stays one elementwise fusion; a
    # lax.cond between the two would make XLA materialize float32 copies of
    # x and of the quotient as the branches' operand and result.
    shifted = (lax.bitcast_convert_type(scale, jnp.int32) & 0x7FFFFFFF) < OFFSET_SCALE_BITS
    # Finite x that overflow once shifted are far beyond fmt_max * scale:
    # float32's max keeps them finite so that they saturate.
    xs = clip(shift_offset(x, shifted), -_F32_MAX, _F32_MAX)
    # The scale (positive, finite) times 2^64 by the same exact product as x's.
    y = exact_div(xs, shift_offset(scale, shifted))
    return where(isinf(x), x, y)


def shift_offset(x: jnp.ndarray, shifted: jnp.ndarray) -> jnp.ndarray:
    """x * 2^64 where ``shifted`` (else x), exact: :func:`ldexp_exact` with k in {0, 64}.

    Per element, so cheap: a normal x times 2^64 is an exact float product (or
    overflows to +-Inf, as ldexp_exact's does); a subnormal x is m * 2^-149
    with an integer m < 2^23, so x * 2^64 = float(m) * 2^-85, both factors
    normal (no flush-to-zero can touch it).  NaN and +-Inf pass through.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    mag = bits & 0x7FFFFFFF
    from_mantissa = mag.astype(jnp.float32) * jnp.float32(2.0 ** (OFFSET - 149))
    tiny = where(bits < 0, -from_mantissa, from_mantissa)
    out = where(mag < 0x00800000, tiny, x * jnp.float32(2.0**OFFSET))
    return where(shifted, out, x)


@traced_inline
def exact_product(d: jnp.ndarray, scale: jnp.ndarray, fmt) -> jnp.ndarray:
    """d * scale rounded once to float32, on the bit patterns (subnormals kept).

    ``d`` holds FP8 values (as float32), so its significand has at most
    nmant + 1 bits and the integer product with the scale's 24-bit
    significand fits in int32.
    """
    shift = 23 - int(ml_dtypes.finfo(fmt).nmant)
    nd, md, ed = float32_parts(d)
    ns, ms, es = float32_parts(scale)
    out = float32_from_parts(nd ^ ns, (md >> shift) * ms, ed + shift + es)
    # NaN / Inf codes propagate (scales are positive).
    return where(isfinite(d), out, d)


def exact_product_float64(d: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """:func:`exact_product`'s value (d * scale rounded once to float32, subnormals kept)
    by float64 arithmetic, for FP8 values ``d`` (at most 7 significant bits) and
    positive scales.

    The product of the exact float64 magnitudes
    (:func:`fp8jax.formats.float64_magnitude`) has at most 31 significant
    bits, so it is exact and normal in float64; it is rounded once
    (:func:`fp8jax.formats.float32_bits_of_float64`), so no denormal operand
    or result meets a backend that flushes them.  NaN and
    +-Inf codes propagate, with d's sign.
    """
    with jax.enable_x64(True):
        mag = float32_bits_of_float64(float64_magnitude(d) * float64_magnitude(scale))
    sign = lax.bitcast_convert_type(d.astype(jnp.float32), jnp.int32) & jnp.int32(-(2**31))
    return lax.bitcast_convert_type(mag | sign, jnp.float32)


def finite_amax(x: jnp.ndarray, axis=None, keepdims: bool = False) -> jnp.ndarray:
    """max |x| over ``axis`` in float32, ignoring NaN and +-Inf elements; 0 if empty.

    Reduced on the bit patterns (for non-negative floats the int32 order is
    the float order), so a group of float32 subnormals gets its true amax
    where XLA on CPU would flush it to 0.
    """
    x = amax_input(x)
    # A CUDA GPU keeps subnormals in float arithmetic, so the float reduction
    # is exact there, and XLA runs it as one reduction kernel; on integer bit
    # patterns it transposes the tensor first when the groups run along a
    # major axis (a 128-token tile).  Elsewhere (CPU, TPU) subnormals may be
    # flushed: the bit patterns, on a CPU in runs of 32 (_bits_amax).
    ways = {"float": _float_amax, "bits": _bits_amax, "runs": partial(_bits_amax, runs=32)}
    return platforms.choose(
        lambda p: {"cuda": "float", "cpu": "runs"}.get(p, "bits"),
        lambda how: partial(ways[how], axis=axis, keepdims=keepdims),
        (x,),
    )


def amax_input(x: jnp.ndarray) -> jnp.ndarray:
    """x in the dtype its amax is reduced in: bfloat16 / float16 as they are, else float32.

    The 16-bit formats are reduced on their own bit patterns and the max cast
    after (exact): XLA then keeps no float32 copy of x for the reduction to
    share with the quantizer's division.
    """
    if jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return x
    return x.astype(jnp.float32)


@traced_inline
def _float_amax(x: jnp.ndarray, axis, keepdims: bool) -> jnp.ndarray:
    """:func:`finite_amax` in float arithmetic (exact where subnormals are kept)."""
    mag = where(jnp.isfinite(x), jnp.abs(x), jnp.zeros((), x.dtype))
    return jnp.max(mag, axis=axis, keepdims=keepdims, initial=0).astype(jnp.float32)


@traced_inline
def _bits_amax(x: jnp.ndarray, axis, keepdims: bool, runs: int = 0) -> jnp.ndarray:
    """:func:`finite_amax` on the bit patterns (exact under flush-to-zero).

    ``runs``: each reduced axis longer than that (and a multiple of it) is
    reduced in two steps, over runs of ``runs`` elements and then over the
    runs' maxima: the same max (of integers), and XLA's CPU compiler makes
    the two reductions and the masking one kernel, where it splits a longer
    reduction into a reduce-window and a reduce, each a kernel, the masking
    a third.  The first step starts from 0 (magnitudes are >= 0), the
    second from the type's minimum: XLA would merge two alike reductions
    back into one.
    """
    bits = finite_magnitude_bits(x)
    axes = tuple(range(x.ndim)) if axis is None else tuple(np.atleast_1d(axis) % x.ndim)
    for a in sorted(axes, reverse=True):
        n = bits.shape[a]
        if runs and n > runs and n % runs == 0:
            split = bits.reshape(bits.shape[:a] + (n // runs, runs) + bits.shape[a + 1 :])
            bits = lax.reduce(split, np.zeros((), bits.dtype), lax.max, (a + 1,))
    amax = jnp.max(bits, axis=axes, keepdims=keepdims, initial=0)
    return magnitude_bits_value(amax, x.dtype)


def _magnitude_bits(x: jnp.ndarray):
    """(|x|'s bit patterns in x's own width, the pattern of +Inf); at or above it: NaN / Inf."""
    dt = jnp.dtype(x.dtype)
    nbits = 8 * dt.itemsize
    int_t = jnp.int16 if nbits == 16 else jnp.int32
    inf_bits = int(np.array(np.inf, dt).view(np.int16 if nbits == 16 else np.int32))
    return lax.bitcast_convert_type(x, int_t) & ((1 << (nbits - 1)) - 1), inf_bits


def finite_magnitude_bits(x: jnp.ndarray) -> jnp.ndarray:
    """|x|'s bit patterns in x's own width (int16 / int32), 0 for NaN and +-Inf.

    For non-negative floats the integer order is the float order, so the max
    of these is the bit pattern of the finite amax, exact for subnormals.
    """
    mag, inf_bits = _magnitude_bits(x)
    # Non-finite values would make the scale Inf/NaN for the whole group.
    return where(mag < inf_bits, mag, jnp.zeros((), mag.dtype))


def magnitude_bits_value(bits: jnp.ndarray, dtype) -> jnp.ndarray:
    """The float32 value of magnitude bit patterns of ``dtype`` (any integer type holding them)."""
    dt = jnp.dtype(dtype)
    int_t = jnp.int16 if dt.itemsize == 2 else jnp.int32
    return lax.bitcast_convert_type(bits.astype(int_t), dt).astype(jnp.float32)


@traced_inline
def pow2_ceil(scale: jnp.ndarray) -> jnp.ndarray:
    """Round a positive finite float32 scale up to the next power of two (exact).

    Uses the bit pattern: a float32 with zero mantissa bits is already a power
    of two; otherwise the exponent is bumped by one and the mantissa cleared.
    A subnormal scale (exponent bits 0) rounds up its integer mantissa.  The
    largest finite float32 rounds up to +Inf: callers cap the result.
    """
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    mant = bits & 0x007FFFFF
    exp_bits = bits & 0x7F800000
    up = where(mant != 0, exp_bits + 0x00800000, exp_bits)
    # Subnormal: value mant * 2^-149; the power of two above it is 2^ceil(log2 mant).
    sub = jnp.left_shift(1, 32 - lax.clz(jnp.maximum(mant - 1, 0)))
    up = where(exp_bits == 0, sub, up)
    return lax.bitcast_convert_type(up, jnp.float32)


def _odd_and_pow2(value: float) -> tuple[int, int]:
    """value = odd * 2^p for an integer-valued format max (448 = 7 * 2^6)."""
    n = int(value)
    if n != value or n <= 0:
        raise ValueError(f"format max {value} is not a positive integer")
    p = (n & -n).bit_length() - 1
    return n >> p, p


def _max_scale(fm: float, pow2: bool) -> float:
    """Largest float32 scale s (a power of two when pow2) with fm * s finite."""
    s = np.float32(_F32_MAX / fm)
    while float(s) * fm > _F32_MAX:
        s = np.nextafter(s, np.float32(0))
    if pow2:
        s = np.float32(2.0 ** np.floor(np.log2(float(s))))
    return float(s)


def _subnormal_scale_bits(amax: jnp.ndarray, fm: float) -> jnp.ndarray:
    """Bits of RN(amax / fm) where that quotient is below float32's normal range.

    With amax = m * 2^e and fm = o * 2^p, the quotient in units of 2^-149
    (the subnormal step) is num / den = m * 2^(e + 149 - p) / o: an integer
    division with remainder, rounded half to even.  Exact in int32 where the
    quotient is subnormal (num < o * 2^23 < 2^27); other lanes are discarded.
    The division is a float32 one (num has at most 24 significant bits and
    den is o * 2^k, both exact; the quotient, below 2^23, comes out within
    one of its floor) that the integer remainder corrects: one kernel on
    XLA CPU, which makes an integer division's producers and users kernels
    of their own.
    """
    o, p = _odd_and_pow2(fm)
    _, m, e = float32_parts(amax)
    t = e + 149 - p
    num = m << clip(t, 0, 7)
    den = jnp.int32(o) << clip(-t, 0, 24)  # beyond 2^24 the quotient is 0
    # The quotient is >= 0, so the conversion's truncation is its floor (and
    # Mosaic GPU, which has no floor, lowers it).
    q = _corrected_div(num.astype(jnp.float32), den.astype(jnp.float32)).astype(jnp.int32)
    rem = num - q * den
    low, high = rem < 0, rem >= den
    q = where(low, q - 1, where(high, q + 1, q))
    rem = where(low, rem + den, where(high, rem - den, rem))
    up = (2 * rem > den) | ((2 * rem == den) & ((q & 1) == 1))
    q = q + up.astype(jnp.int32)
    # A quotient that rounds to 0 would be a zero scale: smallest subnormal.
    return jnp.maximum(q, 1)


def _cap_bits(bits: jnp.ndarray, cap: float) -> jnp.ndarray:
    # Positive float32 bit patterns order like the floats, and an integer
    # min cannot be flushed to zero.
    cap_bits = int(np.float32(cap).view(np.int32))
    return jnp.minimum(bits, cap_bits)


def scale_from_amax(
    amax: jnp.ndarray,
    fmt,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
    arithmetic: str | None = None,
) -> jnp.ndarray:
    """float32 scale = max(amax, amax_floor) / fmt_max, with the module docstring's guards.

    ``amax`` must be finite and >= 0 (take it from :func:`finite_amax`).
    Normal-range scales are the correctly rounded float32 quotient (DeepSeek's
    act_quant computes amax / 448 in fp32); scales below float32's normal
    range are the correctly rounded subnormal quotient.  ``pow2`` rounds the
    scale up to a power of two.

    ``arithmetic`` says how the quotient is formed, with the same bits either
    way: "bits" (float32 division, and for quotients below float32's normal
    range an integer division on the bit patterns: any backend, a Pallas
    kernel's body included) or "float64" (one float64 division rounded once
    to float32, :func:`_quotient_bits_float64`; for a format max whose odd
    factor is below 32, every FP8 and FP4 format's).  None: "float64" on a
    CPU where it applies, a third of the operations for XLA to compile,
    "bits" elsewhere (TPUs have no float64).
    """
    if arithmetic is None:
        cpu = "float64" if _float64_exact(fmt_max(fmt)) else "bits"
        return platforms.choose(
            lambda p: cpu if p == "cpu" else "bits",
            lambda how: partial(
                scale_from_amax, fmt=fmt, pow2=pow2, amax_floor=amax_floor, arithmetic=how
            ),
            (amax,),
        )
    if arithmetic not in ("bits", "float64"):
        raise ValueError(f"arithmetic must be 'bits' or 'float64', got {arithmetic!r}")
    if arithmetic == "float64" and not _float64_exact(fmt_max(fmt)):
        raise ValueError(f"arithmetic='float64' needs a format max of odd factor < 32, got {fmt}")
    return _scale_from_amax(amax, fmt, pow2, amax_floor, arithmetic)


@traced_inline
def _scale_from_amax(amax, fmt, pow2: bool, amax_floor: float, arithmetic: str) -> jnp.ndarray:
    fm = fmt_max(fmt)
    amax = amax.astype(jnp.float32)
    if amax_floor > 0:
        amax = jnp.maximum(amax, jnp.float32(amax_floor))
    abits = lax.bitcast_convert_type(amax, jnp.int32) & 0x7FFFFFFF
    if arithmetic == "float64":
        bits = _quotient_bits_float64(amax, fm)
    else:
        # Quotients below 2^-126: an integer division (flush-to-zero cannot touch it).
        sub_limit = int(np.float32(fm * _F32_TINY).view(np.int32))
        tiny = abits < sub_limit
        # Correctly rounded amax / max on normal operands; tiny lanes use 1 as a
        # stand-in so that the float division never sees a subnormal.
        safe = where(tiny, jnp.float32(1.0), amax)
        # The format's max as a NumPy constant: a kernel's division can splat it.
        norm_bits = lax.bitcast_convert_type(exact_div(safe, np.float32(fm)), jnp.int32)
        bits = where(tiny, _subnormal_scale_bits(amax, fm), norm_bits)
    scale = lax.bitcast_convert_type(bits, jnp.float32)
    if pow2:
        scale = pow2_ceil(scale)
    bits = _cap_bits(lax.bitcast_convert_type(scale, jnp.int32), _max_scale(fm, pow2))
    # amax == 0: any scale reproduces the zeros; 1 keeps the data exact.
    bits = where(abits == 0, _ONE_BITS, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _float64_exact(fm: float) -> bool:
    """Whether :func:`_quotient_bits_float64` is exact for format max ``fm``: an
    integer whose odd factor is below 32 (448 = 7 * 2^6, 57344 = 7 * 2^13, 240, 6)."""
    return float(fm).is_integer() and fm > 0 and _odd_and_pow2(fm)[0] < 32


def _quotient_bits_float64(amax: jnp.ndarray, fm: float) -> jnp.ndarray:
    """Bits of RN(amax / fm) in float32, subnormal quotients included (amax finite,
    >= 0; at least one: a quotient that rounds to 0 gets the smallest subnormal),
    by float64 arithmetic.

    Exact, whatever the backend flushes: amax enters float64 exactly
    (:func:`fp8jax.formats.float64_magnitude`), the quotient is a normal float64 (above
    2^-159), and it is rounded once more
    (:func:`fp8jax.formats.float32_bits_of_float64`: no denormal is formed).
    Two roundings give the correctly rounded quotient: the float64 rounding
    point sits at least 29 bits below the float32 one, so it lands on a
    float32 midpoint that is not the quotient itself only if the 28 bits
    between them are equal.  With fm = odd * 2^p and odd < 32
    (:func:`_float64_exact`), amax / fm is exact or a purely periodic binary
    fraction of period ord_odd(2) <= 28, which holds no such run.  The tests
    compare it with the integer version on every boundary.
    """
    with jax.enable_x64(True):
        q = exact_div(float64_magnitude(amax), np.float64(fm))
        # A quotient that rounds to 0 would be a zero scale: smallest subnormal
        # (a normal quotient's bits are far above 1).
        return jnp.maximum(float32_bits_of_float64(q), 1)


def scale_limit(fmt, pow2: bool = False) -> float:
    """The largest scale :func:`scale_from_amax` returns for ``fmt`` (see the module docstring)."""
    return _max_scale(fmt_max(fmt), pow2)


# --------------------------------------------------------------------------
# Delayed scaling state
# --------------------------------------------------------------------------


class DelayedState(NamedTuple):
    """Delayed-scaling state of one operand (per-tensor).

    amax_history: float32 (history_len,), newest first.
    scale: float32 (), the scale to use at the *next* quantization.

    A fresh state has scale 1 and an all-zero history: at the first step
    every value above fmt_max clips (the known failure of delayed scaling on a
    fresh state), which experiments reproduce on purpose.

    A valid state (:func:`check_delayed_state`) has a non-empty 1-D history
    and a finite scale in float32's normal range: a subnormal scale is
    flushed to zero by XLA on CPU inside the GEMM (NaN outputs), and
    :func:`update_delayed_state` never produces one.
    """

    amax_history: jnp.ndarray
    scale: jnp.ndarray


class DelayedGemmState(NamedTuple):
    """Delayed-scaling state of the operands of one linear layer's GEMMs.

    ``x`` serves fprop and wgrad, ``w`` fprop and dgrad, ``dy`` dgrad and
    wgrad: one history per tensor, as in Transformer Engine.

    Update rule ("overwrite with gradient"): ``fp8jax.dot_general`` returns,
    as the cotangent of this state, the *updated* state (history rolled with
    this step's amax in front, scale recomputed).  A training step takes
    ``jax.grad`` with respect to the state and replaces the state by that
    gradient instead of applying the optimizer to it.  Because ``dy`` is only
    seen in the backward pass, an explicit forward return value could not
    carry its amax; the gradient can.
    """

    x: DelayedState
    w: DelayedState
    dy: DelayedState


def init_delayed_state(history_len: int) -> DelayedState:
    return DelayedState(jnp.zeros((history_len,), jnp.float32), jnp.ones((), jnp.float32))


def check_delayed_state(state: DelayedState, fmt=None, *, pow2: bool = False) -> None:
    """Refuse, with a one-line ValueError, a state no update can have produced.

    Always (shapes): ``amax_history`` 1-D and non-empty, ``scale`` a
    scalar.  Where the values are concrete (not traced under ``jit``):
    ``scale`` finite and at least float32's smallest normal (0, NaN, Inf and
    subnormal scales give NaN outputs), and with ``fmt`` at most
    :func:`scale_limit` (so that fmt_max * scale is finite), and no history
    entry negative (an amax is a magnitude: no update records one below 0).
    NaN and +Inf history entries are allowed: an update records them from a
    tensor holding NaN or Inf, and :func:`history_amax` ignores them.
    """
    hist, scale = state.amax_history, state.scale
    if np.ndim(hist) != 1 or np.shape(hist)[0] == 0:
        raise ValueError(
            f"delayed-scaling state: amax_history must be a non-empty 1-D array, got shape "
            f"{list(np.shape(hist))} (make one with fp8jax.scaling.init_delayed_state)"
        )
    if np.ndim(scale) != 0:
        raise ValueError(
            f"delayed-scaling state: scale must be a scalar, got shape {list(np.shape(scale))}"
        )
    if not isinstance(hist, jax.core.Tracer):
        h = np.asarray(hist, np.float32)
        if (h < 0).any():
            raise ValueError(
                f"delayed-scaling state: amax_history holds {float(h[h < 0][0])!r}, but an amax "
                "is a magnitude (>= 0); start from fp8jax.scaling.init_delayed_state or a saved state"
            )
    if isinstance(scale, jax.core.Tracer):
        return
    value = float(np.asarray(scale, np.float32))
    limit = scale_limit(fmt, pow2) if fmt is not None else _F32_MAX
    if not (math.isfinite(value) and _F32_TINY <= value <= limit):
        raise ValueError(
            f"delayed-scaling state: scale {value!r} is not a finite float32 in "
            f"[{_F32_TINY:.6g}, {limit:.6g}] (outside it the GEMM's outputs are NaN or Inf); "
            "start from fp8jax.scaling.init_delayed_state or a saved state"
        )


def init_delayed_gemm_state(recipe: Recipe) -> DelayedGemmState:
    """A fresh state (scale 1, empty history) for every operand of a GEMM."""
    n = recipe.delayed.history_len
    return DelayedGemmState(init_delayed_state(n), init_delayed_state(n), init_delayed_state(n))


def history_amax(history: jnp.ndarray, algo: str) -> jnp.ndarray:
    """The amax a delayed scale is computed from, ignoring non-finite entries.

    ``"max"``: the largest finite entry; ``"most_recent"``: the newest finite
    entry.  0 when no entry is finite (the fresh-state rule: scale 1).  A
    NaN or Inf can only reach a history from outside (a restored or edited
    state); ignoring it keeps the scale that the finite history implies
    instead of silently resetting the scale to 1 (NaN) or zeroing the
    output (Inf).
    """
    if algo == "max":
        return finite_amax(history)
    finite = jnp.isfinite(history)
    newest = history[jnp.argmax(finite)]
    return where(jnp.any(finite), newest, jnp.float32(0.0))


def update_delayed_state(
    state: DelayedState, amax: jnp.ndarray, spec: QuantSpec, cfg: DelayedConfig
) -> DelayedState:
    """Roll the history, insert this step's amax, recompute the scale.

    scale = 2^margin * amax_ref / fmt_max with amax_ref from
    :func:`history_amax` (the max of the history for algo "max", its newest
    entry for "most_recent"; non-finite entries ignored).  An empty history
    (all zeros) keeps scale 1 via the amax == 0 guard.  The scale is capped
    like any scale (:func:`scale_limit`), so a large margin cannot overflow,
    and floored at float32's smallest normal (2^-126), so a tiny amax or a
    negative margin cannot give a scale the GEMM would flush to zero.
    """
    check_delayed_state(state)
    hist = jnp.roll(state.amax_history, 1).at[0].set(amax.astype(jnp.float32))
    ref = history_amax(hist, cfg.algo)
    scale = scale_from_amax(ref, spec.fmt, pow2=spec.pow2, amax_floor=spec.amax_floor)
    # The margin leaves 2^margin of headroom above the recorded amax; applied
    # on the bits so that a subnormal scale is not flushed to zero.
    scale = ldexp_exact(scale, cfg.margin)
    limit = scale_limit(spec.fmt, spec.pow2)
    bits = _cap_bits(lax.bitcast_convert_type(scale, jnp.int32), limit)
    # A subnormal scale reads as 0 in XLA's float arithmetic on CPU (the next
    # step's outputs would be NaN): the smallest normal scale instead, on the
    # bits (positive float32 patterns order like the floats).
    bits = jnp.maximum(bits, int(np.float32(_F32_TINY).view(np.int32)))
    return DelayedState(hist, lax.bitcast_convert_type(bits, jnp.float32))


def updated_gemm_state(state: DelayedGemmState | None, new_x, new_w, new_dy):
    """The overwrite-with-gradient cotangent of a GEMM's state.

    Each operand's entry is its updated state where the GEMM quantized it
    with delayed scaling (``new_*`` not None), else the state unchanged.
    """
    if state is None:
        return None
    return DelayedGemmState(
        new_x if new_x is not None else state.x,
        new_w if new_w is not None else state.w,
        new_dy if new_dy is not None else state.dy,
    )


def merge_delayed_states(a, b):
    """Merge the updated states of two microbatches: elementwise max.

    Each microbatch's update rolls the *same* previous history and writes its
    own amax in front; the merged history must hold the max amax (summing the
    "gradients" as for parameters would double it), and the larger scale is
    the one computed from that max.
    """
    return jax.tree.map(jnp.maximum, a, b)
