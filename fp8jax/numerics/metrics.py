"""Error metrics: relative error, ULP distance, SQNR, saturation (underflow: fp8jax.telemetry).

These are measuring instruments, so they compute on the host in float64
(numpy), whatever the dtype of their inputs (JAX arrays are accepted): an
error metric computed in the precision under test would hide the error.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from fp8jax.telemetry import clip_threshold


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def relative_error(x, ref) -> float:
    """Norm-wise relative error ||x - ref||_2 / ||ref||_2 (0 if both are zero, inf if only ref is)."""
    x, ref = _f64(x), _f64(ref)
    num = float(np.linalg.norm((x - ref).ravel()))
    den = float(np.linalg.norm(ref.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def elementwise_relative_error(x, ref) -> np.ndarray:
    """|x - ref| / |ref| for each element where ref != 0, as a flat float64 array."""
    x, ref = np.broadcast_arrays(_f64(x), _f64(ref))
    nz = ref != 0
    return np.abs(x[nz] - ref[nz]) / np.abs(ref[nz])


def max_relative_error(x, ref) -> float:
    """max |x - ref| / |ref| over the elements where ref != 0."""
    rel = elementwise_relative_error(x, ref)
    return float(rel.max()) if rel.size else 0.0


def sqnr_db(x, ref) -> float:
    """Signal-to-quantization-noise ratio, 10 log10(sum ref^2 / sum (x - ref)^2), in dB.

    inf when x == ref exactly.  Each 6.02 dB is one bit: E4M3 rounding of
    normal values gives about 31 dB, BF16 about 52 dB.
    """
    x, ref = _f64(x), _f64(ref)
    noise = float(np.sum((x - ref) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _ordered(a: np.ndarray) -> np.ndarray:
    """Map floats to integers that are consecutive for consecutive representable values."""
    bits = a.dtype.itemsize * 8
    u = a.view({8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bits]).astype(np.int64)
    if a.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return u  # unsigned format: the bit pattern is already ordered
    if bits == 64:
        # Sign-magnitude to a signed order without overflowing int64.
        mag = u & np.int64(0x7FFFFFFFFFFFFFFF)
        return np.where(u < 0, -mag, mag)
    sign = u >> (bits - 1)
    mag = u & ((1 << (bits - 1)) - 1)
    # +0 and -0 both map to 0: they are the same number.
    return np.where(sign == 1, -mag, mag)


def ulp_distance(a, b, dtype=None) -> np.ndarray:
    """Number of representable ``dtype`` values between a and b (0 if equal).

    ``a`` and ``b`` are first rounded to ``dtype`` (default: a's dtype), so
    ulp_distance(x_f32, ref_f64, np.float32) counts float32 steps from the
    correctly rounded reference.  NaN in either gives NaN; inf counts as the
    value after the largest finite one.
    """
    a = np.asarray(a)
    dt = np.dtype(dtype) if dtype is not None else a.dtype
    a = a.astype(dt)
    b = np.asarray(b).astype(dt)
    d = np.abs(_ordered(a) - _ordered(b)).astype(np.float64)
    nan = np.isnan(a.astype(np.float64)) | np.isnan(b.astype(np.float64))
    return np.where(nan, np.nan, d)


# max + ulp(max) / 2: the core's one definition of where a saturating cast clips.
half_ulp_above_max = clip_threshold


def saturated_fraction(x, deq, data, fmt) -> float:
    """Fraction of elements clipped to +-max by quantization.

    An element is saturated when its code is +-max and its true value is
    beyond ``max + ulp(max)/2`` in scaled units, i.e. rounding alone would
    not have brought it to max: |x| > |deq| * (max + ulp/2) / max.
    """
    x, deq = _f64(x), _f64(deq)
    mx = float(ml_dtypes.finfo(fmt).max)
    at_max = np.abs(_f64(data)) == mx
    clipped = at_max & (np.abs(x) > np.abs(deq) * (half_ulp_above_max(fmt) / mx))
    return float(clipped.sum()) / max(x.size, 1)
