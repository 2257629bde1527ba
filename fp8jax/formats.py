"""FP8 / low-precision formats and the saturating cast.

A *format* here is a numpy/ml_dtypes dtype (``fp8jax.E4M3`` is
``ml_dtypes.float8_e4m3fn``).  ``fmt_max(fmt)`` is the largest finite value.

Why a saturating cast: ``x.astype(float8_e4m3fn)`` does not saturate; values
past the largest finite value become NaN on CPU (E4M3FN has no Inf), and to
Inf for E5M2.  FP8 training wants saturation: a value above the range is
clipped to +-max, the nearest representable value in magnitude.

``saturating_cast`` semantics (all formats):

* finite x: clipped to [-max, max], then rounded to nearest-even;
* non-finite x propagates: NaN becomes the format's NaN code; +-Inf becomes
  +-Inf where the format has an Inf (E5M2) and the NaN code where it has
  none (E4M3, the FNUZ formats).  A diverging activation then makes the GEMM
  output non-finite, as it would in bf16, instead of being masked as +-max.
  Scale computation ignores non-finite elements (see ``scaling``), so the
  finite elements of the tile keep their precision.

Flush-to-zero: XLA on CPU treats float32 subnormal operands and results of
arithmetic as zero.  :func:`float32_parts`, :func:`float32_from_parts` and
:func:`ldexp_exact` work on the bit patterns instead, so code that must see
subnormals (tiny scales, tiny tiles) stays exact on every backend.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from fp8jax import platforms
from fp8jax.inline_ops import clip, isinf, traced_inline, where

E4M3 = jnp.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = jnp.dtype(ml_dtypes.float8_e5m2)
# The OCP FP8 formats (a sign bit, +-0, no offset on the exponent bias): their
# codes follow from a float32's bit pattern by integer arithmetic alone, and
# they are the codes FP8 tensor cores, the MXU and this package's kernels take.
IEEE_FP8 = (E4M3, E5M2)
# The wide floats this package's Pallas kernels read and write: the values a
# quantizer or telemetry kernel takes, the dtype a GEMM kernel's epilogue rounds to.
KERNEL_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
E4M3FNUZ = jnp.dtype(ml_dtypes.float8_e4m3fnuz)
E5M2FNUZ = jnp.dtype(ml_dtypes.float8_e5m2fnuz)
E8M0 = jnp.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = jnp.dtype(jnp.bfloat16)
# FP4 E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6; no Inf, no NaN): the elements of NVFP4.
E2M1 = jnp.dtype(ml_dtypes.float4_e2m1fn)

# Block-scaled formats (fp8jax.microscaling): elements per scale along the
# contraction axis.  MXFP8: E4M3 + E8M0 scales; NVFP4: E2M1 + E4M3 scales.
BLOCK_FORMATS: dict[str, int] = {"mxfp8": 32, "nvfp4": 16}

FORMATS: dict[str, jnp.dtype] = {
    "e4m3": E4M3,
    "e5m2": E5M2,
    "e4m3fnuz": E4M3FNUZ,
    "e5m2fnuz": E5M2FNUZ,
    "e8m0": E8M0,
}


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


@traced_inline
def saturate(x: jnp.ndarray, fmt, *, assume_finite: bool = False) -> jnp.ndarray:
    """x clipped to +-fmt_max, +-Inf and NaN kept: what :func:`saturating_cast` casts.

    float32 (or float64) stays as it is; narrower inputs become float32.
    """
    m = fmt_max(fmt)
    # Clip in the input's own precision when it is float32/float64 so that the
    # rounding of the cast happens exactly once (from x), never twice.
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits < 32:
        x = x.astype(jnp.float32)
    if assume_finite:
        return clip(x, -m, m)
    # Finite values saturate; +-Inf bypasses the clip so that the cast maps it
    # to the format's Inf or NaN code (clip leaves NaN unchanged).
    return where(isinf(x), x, clip(x, -m, m))


#: The smallest operand whose FP8 codes a CPU computes with :func:`fp8_codes`;
#: smaller ones take XLA's own conversion.  Measured on a 2-core AMD EPYC
#: (docs/benchmarks.md): at 2048 x 2048 the integer codes take 0.6 ms against
#: the conversion's 1.3 ms, while in a program of small operands (the tiny
#: model's train step) their larger kernels cost some 0.4 s of its compile.
#: Below 2^20 elements the conversion's extra time is under 0.2 ms a call.
CPU_CODES_MIN_SIZE = 1 << 20


def saturating_cast(x: jnp.ndarray, fmt, *, assume_finite: bool = False) -> jnp.ndarray:
    """Cast to ``fmt`` with saturation (see module docstring).

    Finite values are clipped to +-max before the cast so that the cast's
    round-to-nearest-even never sees a value outside the range; NaN is cast
    to the format's NaN; +-Inf to the format's +-Inf, or its NaN code where
    it has no Inf (E4M3).  ``assume_finite`` promises x holds no +-Inf and
    skips that select (fp8jax.rounding's casts, which clip first).  float32 to E4M3FN / E5M2
    of at least :data:`CPU_CODES_MIN_SIZE` elements on a CPU goes through
    :func:`fp8_codes` (the cast's codes, on the bit patterns).
    """
    fmt = as_format(fmt)
    y = saturate(x, fmt, assume_finite=assume_finite)
    if fmt in IEEE_FP8 and y.dtype == jnp.float32:
        # The same codes either way: integer arithmetic on XLA CPU, whose own
        # conversion is a slow scalar routine, where the operand is large
        # enough for that to matter; the hardware conversion on GPUs and
        # TPUs, where the integer version splits the quantizer's one pass
        # into several kernels.
        cpu = "bits" if y.size >= CPU_CODES_MIN_SIZE else "convert"
        return platforms.choose(
            lambda p: cpu if p == "cpu" else "convert",
            lambda how: partial(_codes_once, fmt=fmt) if how == "bits" else lambda v: v.astype(fmt),
            (y,),
        )
    return y.astype(fmt)


def _codes_once(y: jnp.ndarray, fmt) -> jnp.ndarray:
    """:func:`fp8_codes` of ``y``, materialized: every consumer reads the bytes.

    Without the barrier XLA's CPU compiler fuses the integer rounding (about
    twenty operations an element) into each consumer of the codes: the
    GEMM's conversion of the codes to bfloat16 and the telemetry's flushed
    count each compiled and ran it again, and the quotient they shared was
    written to memory in float32 between them.  Behind the barrier it is
    one pass, division and rounding, that writes one byte an element.
    """
    return lax.optimization_barrier(fp8_codes(y, fmt))


@traced_inline
def fp8_codes(y: jnp.ndarray, fmt) -> jnp.ndarray:
    """``y.astype(fmt)`` for float32 ``y`` whose finite values lie within +-fmt_max.

    Round to nearest, ties to even, exactly as the cast, computed on the bit
    patterns with integer adds and shifts (plus one float add for the
    subnormal codes).  Why: XLA's CPU conversion to FP8 is a scalar-heavy
    routine, slower than an ``astype(bfloat16)`` of the same array (measured:
    docs/benchmarks.md); this one vectorises, and every operand of at least
    :data:`CPU_CODES_MIN_SIZE` elements a CPU quantizes goes through it.
    E4M3FN and E5M2 only; ``saturating_cast`` clips, then calls it.

    * normal results (|y| >= smallest normal): the float32 significand is
      rounded to the format's mantissa bits by adding half an ulp less one
      plus the kept lowest bit (ties to even), shifted down, and the exponent
      re-biased by a subtraction; a carry out of the mantissa raises the
      exponent, which is the right code.
    * NaN and +-Inf: the cast's codes with y's sign (NaN: 0x7F in E4M3FN,
      0x7E in E5M2; Inf: E5M2's 0x7C, E4M3FN's NaN code, having no Inf).
    * subnormal results: |y| + 2^(emin - nmant + 23) lands in a binade whose
      ulp is the format's subnormal step, so the float add rounds |y| to a
      multiple of that step (ties to even, in hardware); the integer
      difference of the bit patterns is the code (the smallest normal's code
      when it rounds up).  float32 subnormals read as 0 under flush-to-zero,
      and they round to 0 in either format anyway.
    """
    fmt = as_format(fmt)
    if fmt not in IEEE_FP8:
        raise ValueError(f"fp8_codes takes E4M3FN or E5M2, got {fmt}")
    info = ml_dtypes.finfo(fmt)
    nmant = int(info.nmant)
    emin = int(info.minexp)
    shift = 23 - nmant
    bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    half = (1 << (shift - 1)) - 1
    normal = ((mag + half + ((mag >> shift) & 1)) >> shift) - ((127 - (1 - emin)) << nmant)
    magic_bits = (emin - nmant + 23 + 127) << 23
    magic = np.array(magic_bits, np.int32).view(np.float32)
    absy = lax.bitcast_convert_type(mag, jnp.float32)
    sub = lax.bitcast_convert_type(absy + magic, jnp.int32) - magic_bits
    code = where(mag < ((emin + 127) << 23), sub, normal)
    nan_code, inf_code = (int(c) for c in np.float32([np.nan, np.inf]).astype(fmt).view(np.uint8))
    code = where(mag > _INF_BITS, nan_code, code)
    code = where(mag == _INF_BITS, inf_code, code) | sign
    return lax.bitcast_convert_type(code.astype(jnp.uint8), fmt)


# --------------------------------------------------------------------------
# UE8M0 scales: power-of-two float32 scales as E8M0 bytes, and back
# --------------------------------------------------------------------------

# E8M0 (OCP MX's scale type, DeepSeek's "UE8M0"): a bare biased exponent,
# code c in 0..254 is 2^(c - 127), 255 is NaN.  Its bias is float32's, so a
# normal power of two's exponent field is its code.  2^-127 (code 0) is a
# float32 subnormal (bit 22 of the mantissa); smaller powers of two have no
# code.
E8M0_MIN_BITS = 0x00400000  # 2^-127 as float32 bits
E8M0_NAN_CODE = 0xFF
# How a quantized operand stores its scales: float32, or E8M0 bytes (powers of two).
SCALE_FMTS = ("float32", "ue8m0")


def check_scale_fmt(scale_fmt: str, pow2: bool) -> None:
    """One line for a scale format that is unknown or needs power-of-two scales."""
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if scale_fmt == "ue8m0" and not pow2:
        raise ValueError("scale_fmt='ue8m0' stores power-of-two scales (E8M0 bytes): set pow2=True")


def _e8m0_codes(bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(code, representable) of float32 bit patterns: a power of two in [2^-127, 2^127]."""
    exp_field = bits >> 23
    mant = bits & 0x7FFFFF
    normal_pow2 = (bits > 0) & (mant == 0) & (exp_field >= 1) & (exp_field <= 254)
    ok = normal_pow2 | (bits == E8M0_MIN_BITS)
    return where(bits == E8M0_MIN_BITS, 0, exp_field), ok


@traced_inline
def encode_e8m0(scale: jnp.ndarray) -> jnp.ndarray:
    """Power-of-two float32 scales -> E8M0 bytes (exact), never a rounding.

    Every scale must be a power of two in [2^-127, 2^127]; anything else (a
    scale that is not a power of two, 0, a negative, NaN / Inf, a power of
    two below 2^-127) is refused: with concrete values a ``ValueError``;
    under ``jit`` (traced values cannot raise) its code is E8M0's NaN, so
    whatever is computed from it is NaN instead of silently off by up to 2x.
    Works on the bit patterns (no float arithmetic: flush-to-zero on CPU
    cannot touch 2^-127).
    """
    scale = jnp.asarray(scale)
    if scale.dtype != jnp.float32:
        raise ValueError(f"encode_e8m0 takes float32 scales, got {scale.dtype}")
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    code, ok = _e8m0_codes(bits)
    if not isinstance(scale, jax.core.Tracer):
        bad = ~np.asarray(ok)
        if bad.any():
            first = np.asarray(scale).reshape(-1)[int(np.argmax(bad.reshape(-1)))]
            raise ValueError(
                f"UE8M0 scales must be powers of two in [2^-127, 2^127]: {int(bad.sum())} of "
                f"{bad.size} are not (e.g. {float(first)!r}); quantize with pow2=True"
            )
    code = where(ok, code, E8M0_NAN_CODE)
    return lax.bitcast_convert_type(code.astype(jnp.uint8), E8M0)


@traced_inline
def decode_e8m0(codes: jnp.ndarray) -> jnp.ndarray:
    """E8M0 bytes -> float32 2^(c - 127) (exact; code 0 is the subnormal 2^-127; 255 NaN)."""
    c = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
    bits = where(c == 0, E8M0_MIN_BITS, c << 23)
    bits = where(c == E8M0_NAN_CODE, 0x7FC00000, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


@traced_inline
def floor_e8m0(scale: jnp.ndarray) -> jnp.ndarray:
    """max(scale, 2^-127) on the bit patterns (positive float32 order as their bits).

    Power-of-two scales below E8M0's smallest value (tiles whose amax is
    below fmt_max * 2^-127) get 2^-127, the smallest scale a UE8M0 byte holds.
    """
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    return lax.bitcast_convert_type(jnp.maximum(bits, E8M0_MIN_BITS), jnp.float32)


# --------------------------------------------------------------------------
# float32 on its bit patterns (immune to flush-to-zero)
# --------------------------------------------------------------------------

_SIGN_BIT = -(2**31)  # 0x80000000 as an int32
_EXP_MASK = 0x7F800000
_INF_BITS = 0x7F800000
_F32_TINY = float(np.finfo(np.float32).tiny)


def float64_magnitude(x: jnp.ndarray) -> jnp.ndarray:
    """|x| of float32 ``x`` as float64: exact for every value, subnormals, +-Inf and NaN included.

    A float32 subnormal enters as its integer significand times 2^-149 (a
    normal float64), so no denormal operand is read and a backend that
    flushes them (XLA on CPU) cannot zero it.  Float64 arithmetic on such
    magnitudes and products of them stays in float64's normal range.
    """
    with jax.enable_x64(True):
        mag = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
        tiny = mag.astype(jnp.float64) * np.float64(2.0**-149)
        wide = lax.bitcast_convert_type(mag, jnp.float32).astype(jnp.float64)
        return where(mag < 0x00800000, tiny, wide)


def float32_bits_of_float64(p: jnp.ndarray) -> jnp.ndarray:
    """The int32 bit pattern of float64 ``p`` (>= 0, or NaN / +Inf) rounded once to float32,
    subnormals included.

    Below 2^-126 the result is p / 2^-149 rounded half to even, an integer
    (the subnormal's bit pattern, or the smallest normal's when it rounds
    up), so no denormal is formed for a backend to flush; elsewhere the
    conversion's correctly rounded float32.
    """
    with jax.enable_x64(True):
        small = p < np.float64(_F32_TINY)
        # Only the small lanes become integers (the others could overflow int32).
        steps = lax.round(
            where(small, p, 0.0) * np.float64(2.0**149), lax.RoundingMethod.TO_NEAREST_EVEN
        )
        normal = lax.bitcast_convert_type(p.astype(jnp.float32), jnp.int32)
        return where(small, steps.astype(jnp.int32), normal)


def float32_parts(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(negative, m, e) with ``|x| = m * 2^e`` exactly, read from x's float32 bits.

    ``m`` is the integer significand (hidden bit included for normals, so
    ``m < 2^24``) and ``e`` the exponent of its unit (-149 for subnormals).
    Subnormals come out exact although XLA on CPU would flush them in any
    float arithmetic.  Meaningless for non-finite x (callers mask those).
    """
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23
    mant = mag & 0x7FFFFF
    normal = exp > 0
    m = where(normal, mant | 0x800000, mant)
    e = where(normal, exp - 150, -149)
    return bits < 0, m, e


def _round_shift(m: jnp.ndarray, r: jnp.ndarray) -> jnp.ndarray:
    """round-half-even(m / 2^r) for int32 0 <= m < 2^30 and r >= 0."""
    r = clip(r, 0, 31)
    q = m >> r
    rem = m - (q << r)
    half = jnp.left_shift(1, jnp.maximum(r - 1, 0))
    up = (r > 0) & ((rem > half) | ((rem == half) & ((q & 1) == 1)))
    return q + up.astype(jnp.int32)


def float32_from_parts(negative: jnp.ndarray, m: jnp.ndarray, e: jnp.ndarray) -> jnp.ndarray:
    """The float32 nearest to ``(-1)^negative * m * 2^e`` (ties to even), built from bits.

    ``m`` is an int32 with 0 <= m < 2^30.  Results below float32's normal
    range are the correctly rounded subnormals (not flushed), results past
    its largest finite value are +-Inf.
    """
    m = m.astype(jnp.int32)
    e = e.astype(jnp.int32)
    top = 31 - lax.clz(m)  # index of the leading bit (-1 for m == 0)
    # Keep 24 significant bits, or stop at the subnormal unit 2^-149.
    r = jnp.maximum(top - 23, -149 - e)
    mm = where(r < 0, m << clip(-r, 0, 31), _round_shift(m, r))
    ee = e + r  # value = mm * 2^ee with mm <= 2^24
    # Exponent field of the result: ee + 150 for a normal mm in [2^23, 2^24)
    # (ee + 151 after a rounding carry to 2^24), 0 for a subnormal mm < 2^23.
    field = ee + 149 + (mm >> 23)
    bits = (jnp.minimum(ee + 149, 254) << 23) + mm
    bits = where(field >= 255, _INF_BITS, bits)
    bits = where(m == 0, 0, bits)
    bits = where(negative, bits | _SIGN_BIT, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


@traced_inline
def ldexp_exact(x: jnp.ndarray, k) -> jnp.ndarray:
    """``x * 2^k`` in float32, correctly rounded, subnormal inputs and results included.

    The product is formed on the bit patterns, so XLA's flush-to-zero on CPU
    cannot turn a subnormal ``x`` (or result) into 0.  Overflow gives +-Inf;
    NaN and +-Inf pass through.
    """
    x = x.astype(jnp.float32)
    neg, m, e = float32_parts(x)
    out = float32_from_parts(neg, m, e + jnp.asarray(k, jnp.int32))
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return where((bits & _EXP_MASK) == _EXP_MASK, x, out)


# E5M6 (DeepSeek-V3's cache format for the input of the linear after
# attention, emulated): 5 exponent bits (bias 15, E5M2's range), 6 mantissa bits.
E5M6_MANTISSA_BITS = 6
E5M6_MIN_EXP = -14
E5M6_MAX = (2.0 - 2.0**-E5M6_MANTISSA_BITS) * 2.0**15  # 65024 = 127 * 2^9


@traced_inline
def round_to_e5m6(x: jnp.ndarray) -> jnp.ndarray:
    """Round float32 values to the (emulated) E5M6 grid; float32 in, float32 out.

    E5M6 has 6 mantissa bits and E5's exponent range: normals from 2^-14,
    subnormals in steps of 2^-20, largest finite value 65024.  Rounding is to
    nearest, ties to even; finite values beyond +-65024 saturate to it; NaN
    and +-Inf propagate (an IEEE-style E5 format has Inf, as float16 does).
    Computed on the bit patterns (exact on every backend).  Every E5M6 value
    is exact in bfloat16 and float32.  This is the element cast only: the
    cache of the linear after attention scales its 1x128 tiles first
    (:func:`e5m6_scale_exponent`), so no finite value reaches the saturation.
    """
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    # Saturate before rounding: a value <= max never rounds above it.
    xc = where(finite, clip(x, -E5M6_MAX, E5M6_MAX), 0.0)
    neg, m, e = float32_parts(xc)
    lead = e + (31 - lax.clz(m))  # exponent of the leading bit
    # Unit of the E5M6 grid at this magnitude (fixed below the normal range).
    unit = jnp.maximum(lead, E5M6_MIN_EXP) - E5M6_MANTISSA_BITS
    q = _round_shift(m, jnp.maximum(unit - e, 0))
    out = float32_from_parts(neg, q, unit)
    return where(finite, out, x)


@traced_inline
def e5m6_scale_exponent(amax: jnp.ndarray) -> jnp.ndarray:
    """int32 k of the power-of-two scale 2^k that puts ``amax`` into E5M6's range.

    The rule: k is the smallest integer with ``amax / 2^k <= 65024`` (E5M6's
    largest finite value), i.e. ``2^k = 2^ceil(log2(amax / 65024))``,
    computed exactly on the bit patterns (no float32 quotient to round, no
    flush-to-zero for subnormal amaxes); 0 for ``amax == 0``.  ``amax`` must
    be finite and >= 0 (a tile's max over its finite elements).  The tile's
    largest element then lies in (32512, 65024] and no element saturates.
    """
    _, m, e = float32_parts(amax.astype(jnp.float32))
    top = 31 - lax.clz(m)  # index of m's leading bit
    # k0 = lead - 15 puts amax / 2^k0 in [2^15, 2^16); it fits iff
    # m * 2^e <= 127 * 2^(9 + k0), i.e. m <= 127 * 2^(top - 6) (always true
    # for top <= 6, where m < 2^(top + 1) <= 127 * 2^(top - 6)); else k0 + 1.
    fits = (top <= 6) | (m <= (127 << clip(top - 6, 0, 17)))
    k = e + top - 15 + where(fits, 0, 1)
    return where(m == 0, 0, k).astype(jnp.int32)
