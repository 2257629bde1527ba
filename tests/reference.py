"""An independent numpy / ml_dtypes reference for the FP8 numerics.

Written from the definitions (DeepSeek-V3's act_quant: s = amax / 448 in
float32, y = e4m3(x / s)), not from fp8jax's code: loops over tiles and
blocks, numpy's correctly rounded float32 division, float64 dequantization
and float64 matmuls.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
FMTS = {"e4m3": E4M3, "e5m2": E5M2}
F32_TINY = np.finfo(np.float32).tiny
F32_MAX = float(np.finfo(np.float32).max)
F32_SMALLEST = np.float32(2.0**-149)


def fmax(fmt) -> float:
    return float(ml_dtypes.finfo(fmt).max)


def max_scale(fmt, pow2=False) -> float:
    """Largest float32 s (a power of two if pow2) whose fmax * s is finite (float64 check)."""
    if pow2:
        k = 128
        while 2.0**k * fmax(fmt) > F32_MAX:
            k -= 1
        return 2.0**k
    s = np.float32(F32_MAX / fmax(fmt))
    while float(s) * fmax(fmt) > F32_MAX:
        s = np.nextafter(s, np.float32(0))
    return float(s)


def ref_scale(amax: float, fmt, pow2=False, amax_floor=0.0) -> np.float32:
    """amax / fmax, correctly rounded to float32 (numpy: subnormals kept), guarded."""
    amax = np.float32(max(float(amax), amax_floor))
    if amax == 0:
        return np.float32(1.0)
    with np.errstate(under="ignore"):
        s = np.float32(amax) / np.float32(fmax(fmt))
    if s == 0:
        s = F32_SMALLEST
    if pow2:
        s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
    return np.float32(min(float(s), max_scale(fmt, pow2)))


def ref_cast(y32: np.ndarray, fmt) -> np.ndarray:
    """Saturate finite values; NaN / Inf take ml_dtypes' cast (NaN code, or Inf if the format has it)."""
    m = fmax(fmt)
    y32 = np.asarray(y32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(np.isinf(y32), y32, np.clip(y32, -m, m)).astype(fmt)


def _finite_absmax(a: np.ndarray) -> float:
    a = np.abs(a.astype(np.float64))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def ref_quantize_groups(x: np.ndarray, groups, fmt, pow2=False, amax_floor=0.0):
    """Quantize x with one scale per group; groups is a list of index tuples
    (numpy fancy/slice indices).  Returns (data, per-element scale as f64)."""
    x32 = x.astype(np.float32)
    data = np.zeros(x.shape, fmt)
    scale_el = np.zeros(x.shape, np.float64)
    for g in groups:
        s = ref_scale(_finite_absmax(x32[g]), fmt, pow2, amax_floor)
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            data[g] = ref_cast(x32[g] / s, fmt)
        scale_el[g] = float(s)
    return data, scale_el


def groups_for(shape, granularity: str, axis: int, tile: int = 128):
    """Index groups sharing one scale (tile/row along `axis`, block over last two)."""
    nd = len(shape)
    axis %= nd
    if granularity == "tensor":
        return [tuple(slice(None) for _ in shape)]
    if granularity == "row":
        rest = [n if i != axis else 1 for i, n in enumerate(shape)]
        out = []
        for ix in np.ndindex(*rest):
            idx = list(ix)
            idx[axis] = slice(None)
            out.append(tuple(idx))
        return out
    if granularity == "tile":
        out = []
        n = shape[axis]
        rest = [n_ if i != axis else 1 for i, n_ in enumerate(shape)]
        for ix in np.ndindex(*rest):
            for t0 in range(0, n, tile):
                idx = list(ix)
                idx[axis] = slice(t0, min(t0 + tile, n))
                out.append(tuple(idx))
        return out
    if granularity == "block":
        out = []
        r, c = shape[-2], shape[-1]
        for ix in np.ndindex(*shape[:-2]):
            for r0 in range(0, r, tile):
                for c0 in range(0, c, tile):
                    out.append(
                        tuple(ix) + (slice(r0, min(r0 + tile, r)), slice(c0, min(c0 + tile, c)))
                    )
        return out
    raise ValueError(granularity)


def ref_qdq(x, fmt, granularity, axis=-1, tile=128, pow2=False, amax_floor=0.0) -> np.ndarray:
    """Quantize-dequantize in float64."""
    data, s = ref_quantize_groups(
        x, groups_for(x.shape, granularity, axis, tile), fmt, pow2, amax_floor
    )
    return data.astype(np.float64) * s


def ref_act_quant(x: np.ndarray, block: int = 128, amax_floor: float = 0.0, pow2: bool = False):
    """DeepSeek-V3 act_quant semantics (last dim divisible by block), in numpy.

    ``amax_floor=0``: the 2024 code, s = amax / 448.  ``amax_floor=1e-4``: the
    code since 2025-08-27, ``amax.clamp(1e-4)`` (the floor as a float32) before
    the division; ``pow2`` its ``scale_fmt="ue8m0"``: s = 2^ceil(log2 s), the
    exponent found in float64 (exact for the float32 s).
    """
    x32 = x.astype(np.float32)
    shp = x32.shape
    xt = x32.reshape(*shp[:-1], shp[-1] // block, block)
    amax = np.maximum(np.abs(xt).max(axis=-1), np.float32(amax_floor))
    s = (amax / np.float32(448.0)).astype(np.float32)
    if pow2:
        s = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    y = np.clip(xt / s[..., None], -448.0, 448.0).astype(np.float32)
    return y.astype(E4M3).reshape(shp), s


def ref_spec_qdq(t, spec, caxis: int):
    """Quantize-dequantize a canonical 3-D operand per a QuantSpec-like object."""
    if spec.fmt is None:
        return t.astype(np.float64)  # compute dtype handled by the caller's tolerance
    return ref_qdq(
        t, FMTS[spec.fmt], spec.granularity, caxis, spec.tile, spec.pow2, spec.amax_floor
    )


def ref_linear_grads(x, w, g, recipe):
    """Reference y, dx, dw of y = x @ w (x: (B,M,K), w: (B,K,N)), dy = g.

    Mirrors the documented dataflow: x and w quantized for fprop and cached;
    dgrad uses the cached w (re-quantized along N when its spec is not
    per-tensor / block); wgrad re-quantizes the cached x along M.
    """
    f, d, wg = recipe.fprop, recipe.dgrad, recipe.wgrad
    xq = ref_spec_qdq(x, f.lhs, 2)
    wq = ref_spec_qdq(w, f.rhs, 1)
    y = np.einsum("bmk,bkn->bmn", xq, wq)
    dyq = ref_spec_qdq(g, d.lhs, 2)
    if d.rhs == f.rhs and d.rhs.granularity in ("tensor", "block"):
        wd = wq
    else:
        wd = ref_spec_qdq(wq, d.rhs, 2)
    dx = np.einsum("bmn,bkn->bmk", dyq, wd)
    if wg.lhs == f.lhs and wg.lhs.granularity == "tensor":
        xw = xq
    else:
        xw = ref_spec_qdq(xq, wg.lhs, 1)
    dyw = ref_spec_qdq(g, wg.rhs, 1)
    dw = np.einsum("bmk,bmn->bkn", xw, dyw)
    return y, dx, dw


def ref_round_e5m6(x: np.ndarray) -> np.ndarray:
    """E5M6 rounding in float64: 6 mantissa bits, normals from 2^-14, subnormal step
    2^-20, ties to even, finite values saturate at 65024, NaN / Inf unchanged."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    mx = (2 - 2.0**-6) * 2.0**15
    for i, v in np.ndenumerate(x):
        if not np.isfinite(v) or v == 0:
            out[i] = v
            continue
        v = min(max(v, -mx), mx)
        e = max(math.frexp(v)[1] - 1, -14)  # exponent of the leading bit
        unit = 2.0 ** (e - 6)
        out[i] = np.round(v / unit) * unit  # np.round: half to even
    return out


def ref_e5m6_tiles(x: np.ndarray, axis: int = -1, tile: int = 128) -> np.ndarray:
    """E5M6 with one power-of-two scale per 1 x tile run along ``axis``, in float64.

    Per tile: amax over the finite elements; k the smallest integer with
    amax <= 65024 * 2^k (searched in float64 from floor(log2 amax)); values
    ref_round_e5m6(x / 2^k) * 2^k.  An all-zero tile has k = 0.
    """
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    out = np.empty_like(x)
    mx = (2 - 2.0**-6) * 2.0**15
    n = x.shape[-1]
    for idx in np.ndindex(*x.shape[:-1]):
        for start in range(0, n, tile):
            t = x[idx][start : start + tile]
            fin = t[np.isfinite(t)]
            amax = float(np.max(np.abs(fin))) if fin.size else 0.0
            k = 0
            if amax > 0:
                k = math.frexp(amax)[1] - 18
                while amax > mx * 2.0**k:
                    k += 1
            out[idx][start : start + tile] = ref_round_e5m6(t / 2.0**k) * 2.0**k
    return np.moveaxis(out, -1, axis)
