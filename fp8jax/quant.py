"""Quantize / dequantize at tensor, row, tile and block granularity.

``quantize(x, fmt, granularity, axis, tile)`` returns a :class:`QTensor` with
``x ~= dequantize(q) = data * expand(scale)``:

* ``"tensor"``: one scale, shape ();
* ``"row"``: one scale per slice along ``axis`` (reduced over ``axis``); scale
  has ``x``'s shape with ``axis`` of size 1;
* ``"tile"``: one scale per 1 x ``tile`` run along ``axis``; scale has
  ``x``'s shape with ``axis`` of size ceil(n / tile).  With tile 128, E4M3 and
  ``axis=-1`` this is DeepSeek-V3's ``act_quant``: scale = amax / 448 in
  float32 (correctly rounded), data = e4m3(x / scale) (correctly rounded
  division, then round-to-nearest-even with saturation);
* ``"block"``: one scale per ``tile`` x ``tile`` block over the last two
  axes; scale shape (..., ceil(R / tile), ceil(C / tile)).

Lengths that are not multiples of the tile are zero-padded for the amax (zeros
never raise an amax) and cropped afterwards: a partial tile at the edge gets
the scale of its own elements.  ``data`` always has ``x``'s shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.formats import as_format, saturating_cast
from fp8jax.scaling import exact_div, finite_amax, scale_from_amax

_F32_MAX = float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class QTensor:
    """Quantized tensor: ``data`` (FP8, x's shape) and float32 ``scale``.

    ``granularity``, ``axis`` (normalised, non-negative), ``tile`` and
    ``shape`` are static metadata describing the scale layout.
    """

    data: jax.Array
    scale: jax.Array
    granularity: str = "tensor"
    axis: int = 0
    tile: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return int(self.data.size * self.data.dtype.itemsize + self.scale.size * 4)


# Static fields are not leaves of the pytree.
jax.tree_util.register_dataclass(
    QTensor, data_fields=["data", "scale"], meta_fields=["granularity", "axis", "tile"]
)


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-d tensor")
    return axis % ndim


def _pad_axis(x: jnp.ndarray, axis: int, multiple: int) -> jnp.ndarray:
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _split_axis(x: jnp.ndarray, axis: int, tile: int) -> jnp.ndarray:
    """(..., n, ...) -> (..., ceil(n/tile), tile, ...), zero padded."""
    xp = _pad_axis(x, axis, tile)
    shape = xp.shape[:axis] + (xp.shape[axis] // tile, tile) + xp.shape[axis + 1 :]
    return xp.reshape(shape)


def _to_f32_finite(x: jnp.ndarray) -> jnp.ndarray:
    # Compute in float32 (bf16/f16 inputs are exact in it).  +-Inf becomes
    # +-float32 max so that x / scale stays a plain division (the exact
    # division trick multiplies by 0); it then saturates to +-fmt_max.
    x = x.astype(jnp.float32)
    return jnp.clip(x, -_F32_MAX, _F32_MAX)


def expand_scale(scale: jnp.ndarray, shape, granularity: str, axis: int, tile: int):
    """Broadcast a scale layout back to ``shape`` (repeat tiles, crop edges)."""
    if granularity in ("tensor", "row"):
        return scale
    if granularity == "tile":
        s = jnp.repeat(scale, tile, axis=axis)
        return jax.lax.slice_in_dim(s, 0, shape[axis], axis=axis)
    if granularity == "block":
        s = jnp.repeat(jnp.repeat(scale, tile, axis=-2), tile, axis=-1)
        return s[..., : shape[-2], : shape[-1]]
    raise ValueError(f"unknown granularity {granularity!r}")


def compute_scale(
    x: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
) -> jnp.ndarray:
    """The online scale layout of ``x`` (see module docstring for shapes)."""
    amax = group_amax(x, granularity, axis, tile, finite_only=True)
    return scale_from_amax(amax, fmt, pow2=pow2, amax_floor=amax_floor)


def _plain_amax(x, axis=None, keepdims=False):
    # max(max(x), -min(x)) == max|x|, and XLA on CPU vectorises the two plain
    # reductions about 6x better than a reduction of |x|.  A NaN propagates
    # into its group's amax (the caller then takes the robust path).
    xf = x.astype(jnp.float32)
    hi = jnp.max(xf, axis=axis, keepdims=keepdims)
    lo = jnp.min(xf, axis=axis, keepdims=keepdims)
    return jnp.maximum(hi, -lo)


def group_amax(
    x: jnp.ndarray, granularity: str, axis: int = -1, tile: int = 128, *, finite_only: bool = True
) -> jnp.ndarray:
    """max |x| per scale group (the scale layout's shape), float32.

    ``finite_only`` ignores NaN / Inf elements; without it a non-finite
    element makes its group's amax non-finite (cheaper: no select per element).
    """
    red = finite_amax if finite_only else _plain_amax
    axis = _norm_axis(axis, x.ndim) if x.ndim else 0
    if granularity == "tensor":
        return red(x)
    if granularity == "row":
        return red(x, axis=axis, keepdims=True)
    if granularity == "tile":
        return red(_split_axis(x, axis, tile), axis=axis + 1)
    if granularity == "block":
        if x.ndim < 2:
            raise ValueError("block granularity needs at least 2 dimensions")
        xb = _split_axis(_split_axis(x, x.ndim - 1, tile), x.ndim - 2, tile)
        # xb: (..., R/t, t, C/t, t)
        return red(xb, axis=(-3, -1))
    raise ValueError(f"unknown granularity {granularity!r}")


def quantize_with_scale(
    x: jnp.ndarray,
    scale: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    assume_finite: bool = False,
) -> QTensor:
    """Quantize with a given scale layout (delayed scaling passes its own).

    ``assume_finite`` skips the clipping of +-Inf to float32's max, which
    only matters when x holds Inf.
    """
    fmt = as_format(fmt)
    axis = _norm_axis(axis, x.ndim) if x.ndim else 0
    xf = x.astype(jnp.float32) if assume_finite else _to_f32_finite(x)
    scale = scale.astype(jnp.float32)
    if granularity in ("tensor", "row"):
        y = exact_div(xf, scale)
    elif granularity == "tile":
        xt = _split_axis(xf, axis, tile)
        y = exact_div(xt, jnp.expand_dims(scale, axis + 1))
        y = y.reshape(y.shape[:axis] + (-1,) + y.shape[axis + 2 :])
        y = jax.lax.slice_in_dim(y, 0, x.shape[axis], axis=axis)
    elif granularity == "block":
        nd = x.ndim
        xb = _split_axis(_split_axis(xf, nd - 1, tile), nd - 2, tile)
        y = exact_div(xb, scale[..., :, None, :, None])
        y = y.reshape(y.shape[:-4] + (y.shape[-4] * tile, y.shape[-2] * tile))
        y = y[..., : x.shape[-2], : x.shape[-1]]
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    # Saturate: values past the range clip to +-max instead of NaN/Inf.
    data = saturating_cast(y, fmt)
    return QTensor(data, scale, granularity, axis, tile)


def quantize(
    x: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
) -> QTensor:
    """Online-scaled quantization of ``x`` to ``fmt`` (see module docstring)."""
    if x.ndim == 0:
        raise ValueError("quantize needs at least a 1-d tensor")
    if tile <= 0:
        raise ValueError("tile must be positive")
    if granularity not in ("tensor", "row", "tile", "block"):
        raise ValueError(f"unknown granularity {granularity!r}")
    # Fast path for the common all-finite tensor: a plain amax (no per-element
    # isfinite select) and no Inf clipping.  If any group's amax is NaN/Inf,
    # the robust path recomputes it over the finite elements only.  lax.cond
    # runs one branch (both under vmap, where it becomes a select).
    amax = group_amax(x, granularity, axis, tile, finite_only=False)

    def fast(x):
        scale = scale_from_amax(amax, fmt, pow2=pow2, amax_floor=amax_floor)
        return quantize_with_scale(x, scale, fmt, granularity, axis, tile, assume_finite=True)

    def robust(x):
        scale = compute_scale(x, fmt, granularity, axis, tile, pow2=pow2, amax_floor=amax_floor)
        return quantize_with_scale(x, scale, fmt, granularity, axis, tile)

    return jax.lax.cond(jnp.all(jnp.isfinite(amax)), fast, robust, x)


def dequantize(q: QTensor, dtype=jnp.float32) -> jnp.ndarray:
    """data * scale, computed in float32, returned as ``dtype``."""
    s = expand_scale(q.scale, q.data.shape, q.granularity, q.axis, q.tile)
    # FP8 -> float32 is exact; the product is rounded once to float32.
    return (q.data.astype(jnp.float32) * s).astype(dtype)
