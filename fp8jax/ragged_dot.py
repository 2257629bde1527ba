"""The MoE expert GEMM with ``jax.lax.ragged_dot``'s signature, through a recipe.

    y = ragged_dot(lhs (M, K), rhs (G, K, N), group_sizes (G,), recipe=r) -> (M, N)

Rows ``[sum(g[:e]), sum(g[:e+1]))`` of ``lhs`` use ``rhs[e]``; rows past
``sum(group_sizes)`` give 0 (as ``lax.ragged_dot``).  Differentiable in
``lhs`` and ``rhs``.

* A recipe that quantizes (any FP8 / block-format preset) runs the grouped
  GEMM core, :func:`fp8jax.grouped.grouped_dot`: Fprop, Dgrad and Wgrad as
  the recipe says, Wgrad's token tiles never straddle two groups.
* An unquantized recipe (bf16, fp32) is the standard op: ``lax.ragged_dot``
  on operands cast to ``recipe.compute_dtype``, float32 accumulation with
  the dtype's named algorithm (:func:`fp8jax.gemm.dot_algorithm`), one
  rounding to the output dtype; JAX differentiates it.

Group sizes: negative sizes or sizes summing past M raise a ValueError when
they are concrete; traced sizes (under ``jax.jit``) cannot raise, so an
invalid set makes every output element NaN instead of a silently wrong
product.  Zero-size operands give what ``lax.ragged_dot`` gives (zeros for
K = 0, an empty result for M = 0 or N = 0).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import path_record, scaling
from fp8jax.gemm import with_dot_algorithm
from fp8jax.grouped import grouped_dot_with_stats
from fp8jax.groups import check_group_sizes, group_sizes_valid
from fp8jax.quant import QTensor, is_quantized
from fp8jax.recipes import Recipe
from fp8jax.telemetry import operand_stats


def ragged_dot_with_stats(
    lhs: jax.Array | QTensor,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, dict[str, dict[str, jax.Array]]]:
    """:func:`ragged_dot` and the telemetry of its forward operands.

    Returns (y, {"x": stats, "w": stats}) as
    :func:`fp8jax.dot_general_with_stats`; unquantized operands report zero
    fractions.
    """
    lhs, rhs = (t if is_quantized(t) else jnp.asarray(t) for t in (lhs, rhs))
    group_sizes = jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    if recipe.is_fp8 or is_quantized(lhs) or is_quantized(rhs):
        # Pre-quantized operands (FP8 expert dispatch, FP8 FSDP gathers) only
        # the grouped core takes.
        y, stats = grouped_dot_with_stats(
            lhs,
            rhs,
            group_sizes,
            recipe=recipe,
            state=state,
            preferred_element_type=preferred_element_type,
        )
        # (which makes the product NaN for invalid traced group sizes).
    else:
        y = _standard(lhs, rhs, group_sizes, recipe, preferred_element_type)
        stats = {"x": operand_stats(lhs, lhs), "w": operand_stats(rhs, rhs)}
        if isinstance(group_sizes, jax.core.Tracer):
            # Invalid traced sizes cannot raise: poison the product instead.
            y = jnp.where(group_sizes_valid(group_sizes, lhs.shape[0]), y, jnp.nan)
    return y, stats


def ragged_dot(
    lhs: jax.Array | QTensor,
    rhs: jax.Array | QTensor,
    group_sizes: jax.Array,
    *,
    recipe: Recipe,
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
    precision: Any = None,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """``lax.ragged_dot`` through ``recipe`` (see the module docstring).

    Args:
      lhs: (M, K) rows sorted by group, or a QTensor of them quantized in
        1 x tile tiles along K (see :func:`fp8jax.grouped.grouped_dot`).
      rhs: (G, K, N) one weight matrix per group, or a QTensor of them
        quantized as the recipe's weight spec says (an FP8 FSDP gather).
      group_sizes: int (G,) rows per group, each >= 0, sum <= M.
      recipe: precision of Fprop, Dgrad and Wgrad.
      state: DelayedGemmState for delayed-scaling recipes (one for all
        groups); its gradient is the updated state.
      preferred_element_type: output dtype (default: result type of lhs, rhs).
      precision: accepted so this function can stand where ``lax.ragged_dot``
        is called; ignored: the recipe decides the precision.
      group_offset: must be None (``lax.ragged_dot`` does not implement it
        either).
    """
    del precision
    if group_offset is not None:
        raise NotImplementedError("fp8jax.ragged_dot: group_offset is not supported")
    y, _ = ragged_dot_with_stats(
        lhs,
        rhs,
        group_sizes,
        recipe=recipe,
        state=state,
        preferred_element_type=preferred_element_type,
    )
    return y


def _check(lhs, rhs, group_sizes) -> None:
    if len(lhs.shape) != 2 or rhs.ndim != 3:
        raise ValueError(
            f"ragged_dot wants lhs (M, K) and rhs (G, K, N), got {lhs.shape}, {rhs.shape}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"ragged_dot: contraction mismatch, lhs {lhs.shape} vs rhs {rhs.shape}")
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        # A quantized operand carries FP8 codes: what counts is what it stands for.
        if not is_quantized(t) and not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"fp8jax.ragged_dot needs floating operands, got {name} {t.dtype}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(
            f"ragged_dot: group_sizes must have shape ({rhs.shape[0]},), got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"ragged_dot: group_sizes must be integer, got {group_sizes.dtype}")
    check_group_sizes(group_sizes, lhs.shape[0])


def _standard(lhs, rhs, group_sizes, recipe: Recipe, preferred_element_type) -> jax.Array:
    """The baseline: ``lax.ragged_dot`` in the compute dtype, float32 accumulation."""
    out_dtype = jnp.dtype(
        preferred_element_type
        if preferred_element_type is not None
        else jnp.result_type(lhs.dtype, rhs.dtype)
    )
    c = recipe.compute
    # Autodiff transposes this one op into the Dgrad and Wgrad GEMMs.
    with path_record.scope("expert"):
        path_record.note_standard_op(f"lax.ragged_dot {c.name}")
    # Operands rounded once to the compute dtype (bfloat16 in the bf16
    # baseline), products accumulated in float32, one rounding to the output.
    # The named algorithm of each platform the program may be lowered for.
    y = with_dot_algorithm(
        c,
        lambda alg: lax.ragged_dot(
            lhs.astype(c),
            rhs.astype(c),
            group_sizes,
            precision=alg,
            preferred_element_type=jnp.float32,
        ),
    )
    return y.astype(out_dtype)
