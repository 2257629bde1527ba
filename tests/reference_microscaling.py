"""Independent numpy reference for MX / NVFP4 block quantization, stochastic
rounding and the 16-point Hadamard transform, written from the specifications:

* OCP Microscaling Formats (MX) v1.0, section 6.3: per block of k elements,
  shared_exp = floor(log2(max |V_i|)) - emax_elem, X = 2^shared_exp (E8M0,
  exponent range [-127, 127]), P_i = V_i / X rounded to nearest-even in the
  element format, clamped to its largest normal.
* NVIDIA, "Pretraining Large Language Models with NVFP4" (2025), appendix on
  the NVFP4 quantization: s_enc = 6 * 448 / amax(x); per 16-element block
  the E4M3 decode scale e4m3(amax_b / 6 * s_enc); elements
  e2m1(x / (scale_b / s_enc)) saturated at 6; decode data * scale_b / s_enc.

Deliberately a different computation from fp8jax's: blocks are formed by
moving the axis last and reshaping, exponents come from ``np.frexp`` in
float64, rounding to a format is a search over the format's enumerated
grid (not a cast), and powers of two are float64 literals.  Conventions
fp8jax documents and this reference shares: float32 subnormal inputs (and
results) are flushed to signed zero, amaxes ignore NaN / Inf, a NaN in an
E2M1 block makes the block scale NaN.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32_TINY = float(np.finfo(np.float32).tiny)


def flush(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) < F32_TINY, x * np.float32(0), x).astype(np.float32)


def grid(fmt) -> np.ndarray:
    """All non-negative finite values of a format, sorted (float64)."""
    # Every code of the format (sub-byte formats are stored one per byte).
    codes = np.arange(2 ** ml_dtypes.finfo(fmt).bits, dtype=np.uint8)
    vals = codes.view(fmt).astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals >= 0)]
    # -0.0 + 0.0 is +0.0: the grid holds magnitudes, the sign is applied after.
    return np.unique(vals + 0.0)


def round_grid_nearest_even(v: np.ndarray, fmt) -> np.ndarray:
    """Round float64 v to the format's grid: nearest, ties to the even code, saturating."""
    g = grid(fmt)
    a = np.minimum(np.abs(v), g[-1])
    i = np.clip(np.searchsorted(g, a, side="right") - 1, 0, len(g) - 1)
    lo = g[i]
    hi = g[np.minimum(i + 1, len(g) - 1)]
    d_lo, d_hi = a - lo, hi - a
    # Grid index parity is the parity of the code's last mantissa bit.
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (i % 2 == 1) & (hi > lo))
    q = np.where(pick_hi, hi, lo)
    q = np.where(np.signbit(v), -q, q)
    return np.where(np.isnan(v), np.nan, q)


def round_grid_stochastic(v: np.ndarray, fmt, bits: np.ndarray) -> np.ndarray:
    """Stochastic rounding: up with probability (|v| - lo) / (hi - lo), decided by uint32 bits."""
    g = grid(fmt)
    a = np.minimum(np.abs(v), g[-1])
    i = np.clip(np.searchsorted(g, a, side="right") - 1, 0, len(g) - 1)
    lo = g[i]
    hi = g[np.minimum(i + 1, len(g) - 1)]
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(hi > lo, (a - lo) / (hi - lo), 0.0)
    up = bits.astype(np.float64) < p * 2.0**32
    q = np.where(up, hi, lo)
    q = np.where(np.signbit(v), -q, q)
    return np.where(np.isnan(v), np.nan, q)


def to_format(q: np.ndarray, fmt) -> np.ndarray:
    return q.astype(fmt)


def _blocks(x: np.ndarray, axis: int, block: int):
    """(x moved so axis is last, zero padded, reshaped (..., nb, block)), orig length."""
    xm = np.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    pad = (-n) % block
    xp = np.concatenate([xm, np.zeros(xm.shape[:-1] + (pad,), xm.dtype)], axis=-1)
    return xp.reshape(xm.shape[:-1] + (-1, block)), n


def _unblocks(b: np.ndarray, n: int, axis: int) -> np.ndarray:
    y = b.reshape(b.shape[:-2] + (-1,))[..., :n]
    return np.moveaxis(y, -1, axis)


def _blocks2d(x: np.ndarray, block: int):
    r, c = x.shape[-2:]
    pr, pc = (-r) % block, (-c) % block
    xp = np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pr), (0, pc)])
    R, C = xp.shape[-2:]
    b = xp.reshape(xp.shape[:-2] + (R // block, block, C // block, block))
    return np.swapaxes(b, -3, -2), (r, c)  # (..., R/b, C/b, b, b)


def _unblocks2d(b: np.ndarray, rc) -> np.ndarray:
    b = np.swapaxes(b, -3, -2)
    s = b.shape
    y = b.reshape(s[:-4] + (s[-4] * s[-3], s[-2] * s[-1]))
    return y[..., : rc[0], : rc[1]]


def _split(x, axis, block, two_d):
    if two_d:
        b, meta = _blocks2d(x, block)
        flat = b.reshape(b.shape[:-2] + (block * block,))
        return flat, (lambda f: _unblocks2d(f.reshape(b.shape), meta))
    b, n = _blocks(x, axis, block)
    return b, (lambda f: _unblocks(f, n, axis))


def _finite_amax(b: np.ndarray) -> np.ndarray:
    a = np.abs(b.astype(np.float64))
    return np.where(np.isfinite(a), a, 0.0).max(axis=-1)


def mx_quantize(x, elem_fmt, axis=-1, block=32, two_d=False, bits=None, scale_rounding="floor"):
    """(data in elem_fmt, E8M0 scale (block layout), dequantized float32).

    scale_rounding "ceil": the smallest shared exponent with amax <= max * 2^shared.
    """
    x = flush(x)
    b, back = _split(x, axis, block, two_d)
    amax = _finite_amax(b)
    emax_elem = int(np.floor(np.log2(float(ml_dtypes.finfo(elem_fmt).max))))
    with np.errstate(divide="ignore"):
        _, e = np.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
    floor_log2 = np.where(amax >= F32_TINY, e - 1, -1000)
    shared = floor_log2 - emax_elem
    if scale_rounding == "ceil":
        elem_max = float(ml_dtypes.finfo(elem_fmt).max)
        above = (amax >= F32_TINY) & (amax > elem_max * np.exp2(shared.astype(np.float64)))
        shared = shared + above
    shared = np.clip(shared, -127, 127)
    v = b.astype(np.float64) * np.exp2(-shared.astype(np.float64))[..., None]
    has_nan = bool(np.isnan(np.array(np.nan, np.float32).astype(elem_fmt).astype(np.float32)))
    nan_block = np.isnan(b).any(axis=-1)
    if not has_nan:
        # No NaN code in the element format: the element is 0, the block scale NaN.
        v = np.where(np.isnan(b), 0.0, v)
    q = (
        round_grid_nearest_even(v, elem_fmt)
        if bits is None
        else round_grid_stochastic(v, elem_fmt, _split(bits, axis, block, two_d)[0])
    )
    data = to_format(back(q), elem_fmt)
    scale_val = np.exp2(shared.astype(np.float64))
    deq = q * scale_val[..., None]
    if not has_nan:
        scale_val = np.where(nan_block, np.nan, scale_val)
        deq = np.where(nan_block[..., None], np.nan, deq)
    scale = (shared + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).copy()
    scale[np.isnan(scale_val)] = np.uint8(255).view(ml_dtypes.float8_e8m0fnu)
    deq = flush(back(deq).astype(np.float32))
    return data, _scale_layout(scale, axis, two_d), deq


def _scale_layout(scale_blocks, axis, two_d):
    # Block order is (..., nb) with axis moved last; fp8jax keeps it in place.
    return scale_blocks if two_d else np.moveaxis(scale_blocks, -1, axis)


def nvfp4_quantize(x, axis=-1, block=16, two_d=False, bits=None):
    """(E2M1 data, E4M3 scale (block layout), float32 s_dec, dequantized float32)."""
    f32 = np.float32
    e4m3 = ml_dtypes.float8_e4m3fn
    x = flush(x)
    fin = np.where(np.isfinite(x), np.abs(x), f32(0))
    amax = f32(fin.max()) if fin.size else f32(0)
    if amax > 0:
        with np.errstate(over="ignore"):
            s_enc = min(f32(6.0 * 448.0) / amax, f32(2.0**126))
    else:
        s_enc = f32(1.0)
    s_enc = f32(s_enc)
    s_dec = f32(f32(1.0) / s_enc)
    b, back = _split(x, axis, block, two_d)
    bamax = _finite_amax(b).astype(f32)
    dec_f = (bamax / f32(6.0)).astype(f32) * s_enc
    scale = round_grid_nearest_even(dec_f.astype(np.float64), e4m3)
    dec = flush((scale.astype(f32) * s_dec).astype(f32))
    with np.errstate(divide="ignore"):
        enc = np.where(dec > 0, f32(1.0) / np.where(dec > 0, dec, f32(1)), f32(0)).astype(f32)
    # +-Inf: the element saturates; times a zero block scale it is zero.
    bf = np.where(np.isinf(b), np.sign(b) * np.float32(np.finfo(f32).max), b).astype(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (bf * enc[..., None]).astype(f32)
    nan_block = np.isnan(b).any(axis=-1)
    v = np.where(np.isnan(v), f32(0), v).astype(np.float64)
    q = (
        round_grid_nearest_even(v, ml_dtypes.float4_e2m1fn)
        if bits is None
        else round_grid_stochastic(v, ml_dtypes.float4_e2m1fn, _split(bits, axis, block, two_d)[0])
    )
    scale = np.where(nan_block, np.nan, scale)
    deq = (q * scale[..., None]).astype(f32).astype(np.float64) * float(s_dec)
    deq = np.where(nan_block[..., None], np.nan, deq)
    data = to_format(back(q), ml_dtypes.float4_e2m1fn)
    deq = flush(back(deq).astype(np.float32))
    return data, _scale_layout(scale.astype(e4m3), axis, two_d), s_dec, deq


def fwht16(x: np.ndarray) -> np.ndarray:
    """H_n v along the last axis, recursively: H_2m [a; b] = [H_m a + H_m b; H_m a - H_m b]."""
    n = x.shape[-1]
    if n == 1:
        return x
    a = fwht16(x[..., : n // 2])
    b = fwht16(x[..., n // 2 :])
    return np.concatenate([a + b, a - b], axis=-1)


def rht(x: np.ndarray, signs: np.ndarray, axis: int = -1) -> np.ndarray:
    """float32 random Hadamard transform in blocks of len(signs), axis zero-padded."""
    n = len(signs)
    b, _ = _blocks(np.asarray(x, np.float32), axis % x.ndim, n)
    y = fwht16((b * signs.astype(np.float32)).astype(np.float32)) * np.float32(1.0 / np.sqrt(n))
    y = y.astype(np.float32)
    return np.moveaxis(y.reshape(y.shape[:-2] + (-1,)), -1, axis % x.ndim)
