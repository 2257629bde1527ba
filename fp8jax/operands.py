"""GEMM operands as a recipe wants them: quantized, re-quantized, cached, materialized.

Shared by the dense ``dot_general`` and the grouped expert GEMM, whose three
GEMMs (Fprop, Dgrad, Wgrad) take their operands from here.  An operand is
either a :class:`~fp8jax.quant.QTensor` (FP8 codes + float32 scales) or a
plain array in the recipe's compute dtype (an unquantized spec).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import blockscaled, scaling
from fp8jax.formats import round_to_e5m6
from fp8jax.microscaling import BlockTensor, dequantize_blocks
from fp8jax.quant import QTensor, dequantize, quantize, quantize_with_scale
from fp8jax.recipes import QuantSpec, Recipe


def state_part(state: scaling.DelayedGemmState | None, name: str):
    """The delayed state of one operand ("x", "w", "dy"), or None without state."""
    return None if state is None else getattr(state, name)


def quantize_operand(
    t: jax.Array, spec: QuantSpec, caxis: int, recipe: Recipe, dstate=None
) -> tuple[QTensor | jax.Array, scaling.DelayedState | None]:
    """Quantize ``t`` per ``spec`` along contraction axis ``caxis``.

    Returns (operand, updated delayed state or None).  Unquantized specs cast
    to the recipe's compute dtype; delayed specs quantize with
    ``dstate.scale`` (from previous steps) and return the state updated with
    this step's amax.
    """
    if not spec.quantized:
        # Unquantized operands run in the recipe's compute dtype (bf16 baseline).
        return t.astype(recipe.compute), None
    if blockscaled.is_block_format(spec.fmt):
        # MXFP8 / NVFP4: the format's own online block scales (fp8jax.blockscaled).
        return blockscaled.quantize_spec_operand(t, spec, caxis, recipe.seed), None
    if spec.scaling == "delayed":
        if dstate is None:
            raise ValueError(
                f"recipe {recipe.name!r} uses delayed scaling: pass "
                "state=fp8jax.scaling.init_delayed_gemm_state(recipe)"
            )
        scaling.check_delayed_state(dstate, spec.fmt, pow2=spec.pow2)
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


def requantize(
    cached, spec: QuantSpec, caxis: int, recipe: Recipe, prev_spec: QuantSpec, dstate=None
) -> QTensor | jax.Array:
    """The operand as ``spec`` wants it, from its cached copy (QTensor or array).

    Reuses the cached FP8 tensor when its scale layout is already right (same
    spec and a layout that does not depend on the contraction axis: per
    tensor, or 128x128 blocks, which serve W and W^T alike); otherwise
    dequantizes the cached values and quantizes them again along ``caxis``
    (DeepSeek-V3 turns its cached 1x128 activation tiles into 128x1 tiles this
    way).  A delayed spec re-uses this step's delayed scale of the tensor.
    """
    if (
        isinstance(cached, QTensor | BlockTensor)
        and spec == prev_spec
        and spec.granularity in ("tensor", "block")
    ):
        return cached
    hp = materialize(cached, jnp.float32)
    if spec.quantized and spec.scaling == "delayed":
        # The same tensor was already quantized with this delayed scale this step.
        return quantize_with_scale(hp, dstate.scale, spec.fmt, "tensor")
    out, _ = quantize_operand(hp, spec, caxis, recipe)
    return out


def materialize(op, dtype) -> jax.Array:
    """A QTensor dequantized to ``dtype`` (one float32 rounding of data * scale), or an array cast."""
    if isinstance(op, QTensor):
        return dequantize(op, dtype)
    if isinstance(op, BlockTensor):
        return dequantize_blocks(op, dtype)
    return op.astype(dtype)


def after_gradient(cached, qdy):
    """The cached FP8 ``cached`` (a QTensor), usable only once ``qdy`` exists; same values.

    Wgrad re-quantizes the cached activation, work that depends on forward
    values only, so XLA may schedule it for every layer during the forward
    pass and keep each result (widened to float32 for its dot on a CPU)
    alive until that layer's backward step, which undoes what the FP8 cache
    saves.  OR-ing min(b, 0) of the bit pattern b of the gradient's first
    scale (0: scales are positive) into the cached scales' bit patterns makes
    the work wait for this layer's gradient without changing a bit.  Anything
    else passes through.
    """
    if not (isinstance(cached, QTensor) and isinstance(qdy, QTensor)):
        return cached
    # On the bit patterns (an integer OR of 0), so a subnormal scale is not
    # flushed as a float addition on a flush-to-zero backend would.
    dep = jax.lax.bitcast_convert_type(qdy.scale.reshape(-1)[0].astype(jnp.float32), jnp.int32)
    bits = jax.lax.bitcast_convert_type(cached.scale.astype(jnp.float32), jnp.int32)
    scale = jax.lax.bitcast_convert_type(bits | jnp.minimum(dep, 0), jnp.float32)
    return QTensor(
        cached.data, scale.astype(cached.scale.dtype), cached.granularity, cached.axis, cached.tile
    )


def cache_for_wgrad(x: jax.Array, qx, recipe: Recipe):
    """What the forward pass keeps of x for Wgrad (the residual).

    By default the FP8 operand itself (codes + scales, no high-precision
    copy); with ``recipe.x_cache == "e5m6"`` a copy of x rounded to E5M6,
    stored in bfloat16 (which holds every E5M6 value exactly).
    """
    if blockscaled.is_block_format(recipe.wgrad.lhs.fmt):
        # Block formats quantize Wgrad's x along the tokens (after the RHT) from
        # x itself, as Transformer Engine's columnwise copy is made from the
        # high-precision tensor: re-quantizing 4-bit codes would round twice.
        return x
    if recipe.x_cache == "e5m6" and recipe.wgrad.lhs.quantized:
        # E5M6 keeps 6 mantissa bits: Wgrad re-quantizes from it, not from E4M3.
        return round_to_e5m6(x.astype(jnp.float32)).astype(jnp.bfloat16)
    return qx
