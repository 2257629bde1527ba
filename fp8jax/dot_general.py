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

Numerics of a quantized GEMM on the XLA path: both operands are dequantized
(``data * scale``, one float32 rounding) to ``recipe.dequant_dtype`` and
multiplied with float32 accumulation.  With ``dequant_dtype="float32"``
(default) this equals FP8 x FP8 products with FP32 accumulation up to that
rounding; ``"bfloat16"`` is exact only for power-of-two scales and otherwise
adds a relative rounding of at most 2^-9 per element (2-3x faster on CPU).
With ``recipe.accumulation`` set, the products are instead accumulated by the
tensor-core emulator of :mod:`fp8jax.accumulate` (slow, for analysis).

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

from fp8jax import scaling
from fp8jax.formats import fmt_max
from fp8jax.quant import QTensor, dequantize, expand_scale, quantize, quantize_with_scale
from fp8jax.recipes import QuantSpec, Recipe

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]

# Canonical contraction axes of each operand in each GEMM (see module docstring).
_FPROP_X_AXIS, _FPROP_W_AXIS = 2, 1
_DGRAD_DY_AXIS, _DGRAD_W_AXIS = 2, 2
_WGRAD_X_AXIS, _WGRAD_DY_AXIS = 1, 1


# --------------------------------------------------------------------------
# Operands: quantized (QTensor) or kept in the compute dtype (plain array)
# --------------------------------------------------------------------------


def quantize_operand(t, spec: QuantSpec, caxis: int, recipe: Recipe, dstate=None):
    """Quantize one GEMM operand ``t`` per ``spec`` along contraction axis ``caxis``.

    Unquantized specs cast to the recipe's compute dtype; delayed specs use
    ``dstate.scale`` and return the updated state.  Returns (operand, new
    delayed state or None).  Shared by dot_general and the grouped expert GEMM.
    """
    if not spec.quantized:
        # Unquantized operands run in the recipe's compute dtype (bf16 baseline).
        return t.astype(recipe.compute), None
    if spec.scaling == "delayed":
        if dstate is None:
            raise ValueError(
                f"recipe {recipe.name!r} uses delayed scaling: pass "
                "state=fp8jax.scaling.init_delayed_gemm_state(recipe)"
            )
        # Delayed: this step uses the scale computed from the history of
        # previous steps; this step's amax only updates the state.
        q = quantize_with_scale(t, dstate.scale, spec.fmt, "tensor")
        new = scaling.update_delayed_state(dstate, scaling.finite_amax(t), spec, recipe.delayed)
        return q, new
    q = quantize(
        t,
        spec.fmt,
        spec.granularity,
        axis=caxis,
        tile=spec.tile,
        pow2=spec.pow2,
        amax_floor=spec.amax_floor,
    )
    return q, None


def _requantize(op, spec: QuantSpec, caxis: int, recipe: Recipe, prev_spec: QuantSpec, dstate):
    """The operand as ``spec`` wants it, from the cached (quantized) operand.

    Reuses the cached FP8 tensor when its scale layout is already right
    (same spec and a layout that does not depend on the contraction axis:
    per-tensor, or 128x128 blocks, which serve W and W^T alike); otherwise
    dequantizes the cached FP8 values and quantizes them again (DeepSeek-V3
    turns its cached 1x128 activation tiles into 128x1 tiles this way).
    """
    if isinstance(op, QTensor) and spec == prev_spec and spec.granularity in ("tensor", "block"):
        return op
    hp = dequantize(op) if isinstance(op, QTensor) else op
    if spec.quantized and spec.scaling == "delayed":
        # The same tensor was already quantized with this delayed scale.
        q = quantize_with_scale(hp, dstate.scale, spec.fmt, "tensor")
        return q
    out, _ = quantize_operand(hp, spec, caxis, recipe)
    return out


def _materialize(op, dtype) -> jax.Array:
    if isinstance(op, QTensor):
        return dequantize(op, dtype)
    return op.astype(dtype)


def _gemm(a, b, dims: DimensionNumbers, recipe: Recipe, canon: str) -> jax.Array:
    """One GEMM of two operands (QTensor or array) with float32 accumulation."""
    quantized = isinstance(a, QTensor) or isinstance(b, QTensor)
    if recipe.accumulation is not None and quantized:
        from fp8jax.accumulate import emulated_matmul

        af = _materialize(a, jnp.float32)
        bf = _materialize(b, jnp.float32)
        # Bring to (B, M, K) x (B, K, N) for the emulator.
        if canon == "dgrad":  # dy (B,M,N) @ w^T
            bf = jnp.swapaxes(bf, 1, 2)
        elif canon == "wgrad":  # x^T (B,K,M) @ dy (B,M,N)
            af = jnp.swapaxes(af, 1, 2)
        return emulated_matmul(af, bf, recipe.accumulation)
    if quantized:
        if recipe.impl != "xla":
            # Lazy: the Pallas kernels are only imported when a recipe may use them.
            from fp8jax.kernels.integration import block_gemm_or_none

            out = block_gemm_or_none(a, b, recipe, canon)
            if out is not None:
                return out
            if recipe.impl == "pallas":
                raise ValueError(
                    f"recipe {recipe.name!r} asks for impl='pallas' but the Pallas FP8 kernel "
                    f"does not apply to this {canon} GEMM (it needs E4M3/E5M2 operands with "
                    "128-wide tiles along the contraction axis and 128x128 weight blocks)"
                )
        dt = jnp.dtype(recipe.dequant_dtype)
    else:
        dt = jnp.promote_types(a.dtype, b.dtype)
    # Dequantized (or compute-dtype) operands, float32 accumulation.
    af = _materialize(a, dt)
    bf = _materialize(b, dt)
    return lax.dot_general(af, bf, dims, preferred_element_type=jnp.float32)


_FPROP_DIMS = (((2,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,K,N) -> (B,M,N)
_DGRAD_DIMS = (((2,), (2,)), ((0,), (0,)))  # (B,M,N) x (B,K,N) -> (B,M,K)
_WGRAD_DIMS = (((1,), (1,)), ((0,), (0,)))  # (B,M,K) x (B,M,N) -> (B,K,N)


# --------------------------------------------------------------------------
# Telemetry of a quantized operand
# --------------------------------------------------------------------------


def operand_stats(t: jax.Array, op) -> dict[str, jax.Array]:
    """amax, fraction saturated and fraction flushed to zero of one operand.

    saturated: |t| exceeds the largest representable magnitude of its scale
    group (fmt_max * scale) by more than half an ulp of the format, i.e. the
    value was clipped rather than rounded.  flushed: t != 0 but its FP8 code
    is zero (underflow below the smallest subnormal).
    """
    amax = scaling.finite_amax(t)
    if not isinstance(op, QTensor):
        zero = jnp.zeros((), jnp.float32)
        return {"amax": amax, "saturated": zero, "flushed": zero}
    tf = t.astype(jnp.float32)
    fmt = op.data.dtype
    s = expand_scale(op.scale, op.data.shape, op.granularity, op.axis, op.tile)
    eps = float(jnp.finfo(fmt).eps)
    limit = fmt_max(fmt) * (1.0 + eps / 2) * s
    sat = jnp.mean((jnp.abs(tf) > limit).astype(jnp.float32))
    flushed = jnp.mean(((tf != 0) & (op.data.astype(jnp.float32) == 0)).astype(jnp.float32))
    return {"amax": amax, "saturated": sat, "flushed": flushed}


# --------------------------------------------------------------------------
# The custom VJP core on canonical (B, M, K) x (B, K, N)
# --------------------------------------------------------------------------


def _state_part(state, name):
    return None if state is None else getattr(state, name)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_bmm(x, w, state, recipe: Recipe, dtypes: tuple[str, str, str], with_stats: bool):
    """dtypes: (output, x, w) dtype names (static, so the backward knows them)."""
    y, _ = _fp8_bmm_fwd(x, w, state, recipe, dtypes, with_stats)
    return y


def _fp8_bmm_fwd(x, w, state, recipe, dtypes, with_stats):
    out_dtype = dtypes[0]
    qx, new_x = quantize_operand(
        x, recipe.fprop.lhs, _FPROP_X_AXIS, recipe, _state_part(state, "x")
    )
    qw, new_w = quantize_operand(
        w, recipe.fprop.rhs, _FPROP_W_AXIS, recipe, _state_part(state, "w")
    )
    y = _gemm(qx, qw, _FPROP_DIMS, recipe, "fprop").astype(out_dtype)
    stats = None
    if with_stats:
        stats = {"x": operand_stats(x, qx), "w": operand_stats(w, qw)}
    out = (y, stats) if with_stats else y
    # Residuals: the FP8 operands (data + scales), never high-precision copies.
    res = (qx, qw, state, new_x, new_w)
    return out, res


def _fp8_bmm_bwd(recipe, dtypes, with_stats, res, g):
    qx, qw, state, new_x, new_w = res
    _, x_dtype, w_dtype = dtypes
    dy = g[0] if with_stats else g
    # dgrad: dx = dy @ w^T, contraction over N.
    qdy_d, new_dy = quantize_operand(
        dy, recipe.dgrad.lhs, _DGRAD_DY_AXIS, recipe, _state_part(state, "dy")
    )
    w_d = _requantize(
        qw, recipe.dgrad.rhs, _DGRAD_W_AXIS, recipe, recipe.fprop.rhs, _state_part(state, "w")
    )
    dx = _gemm(qdy_d, w_d, _DGRAD_DIMS, recipe, "dgrad").astype(x_dtype)
    # wgrad: dw = x^T @ dy, contraction over the token axis M.
    x_w = _requantize(
        qx, recipe.wgrad.lhs, _WGRAD_X_AXIS, recipe, recipe.fprop.lhs, _state_part(state, "x")
    )
    if recipe.wgrad.rhs == recipe.dgrad.lhs and recipe.wgrad.rhs.granularity == "tensor":
        qdy_w = qdy_d
    else:
        qdy_w, _ = quantize_operand(
            dy, recipe.wgrad.rhs, _WGRAD_DY_AXIS, recipe, _state_part(state, "dy")
        )
    dw = _gemm(x_w, qdy_w, _WGRAD_DIMS, recipe, "wgrad").astype(w_dtype)
    # Overwrite-with-gradient: the state's cotangent is the updated state.
    dstate = scaling.updated_gemm_state(state, new_x, new_w, new_dy)
    return dx, dw, dstate


_fp8_bmm.defvjp(_fp8_bmm_fwd, _fp8_bmm_bwd)


# --------------------------------------------------------------------------
# Public entry point
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


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
    precision: Any = None,
    return_stats: bool = False,
):
    """FP8 ``lax.dot_general`` with custom gradients (lhs = activation x, rhs = weight w).

    Args:
      lhs, rhs, dimension_numbers: as ``lax.dot_general``.
      recipe: the precision of the three GEMMs (fp8jax.recipes).
      state: DelayedGemmState for delayed-scaling recipes; its gradient is
        the updated state (overwrite-with-gradient).
      preferred_element_type: output dtype (default: the inputs' result type).
      precision: accepted for drop-in compatibility, ignored (the recipe
        decides the precision).
      return_stats: also return {"x": ..., "w": ...} telemetry dicts (amax,
        saturated and flushed fractions) of the forward operands.

    Returns:
      The product in ``lax.dot_general`` layout (and the stats if asked).
    """
    del precision
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    # Shape check with lax's own rules and messages.
    out_shape = jax.eval_shape(
        partial(lax.dot_general, dimension_numbers=dimension_numbers),
        jax.ShapeDtypeStruct(lhs.shape, jnp.float32),
        jax.ShapeDtypeStruct(rhs.shape, jnp.float32),
    ).shape
    out_dtype = jnp.dtype(
        preferred_element_type
        if preferred_element_type is not None
        else jnp.result_type(lhs.dtype, rhs.dtype)
    )
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"fp8jax.dot_general needs floating inputs, got {lhs.dtype}, {rhs.dtype}")

    if not recipe.is_fp8:
        # The high-precision baseline: operands in the compute dtype, float32
        # accumulation, no custom VJP (autodiff saves the compute-dtype casts).
        c = recipe.compute
        y = lax.dot_general(
            lhs.astype(c), rhs.astype(c), dimension_numbers, preferred_element_type=jnp.float32
        ).astype(out_dtype)
        if return_stats:
            zero = jnp.zeros((), jnp.float32)
            st = {"amax": zero, "saturated": zero, "flushed": zero}
            return y, {
                "x": {**st, "amax": scaling.finite_amax(lhs)},
                "w": {**st, "amax": scaling.finite_amax(rhs)},
            }
        return y

    lc, rc, lb, rb, lf, rf = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    bsz = math.prod(lhs.shape[a] for a in lb)
    m = math.prod(lhs.shape[a] for a in lf)
    k = math.prod(lhs.shape[a] for a in lc)
    n = math.prod(rhs.shape[a] for a in rf)
    x3 = jnp.transpose(lhs, lb + lf + lc).reshape(bsz, m, k)
    w3 = jnp.transpose(rhs, rb + rc + rf).reshape(bsz, k, n)
    dtypes = (out_dtype.name, x3.dtype.name, w3.dtype.name)
    res = _fp8_bmm(x3, w3, state, recipe, dtypes, return_stats)
    y3, stats = res if return_stats else (res, None)
    y = y3.reshape(out_shape)
    return (y, stats) if return_stats else y


def make_dot_general(recipe: Recipe):
    """A ``dot_general`` callable for Flax layers' ``dot_general=`` argument.

    Only for recipes without delayed scaling (which need explicit state; use
    the fp8jax.nn layers for those).
    """
    from fp8jax.recipes import needs_state

    if needs_state(recipe):
        raise ValueError("delayed-scaling recipes need state: use fp8jax.nn layers")

    def _dg(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        return dot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe=recipe,
            preferred_element_type=preferred_element_type,
        )

    return _dg
