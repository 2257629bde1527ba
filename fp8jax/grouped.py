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
contraction axis, exactly as for the dense :func:`fp8jax.dot_general` (the
two share :mod:`fp8jax.operands` and the GEMM core :mod:`fp8jax.gemm`):

* Fprop: x in 1x128 tiles along K, w in 128x128 blocks of each expert's
  (K, N) matrix.
* Dgrad: dy in 1x128 tiles along N; the cached FP8 weight blocks are reused
  (a 128x128 block serves W and W^T alike).
* Wgrad: the contraction axis is the token axis.  x (from its cached FP8
  copy, as DeepSeek-V3 does) and dy are laid out in expert-aligned tiles of
  128 rows (:mod:`fp8jax.groups`) and quantized in 128x1 tiles along the
  tokens of each tile, so no tile straddles two experts.  ``"row"`` means one
  scale per (expert, column); ``"tensor"`` one scale for the whole operand
  (all experts), current or delayed.

The GEMMs run as batched GEMMs over those tiles through the GEMM core, so a
recipe's implementation choice and its accumulation emulator reach the
expert GEMMs exactly as they reach the dense ones.  Residuals kept for the
backward pass: the FP8 data and scales of x and w.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import platforms, scaling, schemes
from fp8jax.gemm import grouped_gemm, grouped_kernels, tile_rows, weight_both_layouts
from fp8jax.groups import (
    GroupLayout,
    check_group_sizes,
    group_layout,
    group_sizes_valid,
    to_tiles,
)
from fp8jax.layout import Layout
from fp8jax.operands import (
    after_gradient,
    cache_for_wgrad,
    materialize,
    quantize_operand,
    requantize,
    requantize_gpu_kernel,
    requantize_kernel_fits,
    requantize_tpu_kernel,
    source_values,
    state_part,
    take_operand,
    value_cotangent,
)
from fp8jax.quant import QTensor, float32_scales, gpu_kernels, group_amax, is_quantized
from fp8jax.recipes import QuantSpec, Recipe
from fp8jax.telemetry import operand_stats

TILE_ROWS = 128


def _layout_tile(recipe: Recipe) -> int:
    """Rows per expert-aligned tile: the Wgrad token-tile length (128 in DeepSeek-V3)."""
    specs = (recipe.wgrad.lhs, recipe.wgrad.rhs)
    tiles = {s.tile for s in specs if s.quantized and Layout.of(s).tiled}
    if len(tiles) > 1:
        raise ValueError(f"grouped GEMM: the two Wgrad operands need one token tile, got {tiles}")
    return tiles.pop() if tiles else TILE_ROWS


def _quantize_rows(t, spec: QuantSpec, recipe: Recipe, dstate):
    """Quantize a token-major (M, C) Fprop/Dgrad operand along C (row-local scale groups)."""
    if spec.quantized and spec.scaling != "delayed" and Layout.of(spec).blocked:
        raise ValueError(
            "grouped GEMM: 'block' granularity on a token-major activation would mix "
            "experts' tokens in one block; use 'tile', 'row' or 'tensor'"
        )
    return quantize_operand(t, spec, 1, recipe, dstate)


def _quantize_tokens(t_tiles, spec: QuantSpec, layout: GroupLayout, recipe: Recipe, dstate):
    """Quantize a Wgrad operand in tiles (T, tile, C) along the token axis, within experts."""
    if spec.quantized and spec.scaling == "current" and Layout.of(spec).per_row:
        # One scale per (expert, column): the max over the expert's tiles.
        tile_amax = group_amax(t_tiles, "row", axis=1)  # (T, 1, C)
        seg = jnp.where(layout.tile_group >= 0, layout.tile_group, layout.num_tiles)
        expert_amax = jax.ops.segment_max(tile_amax, seg, num_segments=layout.num_tiles + 1)
        amax = jnp.maximum(expert_amax[seg], 0.0)
        # The GEMM multiplies float32 scales (UE8M0 bytes decoded, exact).
        return float32_scales(schemes.quantize(t_tiles, spec, 1, amax=amax))
    if spec.quantized and spec.scaling == "current" and Layout.of(spec).blocked:
        raise ValueError(
            "grouped GEMM: Wgrad operands support 'tile', 'row' and 'tensor' granularity, "
            f"got {spec.granularity!r}"
        )
    if spec.quantized and spec.scaling == "delayed":
        # The same scale the forward / Dgrad used for this tensor this step.
        return float32_scales(schemes.quantize(t_tiles, spec, 1, scale=dstate.scale))
    out, _ = quantize_operand(t_tiles, spec, 1, recipe)
    return out


def _tokens_from_cache(x_cached, spec: QuantSpec, layout: GroupLayout, recipe: Recipe, dstate):
    """Wgrad's x in token tiles quantized along the tokens, from x's cache (M, K).

    Where the requantizing kernels fit (FP8 codes in 1x128 tiles to
    128-token tiles), the codes and their scales are laid out in tiles
    (padding: code 0, scale 1, the value 0 that ``to_tiles`` pads with) and
    requantized by a kernel: the codes and scales of dequantizing, tiling
    and quantizing, with no float32 copy of x in HBM.  On a TPU with the
    whole cache's subnormal flag; on a CUDA GPU the new codes are written
    K-major, as the grouped Wgrad kernel reads them.
    """

    def dequantized():
        x_t = to_tiles(materialize(x_cached, jnp.float32), layout)
        return _quantize_tokens(x_t, spec, layout, recipe, dstate)

    if not (is_quantized(x_cached) and requantize_kernel_fits(x_cached, spec, 0)):
        return dequantized()

    def tpu_kernel():
        q = float32_scales(x_cached)
        return requantize_tpu_kernel(tile_rows(q, layout), spec, q.scale)

    def gpu_kernel():
        return gpu_requantized_tiles(tile_rows(x_cached, layout), spec)

    def decide(p: str) -> str:
        if p == "tpu":
            return "tpu kernel"
        return "gpu kernel" if p == "cuda" and gpu_kernels() is not None else "dequantized"

    ways = {"tpu kernel": tpu_kernel, "gpu kernel": gpu_kernel, "dequantized": dequantized}
    return platforms.choose(decide, ways.__getitem__)


def gpu_requantized_tiles(tiles: QTensor, spec: QuantSpec, interpret: bool = False) -> QTensor:
    """A cache's FP8 codes laid out in 128-token tiles (T, 128, K), 1x128 tiles along K,
    quantized again in 128x1 tiles along the tokens by the GPU requantizer
    (:func:`fp8jax.operands.requantize_gpu_kernel`; ``interpret``: in its interpreter).

    The tiles' rows are one (T * 128, K) cache whose 128-row tiles are the
    token tiles: one 2-D kernel (no batch axis), its codes written K-major,
    which the grouped Wgrad kernel reads without a transpose.
    """
    t, rows, k = tiles.shape
    flat = dataclasses.replace(
        tiles,
        data=tiles.data.reshape(t * rows, k),
        scale=tiles.scale.reshape(t * rows, -1),
        layout=dataclasses.replace(tiles.layout, axis=1),
        # No GEMM or requantizer reads the values a cache was made from.
        source=None,
    )
    out = requantize_gpu_kernel(flat, spec, interpret)
    return dataclasses.replace(
        out,
        data=out.data.reshape(t, rows, k),
        scale=out.scale.reshape(t, 1, k),
        layout=Layout(spec.granularity, 1, spec.tile),
    )


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_core(x, w, group_sizes, state, recipe: Recipe, dtypes, with_stats: bool):
    out, _ = _grouped_fwd(x, w, group_sizes, state, recipe, dtypes, with_stats)
    return out


def _grouped_fwd(x, w, group_sizes, state, recipe, dtypes, with_stats):
    layout = group_layout(group_sizes, x.shape[0], _layout_tile(recipe))
    if is_quantized(x):
        # Quantized before it got here (the FP8 expert dispatch): used as is.
        qx, new_x = take_operand(x, recipe.fprop.lhs, 1, recipe)
    else:
        qx, new_x = _quantize_rows(x, recipe.fprop.lhs, recipe, state_part(state, "x"))
    # A weight gathered in FP8 arrives quantized: used as is.  Otherwise its
    # codes in both layouts where a Hopper GPU's grouped kernel reads them.
    take_w = partial(take_operand, spec=recipe.fprop.rhs, caxis=1, recipe=recipe)

    # The layout is an operand: a branch lowered later closes over no traced value.
    def fprop(qw, codes_t, qx, layout):
        return grouped_gemm(qx, qw, layout, "fprop", recipe, w.shape[0], dtypes[0], codes_t)

    def kernel_reads(p: str, qw) -> bool:
        return grouped_kernels(qx, qw, layout, "fprop", recipe).get(p) == ("pallas", "compiled")

    y, qw, new_w = weight_both_layouts(
        w, recipe, take_w, state_part(state, "w"), fprop, (qx, layout), kernel_reads
    )
    # A pre-quantized input's values, only for telemetry / an E5M6 cache.
    x_hp, w_hp = (source_values(t, jnp.float32) if is_quantized(t) else t for t in (x, w))
    out = (y, {"x": operand_stats(x_hp, qx), "w": operand_stats(w_hp, qw)}) if with_stats else y
    # Residuals: the FP8 operands (data + scales), never high-precision copies.
    pre = tuple(t if is_quantized(t) else None for t in (x, w))
    res = (cache_for_wgrad(x_hp, qx, recipe), qw, group_sizes, state, new_x, new_w, pre)
    return out, res


def _grouped_bwd(recipe, dtypes, with_stats, res, g):
    x_cached, qw, group_sizes, state, new_x, new_w, (x_pre, w_pre) = res
    _, x_dtype, w_dtype = dtypes
    dy = g[0] if with_stats else g
    num_groups = qw.shape[0]
    layout = group_layout(group_sizes, dy.shape[0], _layout_tile(recipe))
    # Dgrad: dx = dy @ w^T, contraction over N: dy in 1x128 tiles along N.
    if recipe.dgrad.lhs.quantized and Layout.of(recipe.dgrad.lhs).blocked:
        # 128x128 blocks of dy within each expert's tiles (never across experts).
        qdy, new_dy = quantize_operand(
            to_tiles(dy, layout), recipe.dgrad.lhs, 2, recipe, state_part(state, "dy")
        )
    else:
        qdy, new_dy = _quantize_rows(dy, recipe.dgrad.lhs, recipe, state_part(state, "dy"))
    w_d = requantize(qw, recipe.dgrad.rhs, 2, recipe, recipe.fprop.rhs, state_part(state, "w"))
    dx = grouped_gemm(qdy, w_d, layout, "dgrad", recipe, num_groups, x_dtype)
    x_cached = after_gradient(x_cached, qdy)
    # Wgrad: dw[e] = x_e^T dy_e over expert-aligned tiles of tokens; x from its cache.
    if is_quantized(x_cached) and recipe.wgrad.lhs == recipe.fprop.lhs:
        reuse = x_cached.layout.per_tensor
    else:
        reuse = False
    if reuse:
        # One tensor scale does not depend on the contraction axis: keep the codes.
        x_w = dataclasses.replace(
            x_cached,
            data=to_tiles(x_cached.data, layout),
            layout=dataclasses.replace(x_cached.layout, axis=0),
        )
    else:
        x_w = _tokens_from_cache(x_cached, recipe.wgrad.lhs, layout, recipe, state_part(state, "x"))
    dy_w = _quantize_tokens(
        to_tiles(dy, layout), recipe.wgrad.rhs, layout, recipe, state_part(state, "dy")
    )
    dw = grouped_gemm(x_w, dy_w, layout, "wgrad", recipe, num_groups, w_dtype)
    # Overwrite-with-gradient: the state's cotangent is the updated state.
    dstate = scaling.updated_gemm_state(state, new_x, new_w, new_dy)
    # Pre-quantized inputs: the gradient of the values they represent.
    dx = dx if x_pre is None else value_cotangent(x_pre, dx)
    dw = dw if w_pre is None else value_cotangent(w_pre, dw)
    return dx, dw, None, dstate


_grouped_core.defvjp(_grouped_fwd, _grouped_bwd)


def _check(x, w, group_sizes, preferred_element_type):
    if is_quantized(x) and not (x.layout.tiled and x.layout.runs_along(1)):
        raise ValueError("grouped_dot: a pre-quantized x must be in 1 x tile tiles along K")
    if len(x.shape) != 2 or len(w.shape) != 3:
        raise ValueError(f"grouped_dot wants x (M, K) and w (E, K, N), got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"contraction mismatch: x {x.shape} vs w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must have shape ({w.shape[0]},), got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be integer, got {group_sizes.dtype}")
    check_group_sizes(group_sizes, x.shape[0])
    # A quantized input's values are float32 (what dequantization gives).
    value = [jnp.dtype(jnp.float32) if is_quantized(t) else jnp.dtype(t.dtype) for t in (x, w)]
    out_dtype = jnp.dtype(
        preferred_element_type if preferred_element_type is not None else jnp.result_type(*value)
    )
    # A pre-quantized activation (tokens dispatched in FP8) gets its gradient
    # in the output's (the activations') dtype; a pre-quantized weight (an
    # FP8 gather) in float32, its values' dtype, as float32 master weights do.
    x_dtype = out_dtype if is_quantized(x) else value[0]
    w_dtype = value[1]
    return (out_dtype.name, x_dtype.name, w_dtype.name)


def grouped_dot_with_stats(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """:func:`grouped_dot` and the telemetry of its forward operands (as ``dot_general_with_stats``)."""
    return _run(x, w, group_sizes, recipe, state, preferred_element_type, True)


def grouped_dot(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """Grouped expert GEMM ``y[m] = x[m] @ w[e(m)]`` through the recipe (see module docstring).

    Args:
      x: (M, K) routed tokens sorted by expert, or a QTensor of them already
        quantized in 1 x tile tiles along K (the FP8 expert dispatch); its
        gradient is then a QTensor whose ``data`` holds the gradient of the
        represented values.
      w: (E, K, N) expert weights.
      group_sizes: int (E,) rows per expert, sum <= M (rows past the sum give 0).
        Negative sizes or sizes summing past M raise a ValueError when
        concrete; traced (under ``jax.jit``) they make every output NaN.
      recipe: precision of Fprop, Dgrad and Wgrad.
      state: DelayedGemmState for delayed recipes (one for all experts); its
        gradient is the updated state.
      preferred_element_type: output dtype (default: result type of x, w).
    """
    return _run(x, w, group_sizes, recipe, state, preferred_element_type, False)


def _run(x, w, group_sizes, recipe, state, preferred_element_type, with_stats):
    x, w = (t if is_quantized(t) else jnp.asarray(t) for t in (x, w))
    group_sizes = jnp.asarray(group_sizes)
    dtypes = _check(x, w, group_sizes, preferred_element_type)
    if 0 in x.shape or 0 in w.shape:
        # Zero-size operands involve no rounding: what lax.ragged_dot gives
        # (all zeros for K = 0, an empty result otherwise).
        y = jnp.zeros((x.shape[0], w.shape[2]), dtypes[0])
        w_values = source_values(w, jnp.float32) if is_quantized(w) else w
        stats = {
            "x": operand_stats(materialize(x, jnp.float32), x),
            "w": operand_stats(w_values, w),
        }
        return (y, stats) if with_stats else y
    out = _grouped_core(x, w, group_sizes, state, recipe, dtypes, with_stats)
    if isinstance(group_sizes, jax.core.Tracer):
        # Invalid traced sizes cannot raise (eager ones did, in _check):
        # poison the product instead of returning silently wrong rows.
        y, stats = out if with_stats else (out, None)
        y = jnp.where(group_sizes_valid(group_sizes, x.shape[0]), y, jnp.nan)
        out = (y, stats) if with_stats else y
    return out
