"""A differentiable FP8 ``dot_general``: Fprop, Dgrad and Wgrad as the recipe says.

Any ``lax.dot_general`` dimension numbers are accepted.  The operands are
first brought to a canonical batched matmul

    x: (B, M, K)   (batch dims, lhs free dims, contracting dims; flattened)
    w: (B, K, N)   (batch dims, contracting dims, rhs free dims; flattened)

by a transpose + reshape *outside* the custom VJP (JAX differentiates those),
so the FP8 core only ever sees ``y = x @ w`` per batch element and its two
gradients:

    fprop  y  = x  @ w     contraction K   x: axis 2,  w: axis 1
    dgrad  dx = dy @ w^T   contraction N   dy: axis 2, w: axis 2
    wgrad  dw = x^T @ dy   contraction M   x: axis 1,  dy: axis 1

Each operand is quantized per its :class:`~fp8jax.recipes.QuantSpec` along
that GEMM's contraction axis (tiles of 1x128 along K for x in fprop, 128x1
along tokens for x and dy in wgrad, 128x128 blocks for w).

Residuals kept for the backward pass are the FP8 data and float32 scales of
x and w (not high-precision copies).  Where the backward GEMM needs another
layout (wgrad's 128x1 tiles of x, dgrad's W^T for row scaling) the cached
FP8 tensor is dequantized and requantized, as DeepSeek-V3 does; a 128x128
block (or a per-tensor) scale serves W and W^T alike and is reused as is.

Each of the three GEMMs runs through the one GEMM core, :func:`fp8jax.gemm.gemm`,
which decides how (``recipe.impl``, the accumulation emulator when
``recipe.accumulation`` is set) and names every dot's algorithm; its
docstring and :class:`~fp8jax.recipes.Recipe` give the numerics of each way.
With ``recipe.x_cache = "e5m6"`` the residual for Wgrad is x in E5M6 with one
power-of-two scale per 1x128 tile (:func:`fp8jax.operands.e5m6_tiles`) instead of
the FP8 operand (DeepSeek-V3's cache for the linear after attention).

Delayed scaling: pass ``state`` (:class:`~fp8jax.scaling.DelayedGemmState`);
its cotangent is the updated state (see that class).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import path_record, scaling
from fp8jax.gemm import dgrad_quantizing, fprop_with_weight, gemm, with_dot_algorithm
from fp8jax.operands import (
    after_gradient,
    cache_for_wgrad,
    materialize,
    quantize_operand,
    quantize_operand_twice,
    requantizable,
    requantize,
    source_values,
    state_part,
    take_operand,
    value_cotangent,
)
from fp8jax.quant import QTensor, is_quantized
from fp8jax.recipes import Recipe
from fp8jax.telemetry import operand_stats

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]

# Canonical contraction axes of each operand in each GEMM (see module docstring).
_FPROP_X_AXIS, _FPROP_W_AXIS = 2, 1
_DGRAD_DY_AXIS, _DGRAD_W_AXIS = 2, 2
_WGRAD_X_AXIS, _WGRAD_DY_AXIS = 1, 1


# --------------------------------------------------------------------------
# The custom VJP core on canonical (B, M, K) x (B, K, N)
# --------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_bmm(x, w, state, recipe: Recipe, dtypes: tuple[str, str, str], with_stats: bool):
    """dtypes: (output, x, w) dtype names (static, so the backward knows them)."""
    out, _ = _fp8_bmm_fwd(x, w, state, recipe, dtypes, with_stats)
    return out


def _fp8_bmm_fwd(x, w, state, recipe, dtypes, with_stats):
    take_w = partial(take_operand, spec=recipe.fprop.rhs, caxis=_FPROP_W_AXIS, recipe=recipe)
    take_x = partial(take_operand, spec=recipe.fprop.lhs, caxis=_FPROP_X_AXIS, recipe=recipe)
    # w quantized (in both layouts where a Hopper GPU reads them), x quantized,
    # then the Fprop (one kernel for x's quantization and the GEMM on a TPU).
    y, qx, new_x, qw, new_w = fprop_with_weight(
        x, w, recipe, take_x, take_w, dtypes[0], state_part(state, "x"), state_part(state, "w")
    )
    # A pre-quantized operand's values, for telemetry and an E5M6 cache only.
    x_hp, w_hp = (source_values(t, jnp.float32) if is_quantized(t) else t for t in (x, w))
    out = (y, {"x": operand_stats(x_hp, qx), "w": operand_stats(w_hp, qw)}) if with_stats else y
    # Residuals: the FP8 operands (data + scales), never high-precision copies
    # (x in E5M6 where the recipe caches it so).
    pre = tuple(t if is_quantized(t) else None for t in (x, w))
    return out, (cache_for_wgrad(x_hp, qx, recipe), qw, state, new_x, new_w, pre)


def _fp8_bmm_bwd(recipe, dtypes, with_stats, res, g):
    x_cached, qw, state, new_x, new_w, (x_pre, w_pre) = res
    _, x_dtype, w_dtype = dtypes
    dy = g[0] if with_stats else g
    # Dgrad: dx = dy @ w^T, with dy quantized for it (contraction over N) and for
    # the Wgrad (over the tokens M); one kernel quantizes dy and multiplies where
    # a TPU runs it.
    w_d = requantize(
        qw, recipe.dgrad.rhs, _DGRAD_W_AXIS, recipe, recipe.fprop.rhs, state_part(state, "w")
    )
    take_both = partial(
        quantize_operand_twice,
        specs=(recipe.dgrad.lhs, recipe.wgrad.rhs),
        caxes=(_DGRAD_DY_AXIS, _WGRAD_DY_AXIS),
        recipe=recipe,
    )
    take_wgrad = partial(
        quantize_operand, spec=recipe.wgrad.rhs, caxis=_WGRAD_DY_AXIS, recipe=recipe
    )
    dx, qdy_w, new_dy = dgrad_quantizing(
        dy,
        w_d,
        recipe.dgrad.lhs,
        recipe,
        take_both,
        take_wgrad,
        x_dtype,
        state_part(state, "dy"),
        wgrad_spec=recipe.wgrad.rhs,
    )
    # Wgrad: dw = x^T @ dy, contraction over the token axis M.
    x_c = after_gradient(x_cached, qdy_w)
    x_w = requantize(
        x_c, recipe.wgrad.lhs, _WGRAD_X_AXIS, recipe, recipe.fprop.lhs, state_part(state, "x")
    )
    # A kernel that requantizes x itself reads its cache (TPU).
    x_src = requantizable(x_c, recipe.wgrad.lhs, _WGRAD_X_AXIS, recipe.fprop.lhs)
    dw = gemm(x_w, qdy_w, "wgrad", recipe, out_dtype=w_dtype, a_source=x_src)
    # Pre-quantized inputs: the gradient of the values they represent.
    dx = dx if x_pre is None else value_cotangent(x_pre, dx)
    dw = dw if w_pre is None else value_cotangent(w_pre, dw)
    # Overwrite-with-gradient: the state's cotangent is the updated state.
    return dx, dw, scaling.updated_gemm_state(state, new_x, new_w, new_dy)


_fp8_bmm.defvjp(_fp8_bmm_fwd, _fp8_bmm_bwd)


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def _canonical_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(a) for a in d) for d in (lc, rc, lb, rb))
    lc = tuple(a % lhs_ndim for a in lc)
    rc = tuple(a % rhs_ndim for a in rc)
    lb = tuple(a % lhs_ndim for a in lb)
    rb = tuple(a % rhs_ndim for a in rb)
    lf = tuple(i for i in range(lhs_ndim) if i not in lc and i not in lb)
    rf = tuple(i for i in range(rhs_ndim) if i not in rc and i not in rb)
    return lc, rc, lb, rb, lf, rf


def dot_general_with_stats(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """:func:`dot_general` and the telemetry of its forward operands.

    Returns (y, {"x": stats, "w": stats}) with stats = {"amax", "saturated",
    "flushed"} float32 scalars (:func:`fp8jax.telemetry.operand_stats`);
    unquantized operands report zero fractions.
    """
    return _run(lhs, rhs, dimension_numbers, recipe, state, preferred_element_type, True)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
    precision: Any = None,
) -> jax.Array:
    """FP8 ``lax.dot_general`` with custom gradients (lhs = activation x, rhs = weight w).

    Args:
      lhs, rhs, dimension_numbers: as ``lax.dot_general`` (batch dims included).
      recipe: the precision of the three GEMMs (fp8jax.recipes).
      state: DelayedGemmState for delayed-scaling recipes; its gradient is
        the updated state (overwrite-with-gradient).
      preferred_element_type: output dtype (default: the inputs' result type).
      precision: accepted so that this function can replace ``lax.dot_general``
        where a caller passes one (Flax's ``dot_general=`` hooks do); ignored:
        the recipe decides the precision.

    Returns:
      The product in ``lax.dot_general`` layout.  Zero-size dimensions give
      what ``lax.dot_general`` gives (an empty or all-zero result).
    """
    del precision
    return _run(lhs, rhs, dimension_numbers, recipe, state, preferred_element_type, False)


def _run(lhs, rhs, dimension_numbers, recipe, state, preferred_element_type, with_stats):
    lhs, rhs = (t if is_quantized(t) else jnp.asarray(t) for t in (lhs, rhs))
    out_shape, out_dtype = _check(lhs, rhs, dimension_numbers, preferred_element_type)
    if not recipe.is_fp8 and (is_quantized(lhs) or is_quantized(rhs)):
        # An unquantized recipe multiplies the values a quantized input represents.
        lhs, rhs = (materialize(t, jnp.float32) if is_quantized(t) else t for t in (lhs, rhs))
    if not recipe.is_fp8 or math.prod(lhs.shape) == 0 or math.prod(rhs.shape) == 0:
        y = _high_precision(lhs, rhs, dimension_numbers, recipe, out_dtype)
        if recipe.is_fp8 and state is not None:
            for part in state:
                scaling.check_delayed_state(part)
            y = _state_unchanged(y, state)
        stats = {"x": operand_stats(lhs, lhs), "w": operand_stats(rhs, rhs)}
        return (y, stats) if with_stats else y
    return _fp8(lhs, rhs, dimension_numbers, recipe, state, out_shape, out_dtype, with_stats)


@jax.custom_vjp
def _state_unchanged(y, state):
    """``y``, with the delayed state's cotangent the state itself (no operand was seen).

    A zero-size GEMM observes no amax: its state update is no update.
    Without this the state would get a zero cotangent, i.e. scale 0.
    """
    del state
    return y


def _state_unchanged_fwd(y, state):
    return y, state


def _state_unchanged_bwd(state, dy):
    return dy, state


_state_unchanged.defvjp(_state_unchanged_fwd, _state_unchanged_bwd)


def _check(lhs, rhs, dimension_numbers, preferred_element_type):
    # Shape check with lax's own rules and messages.
    out_shape = jax.eval_shape(
        partial(lax.dot_general, dimension_numbers=dimension_numbers),
        jax.ShapeDtypeStruct(lhs.shape, jnp.float32),
        jax.ShapeDtypeStruct(rhs.shape, jnp.float32),
    ).shape
    out_dtype = jnp.dtype(
        preferred_element_type
        if preferred_element_type is not None
        else jnp.result_type(*(_value_dtype(t) for t in (lhs, rhs)))
    )
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"fp8jax.dot_general needs floating inputs, got {lhs.dtype}, {rhs.dtype}")
    return out_shape, out_dtype


def _value_dtype(t):
    # A quantized operand's values are float32 (what dequantization gives).
    return jnp.dtype(jnp.float32) if is_quantized(t) else t.dtype


def _canonical_q(q: QTensor, perm: tuple[int, ...], shape: tuple[int, int, int]) -> QTensor:
    """A pre-quantized operand in its canonical (B, ., .) layout: only a
    leading batch axis may be added (no transpose, no merged axes)."""
    if perm != tuple(range(len(q.shape))) or len(q.shape) not in (2, 3):
        raise ValueError(
            "a pre-quantized dot_general operand must be (K, N) / (M, K), or (B, ., .) with "
            f"its batch axis first, in the order the GEMM reads it; got axes {perm} of {q.shape}"
        )
    return q if len(q.shape) == 3 else q.batched(shape)


def _high_precision(lhs, rhs, dimension_numbers, recipe: Recipe, out_dtype) -> jax.Array:
    """The baseline: operands in the compute dtype, float32 accumulation, named algorithm.

    No custom VJP: autodiff keeps the compute-dtype casts.  Also the path of
    zero-size operands, whose product (empty or zeros) involves no rounding.
    """
    c = recipe.compute
    # Autodiff transposes this one op into the Dgrad and Wgrad dots.
    path_record.note_standard_op(f"lax.dot_general {c.name}")
    # The named algorithm of each platform the program may be lowered for.
    y = with_dot_algorithm(
        c,
        lambda alg: lax.dot_general(
            lhs.astype(c),
            rhs.astype(c),
            dimension_numbers,
            precision=alg,
            preferred_element_type=jnp.float32,
        ),
    )
    return y.astype(out_dtype)


def _fp8(lhs, rhs, dimension_numbers, recipe, state, out_shape, out_dtype, with_stats):
    lc, rc, lb, rb, lf, rf = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    bsz = math.prod(lhs.shape[a] for a in lb)
    m = math.prod(lhs.shape[a] for a in lf)
    k = math.prod(lhs.shape[a] for a in lc)
    n = math.prod(rhs.shape[a] for a in rf)
    # Canonical batched matmul: the transposes and reshapes stay outside the
    # custom VJP, where JAX differentiates them.
    x3, w3 = (
        _canonical_q(t, perm, shape) if is_quantized(t) else jnp.transpose(t, perm).reshape(shape)
        for t, perm, shape in ((lhs, lb + lf + lc, (bsz, m, k)), (rhs, rb + rc + rf, (bsz, k, n)))
    )
    # A pre-quantized activation gets its gradient in the output's (the
    # activations') dtype; a pre-quantized weight (an FP8 gather) in float32,
    # its values' dtype, as float32 master weights do.
    dtypes = (
        out_dtype.name,
        out_dtype.name if is_quantized(x3) else x3.dtype.name,
        _value_dtype(w3).name,
    )
    out = _fp8_bmm(x3, w3, state, recipe, dtypes, with_stats)
    if with_stats:
        return out[0].reshape(out_shape), out[1]
    return out.reshape(out_shape)
