"""The Hopper accumulation model in plain Python integers: the reference of tests/test_accumulate.py.

Written from the description of the model (blocks of ``block`` products and
the chain accumulator aligned to their largest exponent, terms truncated
toward zero to ``frac_bits`` fraction bits below it, summed exactly, the block
result truncated to ``frac_bits`` bits; a chain restarts at every multiple of
``group`` and of ``promote_every``; at its end, with s = fl32(s_a * s_b),
acc = fl32(acc + c * s) in one rounding ("fma") or fl32(acc + fl32(c * s))
("separate")) and independent of fp8jax.accumulate: codes are decoded
from their bytes with Python integers, every value is an exact dyadic number
(integer, exponent), and float32 rounding (round to nearest even,
subnormals, overflow) is done on those integers.  One output at a time, with
explicit loops: for tiny shapes only.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# (mantissa bits, exponent bits, bias) of the formats a tensor core reads.
_LAYOUT = {
    np.dtype(ml_dtypes.float8_e4m3fn): (3, 4, 7),
    np.dtype(ml_dtypes.float8_e5m2): (2, 5, 15),
}

NAN = float("nan")
INF = float("inf")


def decode(byte: int, dtype) -> tuple[int, int, int, float | None]:
    """(signed significand, exponent, mantissa bits, special) of one FP8 byte.

    The code's value is significand * 2^(exponent - mantissa bits); a subnormal
    code has the minimum normal exponent 1 - bias.  ``special`` is NaN or
    +-inf for non-finite codes, else None.
    """
    mant_bits, exp_bits, bias = _LAYOUT[np.dtype(dtype)]
    sign = -1 if byte & 0x80 else 1
    field = (byte >> mant_bits) & ((1 << exp_bits) - 1)
    mant = byte & ((1 << mant_bits) - 1)
    all_ones = (1 << exp_bits) - 1
    if exp_bits == 4 and field == all_ones and mant == (1 << mant_bits) - 1:
        return 0, 0, mant_bits, NAN
    if exp_bits == 5 and field == all_ones:
        return 0, 0, mant_bits, (sign * INF if mant == 0 else NAN)
    if field == 0:
        return sign * mant, 1 - bias, mant_bits, None
    return sign * (mant + (1 << mant_bits)), field - bias, mant_bits, None


def _dyadic(x: float) -> tuple[int, int]:
    """A finite Python float as (n, e) with x == n * 2^e exactly."""
    num, den = float(x).as_integer_ratio()
    return num, -(den.bit_length() - 1)


def round_f32(n: int, e: int) -> float:
    """n * 2^e rounded to the nearest float32 (ties to even), as a Python float."""
    if n == 0:
        return 0.0
    sign = -1 if n < 0 else 1
    mag = abs(n)
    lead = e + mag.bit_length() - 1
    # 24 significant bits for normal numbers; subnormals are multiples of 2^-149.
    q = max(lead - 23, -149)
    if e >= q:
        kept = mag << (e - q)
    else:
        shift = q - e
        kept, rem = mag >> shift, mag & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and kept & 1):
            kept += 1
    if kept * 2.0**q >= 2.0**128:
        return sign * INF
    return math.ldexp(sign * kept, q)


def _mul_f32(x: float, y: float) -> float:
    """fl32(x * y) for float32 values x, y, via exact integers."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return x * y  # IEEE rules for non-finite operands
    (nx, ex), (ny, ey) = _dyadic(x), _dyadic(y)
    return round_f32(nx * ny, ex + ey)


def _add_f32(x: float, y: float) -> float:
    """fl32(x + y) for float32 values x, y, via exact integers."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return x + y
    (nx, ex), (ny, ey) = _dyadic(x), _dyadic(y)
    e = min(ex, ey)
    return round_f32((nx << (ex - e)) + (ny << (ey - e)), e)


def _truncate(n: int, e: int, q: int) -> int:
    """trunc(n * 2^e / 2^q): the multiple of 2^q (as an integer count) toward zero."""
    if e >= q:
        return n << (e - q)
    mag = abs(n) >> (q - e)
    return mag if n >= 0 else -mag


def _special_sum(a: list, b: list) -> float | None:
    """IEEE result of a dot product that holds non-finite codes; None if every code is finite."""
    total = None
    for (ma, _, _, sa), (mb, _, _, sb) in zip(a, b):
        if sa is None and sb is None:
            continue
        # Only the sign and zero-ness of a finite factor matter next to an inf or NaN.
        va = sa if sa is not None else float(ma)
        vb = sb if sb is not None else float(mb)
        # inf * 0 is NaN and inf + -inf is NaN, as in IEEE arithmetic.
        total = va * vb if total is None else total + va * vb
    return total


def _fma_f32(acc: float, c_n: int, c_e: int, s: float) -> float:
    """fl32(acc + c_n 2^c_e * s) with one rounding, via exact integers."""
    if not (math.isfinite(acc) and math.isfinite(s)):
        return acc + (math.ldexp(c_n, c_e) * s if c_n else 0.0)
    (na, ea), (ns, es) = _dyadic(acc), _dyadic(s)
    np_, ep = c_n * ns, c_e + es
    e = min(ea, ep)
    return round_f32((na << (ea - e)) + (np_ << (ep - e)), e)


def reference_dot(
    a_bytes,
    a_dtype,
    a_scales,
    b_bytes,
    b_dtype,
    b_scales,
    group,
    block,
    frac_bits,
    promote_every,
    promote_rounding="fma",
) -> float:
    """One output: codes as byte lists of length K, scales as one float32 per run of ``group``."""
    k = len(a_bytes)
    a = [decode(x, a_dtype) for x in a_bytes]
    b = [decode(x, b_dtype) for x in b_bytes]
    special = _special_sum(a, b)
    if special is not None:
        return special

    acc32 = 0.0
    c_n, c_e = 0, 0  # the chain accumulator c = c_n * 2^c_e
    start = 0
    while start < k:
        # The chain ends at the next multiple of group or promote_every, or at K.
        stops = [k, (start // group + 1) * group]
        if promote_every is not None:
            stops.append((start // promote_every + 1) * promote_every)
        stop = min(stops)
        for b0 in range(start, stop, block):
            terms = []  # (n, e): the product's exact value n * 2^e, and its alignment exponent
            for i in range(b0, min(b0 + block, stop)):
                (ma, ea, pa, _), (mb, eb, pb, _) = a[i], b[i]
                if ma != 0 and mb != 0:
                    terms.append((ma * mb, ea + eb - pa - pb, ea + eb))
            if c_n != 0:
                # floor(log2 |c|)
                terms.append((c_n, c_e, c_e + abs(c_n).bit_length() - 1))
            if not terms:
                continue
            q = max(t[2] for t in terms) - frac_bits
            total = sum(_truncate(n, e, q) for n, e, _ in terms)
            drop = max(abs(total).bit_length() - (frac_bits + 1), 0)
            c_n = _truncate(total, q, q + drop)
            c_e = q + drop
        run = start // group
        s = _mul_f32(a_scales[run], b_scales[run])
        if promote_rounding == "fma":
            acc32 = _fma_f32(acc32, c_n, c_e, s)
        else:
            acc32 = _add_f32(acc32, _mul_f32(math.ldexp(c_n, c_e) if c_n else 0.0, s))
        c_n, c_e = 0, 0
        start = stop
    return acc32


def reference_gemm(
    a_codes,
    a_scale,
    b_codes,
    b_scale,
    *,
    group,
    block,
    frac_bits,
    promote_every,
    promote_rounding="fma",
):
    """(B, M, N) float32 array of :func:`reference_dot` for numpy / JAX inputs of emulated_gemm."""
    a_codes, b_codes = np.asarray(a_codes), np.asarray(b_codes)
    a_scale = np.asarray(a_scale, np.float32)
    b_scale = np.asarray(b_scale, np.float32)
    a_u8, b_u8 = a_codes.view(np.uint8), b_codes.view(np.uint8)
    batch, m, _ = a_codes.shape
    n = b_codes.shape[2]
    out = np.zeros((batch, m, n), np.float32)
    for ib in range(batch):
        for im in range(m):
            row = [int(x) for x in a_u8[ib, im]]
            row_s = [float(x) for x in a_scale[ib, im]]
            for jn in range(n):
                out[ib, im, jn] = reference_dot(
                    row,
                    a_codes.dtype,
                    row_s,
                    [int(x) for x in b_u8[ib, :, jn]],
                    b_codes.dtype,
                    [float(x) for x in b_scale[ib, :, jn]],
                    group,
                    block,
                    frac_bits,
                    promote_every,
                    promote_rounding,
                )
    return out
