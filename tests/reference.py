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


def fmax(fmt) -> float:
    return float(ml_dtypes.finfo(fmt).max)


def ref_scale(amax: float, fmt, pow2=False, amax_floor=0.0) -> np.float32:
    amax = np.float32(max(float(amax), amax_floor))
    if amax == 0:
        return np.float32(1.0)
    s = np.float32(amax) / np.float32(fmax(fmt))
    s = max(s, np.float32(F32_TINY))
    if pow2:
        s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
    return np.float32(s)


def ref_cast(y32: np.ndarray, fmt) -> np.ndarray:
    m = fmax(fmt)
    return np.clip(y32, -m, m).astype(fmt)


def _finite_absmax(a: np.ndarray) -> float:
    a = np.abs(a.astype(np.float64))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def ref_quantize_groups(x: np.ndarray, groups, fmt, pow2=False, amax_floor=0.0):
    """Quantize x with one scale per group; groups is a list of index tuples
    (numpy fancy/slice indices).  Returns (data, per-element scale as f64)."""
    x32 = np.clip(x.astype(np.float32), -np.finfo(np.float32).max, np.finfo(np.float32).max)
    data = np.zeros(x.shape, fmt)
    scale_el = np.zeros(x.shape, np.float64)
    for g in groups:
        s = ref_scale(_finite_absmax(x32[g]), fmt, pow2, amax_floor)
        with np.errstate(over="ignore", invalid="ignore"):
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


def ref_act_quant(x: np.ndarray, block: int = 128):
    """DeepSeek-V3 act_quant semantics (last dim divisible by block), in numpy."""
    x32 = x.astype(np.float32)
    shp = x32.shape
    xt = x32.reshape(*shp[:-1], shp[-1] // block, block)
    s = (np.abs(xt).max(axis=-1) / np.float32(448.0)).astype(np.float32)
    y = (xt / s[..., None]).astype(np.float32)
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
