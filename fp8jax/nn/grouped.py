"""Dropless grouped expert GEMM (MoE) with FP8 Fprop, Dgrad and Wgrad.

Layout (DeepGEMM's "contiguous" layout): the rows of ``x`` are the routed
tokens sorted by expert; ``group_sizes[e]`` consecutive rows, starting at
``sum(group_sizes[:e])``, use expert ``e``'s weight ``w[e]``; rows past
``sum(group_sizes)`` belong to no expert (output 0, gradient 0).  Every
routed token is computed (dropless): no capacity, no dropping.

    fprop  y[m]   = x[m] @ w[e(m)]                 x (M, K), w (E, K, N) -> (M, N)
    dgrad  dx[m]  = dy[m] @ w[e(m)]^T                                    -> (M, K)
    wgrad  dw[e]  = sum_{m in group e} x[m]^T dy[m]                      -> (E, K, N)

Quantization follows the recipe's specs, each relative to that GEMM's
contraction axis (see :mod:`fp8jax.recipes`):

* Fprop: x in 1x128 tiles along K (``quantize(x, fmt, "tile", axis=-1)``),
  w in 128x128 blocks of each expert's (K, N) matrix (``"block"`` over the
  last two axes of the (E, K, N) tensor).
* Dgrad: dy in 1x128 tiles along N; the cached FP8 weight blocks are reused
  as they are (a 128x128 block serves W and W^T alike).
* Wgrad: the contraction axis is the token axis.  x (from its cached FP8
  copy, as DeepSeek-V3 does) and dy are requantized in 128x1 tiles along the
  tokens *within each expert's group*: tile ``j`` of group ``e`` holds rows
  ``off_e + 128 j ... off_e + 128 j + 127`` (cropped at the group's end), so no
  tile straddles two experts.  ``"row"`` means one scale per (expert, column).
* ``"tensor"`` means one scale for the whole operand (all experts), with
  current or delayed (amax-history) scaling; ``fmt=None`` casts to the
  recipe's compute dtype (the bf16 baseline runs through the same code).

Numerics of a quantized GEMM on the XLA path: the operands are dequantized
(``data * scale`` rounded once to float32, then to ``recipe.dequant_dtype``)
and multiplied with float32 accumulation, by ``lax.ragged_dot`` (GPU) or, on
CPU where ragged_dot is slow, by batched matmuls over expert-aligned 128-row
tiles (same products, same float32 accumulation; see ``XLA_GROUPED_IMPL``).
:func:`grouped_gemm` is the single
place where a kernel (Pallas) can take over; today it calls
``fp8jax.kernels.dispatch.maybe_grouped_block_gemm`` for E4M3 1x128 x 128x128
Fprop/Dgrad GEMMs when the recipe's ``impl`` resolves to "pallas".

Residuals kept for the backward pass: the FP8 data and scales of x and w.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import scaling
from fp8jax.dot_general import operand_stats, quantize_operand
from fp8jax.formats import as_format, saturating_cast
from fp8jax.quant import QTensor, dequantize, quantize, quantize_with_scale
from fp8jax.recipes import QuantSpec, Recipe

_F32_MAX = float(jnp.finfo(jnp.float32).max)


# --------------------------------------------------------------------------
# Group bookkeeping
# --------------------------------------------------------------------------


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Expert id of every row (int32 (M,)); ``E`` for rows past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=jnp.int32), side="right").astype(
        jnp.int32
    )


def token_tiles(group_sizes: jax.Array, num_rows: int, tile: int) -> tuple[jax.Array, int]:
    """Tile id of every row for 128x1 (``tile`` x 1) token tiles within expert groups.

    Returns (tile_id int32 (M,), num_tiles): group ``e``'s rows are cut into
    ceil(g_e / tile) tiles starting at the group's first row, numbered
    consecutively over the experts; rows past sum(group_sizes) get the extra
    id ``num_tiles - 1`` (a tile of unassigned rows, which the GEMMs ignore).
    ``num_tiles`` is the static bound ceil(M / tile) + E + 1.
    """
    num_groups = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs
    ntiles = (gs + tile - 1) // tile
    tile_start = jnp.cumsum(ntiles) - ntiles
    gid = row_groups(gs, num_rows)
    gidc = jnp.minimum(gid, num_groups - 1)
    local = jnp.arange(num_rows, dtype=jnp.int32) - starts[gidc]
    num_tiles = -(-num_rows // tile) + num_groups + 1
    tid = jnp.where(gid < num_groups, tile_start[gidc] + local // tile, num_tiles - 1)
    return tid.astype(jnp.int32), num_tiles


class SegmentQ(NamedTuple):
    """An operand quantized with one scale per (segment, column).

    data: FP8 (M, C); scale: float32 (S, C); seg: int32 (M,) segment of each row.
    Value: data[m, c] * scale[seg[m], c].
    """

    data: jax.Array
    scale: jax.Array
    seg: jax.Array


def _finite_f32(t: jax.Array) -> jax.Array:
    # Scales are computed in float32; +-Inf becomes +-float32 max so that it
    # saturates in the cast instead of poisoning its whole tile (as fp8jax.quant does).
    return jnp.clip(t.astype(jnp.float32), -_F32_MAX, _F32_MAX)


def quantize_segments(t: jax.Array, seg: jax.Array, num_segments: int, spec: QuantSpec) -> SegmentQ:
    """Current scaling with one scale per (segment of rows, column): amax over the segment."""
    tf = _finite_f32(t)
    ax = jnp.abs(tf)
    # NaN never raises an amax (finite_amax semantics).
    ax = jnp.where(jnp.isnan(ax), 0.0, ax)
    amax = jax.ops.segment_max(ax, seg, num_segments=num_segments)
    # Empty segments give -inf: treat as all-zero tiles (scale 1).
    amax = jnp.maximum(amax, 0.0)
    scale = scaling.scale_from_amax(amax, spec.fmt, pow2=spec.pow2, amax_floor=spec.amax_floor)
    s_rows = scale[seg]
    data = saturating_cast(scaling.exact_div(tf, s_rows), as_format(spec.fmt))
    return SegmentQ(data, scale, seg)


def _materialize(op, dtype) -> jax.Array:
    if isinstance(op, QTensor):
        return dequantize(op, dtype)
    if isinstance(op, SegmentQ):
        # FP8 -> float32 is exact; one float32 rounding of data * scale.
        return (op.data.astype(jnp.float32) * op.scale[op.seg]).astype(dtype)
    return op.astype(dtype)


# --------------------------------------------------------------------------
# Operand quantization per spec
# --------------------------------------------------------------------------


def _quant_plain(t, spec: QuantSpec, caxis: int, recipe: Recipe, dstate, *, activation: bool):
    """Quantize an operand whose scale groups do not cross experts by construction.

    Activations (M, C) contracted along C (Fprop x, Dgrad dy) and weights
    (E, K, N), through dot_general's per-spec quantizer.  Returns (operand,
    updated delayed state or None).
    """
    if activation and spec.quantized and spec.scaling != "delayed" and spec.granularity == "block":
        raise ValueError(
            "grouped GEMM: 'block' granularity on a token-major activation would mix "
            "experts' tokens in one block; use 'tile', 'row' or 'tensor'"
        )
    return quantize_operand(t, spec, caxis, recipe, dstate)


def _quant_tokens(t, spec: QuantSpec, group_sizes, recipe: Recipe, dstate):
    """Quantize a Wgrad operand (M, C) along the token axis, within expert groups."""
    if not spec.quantized:
        return t.astype(recipe.compute)
    if spec.scaling == "delayed":
        # The same scale the forward/dgrad used for this tensor this step.
        return quantize_with_scale(t, dstate.scale, spec.fmt, "tensor")
    if spec.granularity == "tensor":
        return quantize(t, spec.fmt, "tensor", pow2=spec.pow2, amax_floor=spec.amax_floor)
    m = t.shape[0]
    if spec.granularity == "tile":
        seg, nseg = token_tiles(group_sizes, m, spec.tile)
    elif spec.granularity == "row":
        # One scale per (expert, column): reduced over the expert's tokens.
        seg, nseg = row_groups(group_sizes, m), group_sizes.shape[0] + 1
    else:
        raise ValueError(
            "grouped GEMM: wgrad operands support 'tile', 'row' and 'tensor' granularity, "
            f"got {spec.granularity!r}"
        )
    return quantize_segments(t, seg, nseg, spec)


# --------------------------------------------------------------------------
# The GEMMs (the one place where a kernel can take over)
# --------------------------------------------------------------------------


def _kernel_or_none(a, b, group_sizes, recipe: Recipe, canon: str):
    if canon not in ("fprop", "dgrad") or recipe.impl == "xla":
        return None
    if not (isinstance(a, QTensor) and isinstance(b, QTensor)):
        return None
    if a.granularity != "tile" or a.axis != 1 or a.tile != 128:
        return None
    if b.granularity != "block" or b.tile != 128:
        return None
    try:
        from fp8jax.kernels.dispatch import maybe_grouped_block_gemm
    except ImportError:
        return None
    return maybe_grouped_block_gemm(
        a.data,
        a.scale,
        b.data,
        b.scale,
        group_sizes,
        impl=recipe.impl,
        out_dtype=jnp.float32,
        # Dgrad contracts w's N axis: w (E, K, N) is the kernel's "nk" layout.
        b_layout="kn" if canon == "fprop" else "nk",
    )


_WGRAD_DN = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def grouped_gemm(a, b, group_sizes: jax.Array, recipe: Recipe, canon: str) -> jax.Array:
    """One grouped GEMM of two operands (QTensor / SegmentQ / array), float32 result.

    canon "fprop": a (M, K) x b (E, K, N) -> (M, N); "dgrad": a = dy (M, N),
    b = w (E, K, N) -> (M, K); "wgrad": a = x (M, K), b = dy (M, N) -> (E, K, N).
    Kernel plug-in point: a Pallas grouped kernel is used when it applies.
    """
    out = _kernel_or_none(a, b, group_sizes, recipe, canon)
    if out is not None:
        return out.astype(jnp.float32)
    quantized = any(isinstance(o, QTensor | SegmentQ) for o in (a, b))
    # Dequantized FP8 operands in recipe.dequant_dtype; unquantized ones stay in
    # the compute dtype; float32 accumulation either way.
    dt = jnp.dtype(recipe.dequant_dtype) if quantized else recipe.compute
    af = _materialize(a, dt)
    bf = _materialize(b, dt)
    gs = group_sizes.astype(jnp.int32)
    impl = XLA_GROUPED_IMPL
    if impl == "auto":
        impl = "tiles" if jax.default_backend() == "cpu" else "ragged"
    if impl == "tiles":
        return _tiled_gemm(af, bf, gs, canon)
    if canon == "fprop":
        return lax.ragged_dot(af, bf, gs, preferred_element_type=jnp.float32)
    if canon == "dgrad":
        return lax.ragged_dot(af, jnp.swapaxes(bf, 1, 2), gs, preferred_element_type=jnp.float32)
    if canon == "wgrad":
        return lax.ragged_dot_general(af, bf, gs, _WGRAD_DN, preferred_element_type=jnp.float32)
    raise ValueError(f"unknown GEMM {canon!r}")


# How the XLA path runs the grouped GEMMs: "ragged" (lax.ragged_dot, the GPU
# choice), "tiles" (expert-aligned row tiles and a batched matmul; on CPU
# ragged_dot is ~9x slower than a plain matmul of the same size, the tiles
# ~2x), or "auto" (tiles on CPU, ragged elsewhere).  Read at trace time.
XLA_GROUPED_IMPL = "auto"
TILE_ROWS = 128


def _tile_layout(gs: jax.Array, num_rows: int, tm: int):
    """Expert-aligned row tiles: (source row of each tile row, valid mask, expert of each tile).

    Group e's rows fill ceil(g_e / tm) tiles of ``tm`` rows starting at a tile
    boundary; the static tile count ceil(M / tm) + E bounds sum_e ceil(g_e / tm).
    """
    num_groups = gs.shape[0]
    num_tiles = -(-num_rows // tm) + num_groups
    starts = jnp.cumsum(gs) - gs
    ntiles = (gs + tm - 1) // tm
    tile_end = jnp.cumsum(ntiles)
    tile_start = tile_end - ntiles
    tile_group = jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right")
    tgc = jnp.minimum(tile_group, num_groups - 1).astype(jnp.int32)
    r = jnp.arange(num_tiles * tm, dtype=jnp.int32)
    t = r // tm
    local = (t - tile_start[tgc[t]]) * tm + r % tm
    valid = (tile_group[t] < num_groups) & (local < gs[tgc[t]])
    src = jnp.where(valid, starts[tgc[t]] + local, 0)
    return src, valid, tgc, num_tiles


def _to_tiles(a, src, valid, num_tiles, tm):
    # Padding rows are exact zeros: they add nothing to any product.
    return jnp.where(valid[:, None], a[src], 0).reshape(num_tiles, tm, a.shape[-1])


def _tiled_gemm(af, bf, gs, canon: str) -> jax.Array:
    """The grouped GEMMs as batched matmuls over expert-aligned row tiles (float32 result)."""
    m = af.shape[0]
    tm = TILE_ROWS
    src, valid, tg, nt = _tile_layout(gs, m, tm)
    a_t = _to_tiles(af, src, valid, nt, tm)
    if canon == "wgrad":
        b_t = _to_tiles(bf, src, valid, nt, tm)
        per_tile = jnp.einsum("tmk,tmn->tkn", a_t, b_t, preferred_element_type=jnp.float32)
        return jax.ops.segment_sum(per_tile, tg, num_segments=gs.shape[0])
    if canon == "fprop":
        out_t = jnp.einsum("tmk,tkn->tmn", a_t, bf[tg], preferred_element_type=jnp.float32)
    elif canon == "dgrad":
        out_t = jnp.einsum("tmn,tkn->tmk", a_t, bf[tg], preferred_element_type=jnp.float32)
    else:
        raise ValueError(f"unknown GEMM {canon!r}")
    # Back to the caller's row order: scatter each valid tile row to its source row.
    out = out_t.reshape(nt * tm, -1)
    dst = jnp.where(valid, src, m)
    return jnp.zeros((m, out.shape[-1]), jnp.float32).at[dst].set(out, mode="drop")


# --------------------------------------------------------------------------
# custom VJP
# --------------------------------------------------------------------------


def _part(state, name):
    return None if state is None else getattr(state, name)


def _valid_rows(group_sizes, m):
    return (jnp.arange(m) < jnp.sum(group_sizes.astype(jnp.int32)))[:, None]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_core(x, w, group_sizes, state, recipe: Recipe, dtypes, with_stats: bool):
    out, _ = _grouped_fwd(x, w, group_sizes, state, recipe, dtypes, with_stats)
    return out


def _grouped_fwd(x, w, group_sizes, state, recipe, dtypes, with_stats):
    qx, new_x = _quant_plain(x, recipe.fprop.lhs, 1, recipe, _part(state, "x"), activation=True)
    qw, new_w = _quant_plain(w, recipe.fprop.rhs, 1, recipe, _part(state, "w"), activation=False)
    y = grouped_gemm(qx, qw, group_sizes, recipe, "fprop")
    # Rows that belong to no expert are exactly zero.
    y = jnp.where(_valid_rows(group_sizes, x.shape[0]), y, 0.0).astype(dtypes[0])
    out = y
    if with_stats:
        out = (y, {"x": operand_stats(x, qx), "w": operand_stats(w, qw)})
    # Residuals: the FP8 operands (data + scales), never high-precision copies.
    return out, (qx, qw, group_sizes, state, new_x, new_w)


def _grouped_bwd(recipe, dtypes, with_stats, res, g):
    qx, qw, group_sizes, state, new_x, new_w = res
    _, x_dtype, w_dtype = dtypes
    dy = g[0] if with_stats else g
    m = dy.shape[0]
    # Dgrad: dx = dy @ w^T, contraction over N: dy in 1x128 tiles along N.
    qdy, new_dy = _quant_plain(dy, recipe.dgrad.lhs, 1, recipe, _part(state, "dy"), activation=True)
    if (
        isinstance(qw, QTensor)
        and recipe.dgrad.rhs == recipe.fprop.rhs
        and qw.granularity
        in (
            "tensor",
            "block",
        )
    ):
        # 128x128 blocks (or one tensor scale) serve W and W^T alike: reuse the cache.
        w_d = qw
    else:
        # Other layouts: requantize the cached weight along N (dgrad's contraction axis).
        hp_w = _materialize(qw, jnp.float32)
        if recipe.dgrad.rhs.quantized and recipe.dgrad.rhs.scaling == "delayed":
            w_d = quantize_with_scale(hp_w, state.w.scale, recipe.dgrad.rhs.fmt, "tensor")
        else:
            w_d, _ = _quant_plain(hp_w, recipe.dgrad.rhs, 2, recipe, None, activation=False)
    dx = grouped_gemm(qdy, w_d, group_sizes, recipe, "dgrad")
    dx = jnp.where(_valid_rows(group_sizes, m), dx, 0.0).astype(x_dtype)
    # Wgrad: dw[e] = x_e^T dy_e, contraction over the tokens of expert e.
    # x comes from its cached FP8 copy, requantized in 128x1 tiles per group.
    if (
        isinstance(qx, QTensor)
        and recipe.wgrad.lhs == recipe.fprop.lhs
        and qx.granularity == "tensor"
    ):
        # One tensor scale does not depend on the contraction axis: reuse the cache.
        x_w = qx
    else:
        x_hp = _materialize(qx, jnp.float32)
        x_w = _quant_tokens(x_hp, recipe.wgrad.lhs, group_sizes, recipe, _part(state, "x"))
    dy_w = _quant_tokens(dy, recipe.wgrad.rhs, group_sizes, recipe, _part(state, "dy"))
    dw = grouped_gemm(x_w, dy_w, group_sizes, recipe, "wgrad").astype(w_dtype)
    # Overwrite-with-gradient: the state's cotangent is the updated state.
    dstate = scaling.updated_gemm_state(state, new_x, new_w, new_dy)
    return dx, dw, None, dstate


_grouped_core.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_dot(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
    return_stats: bool = False,
):
    """Grouped expert GEMM ``y[m] = x[m] @ w[e(m)]`` through the recipe (see module docstring).

    Args:
      x: (M, K) routed tokens sorted by expert.
      w: (E, K, N) expert weights.
      group_sizes: int (E,) rows per expert, sum <= M (rows past the sum give 0).
      recipe: precision of Fprop, Dgrad and Wgrad.
      state: DelayedGemmState for delayed recipes (one for all experts); its
        gradient is the updated state.
      preferred_element_type: output dtype (default: result type of x, w).
      return_stats: also return {"x": ..., "w": ...} forward-operand telemetry.
    """
    x = jnp.asarray(x)
    w = jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"grouped_dot wants x (M, K) and w (E, K, N), got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contraction mismatch: x {x.shape} vs w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape ({w.shape[0]},), got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    out_dtype = jnp.dtype(
        preferred_element_type
        if preferred_element_type is not None
        else jnp.result_type(x.dtype, w.dtype)
    )
    dtypes = (out_dtype.name, x.dtype.name, w.dtype.name)
    return _grouped_core(x, w, group_sizes, state, recipe, dtypes, return_stats)
