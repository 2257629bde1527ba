"""GEMM operands as a recipe wants them: quantized, re-quantized, cached, materialized.

Shared by the dense ``dot_general`` and the grouped expert GEMM, whose three
GEMMs (Fprop, Dgrad, Wgrad) take their operands from here.  An operand is
either a :class:`~fp8jax.quant.QTensor` (codes, scales and layout of any
scheme, :mod:`fp8jax.schemes`) or a plain array in the recipe's compute
dtype (an unquantized spec).

UE8M0 scales (``QuantSpec.scale_fmt="ue8m0"``): an operand handed to a GEMM
has float32 scales (the E8M0 bytes decoded, exact: the GEMM multiplies the
same powers of two as with float32 scales); the cached activation for Wgrad
keeps the bytes (:func:`cache_for_wgrad`) and is decoded where it is read
back (:func:`after_gradient`).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from fp8jax import platforms, quant, scaling, schemes
from fp8jax.formats import (
    IEEE_FP8,
    as_format,
    e5m6_scale_exponent,
    ldexp_exact,
    round_to_e5m6,
)
from fp8jax.inline_ops import traced_inline
from fp8jax.layout import Layout
from fp8jax.quant import (
    QTensor,
    expand_scale,
    float32_scales,
    group_amax,
    is_quantized,
    ue8m0_scales,
)
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
    if spec.scaling == "delayed":
        if dstate is None:
            raise ValueError(
                f"recipe {recipe.name!r} uses delayed scaling: pass "
                "state=fp8jax.scaling.init_delayed_gemm_state(recipe)"
            )
        scaling.check_delayed_state(dstate, spec.fmt, pow2=spec.pow2)
        # Delayed: this step uses the scale computed from the history of
        # previous steps; this step's amax only updates the state.
        q = schemes.quantize(t, spec, caxis, scale=dstate.scale)
        new = scaling.update_delayed_state(dstate, scaling.finite_amax(t), spec, recipe.delayed)
        return float32_scales(q), new
    # The GEMM multiplies float32 scales (UE8M0 bytes decoded, exact).
    return float32_scales(schemes.quantize(t, spec, caxis, seed=recipe.seed)), None


def quantize_operand_twice(
    t: jax.Array,
    specs: tuple[QuantSpec, QuantSpec],
    caxes: tuple[int, int],
    recipe: Recipe,
    dstate=None,
) -> tuple[QTensor | jax.Array, QTensor | jax.Array, scaling.DelayedState | None]:
    """:func:`quantize_operand` of ``t`` for two GEMMs (an output gradient's Dgrad and
    Wgrad): (first operand, second operand, the first's updated delayed state).

    Online FP8 tiles of one length along the last two axes, with the same
    format and scale options, come from :func:`fp8jax.quant.quantize_rows_and_cols`
    (one read of ``t`` on a TPU; the same bits).  One tensor scale on both
    sides is the same operand for both.
    """
    first, second = specs
    nd = t.ndim
    if first == second and Layout.of(first).per_tensor:
        # One tensor scale does not depend on the contraction axis.
        q, new = quantize_operand(t, first, caxes[0], recipe, dstate)
        return q, q, new
    if _tiles_both_ways(first, second, {c % nd for c in caxes}, nd):
        rows, cols = quant.quantize_rows_and_cols(
            t,
            first.fmt,
            first.tile,
            pow2=first.pow2,
            amax_floor=first.amax_floor,
            scale_fmt=first.scale_fmt,
        )
        # The GEMMs multiply float32 scales (UE8M0 bytes decoded, exact).
        by_axis = {nd - 1: float32_scales(rows), nd - 2: float32_scales(cols)}
        return by_axis[caxes[0] % nd], by_axis[caxes[1] % nd], None
    q1, new = quantize_operand(t, first, caxes[0], recipe, dstate)
    q2, _ = quantize_operand(t, second, caxes[1], recipe, dstate)
    return q1, q2, new


def _tiles_both_ways(first: QuantSpec, second: QuantSpec, axes: set[int], nd: int) -> bool:
    """Whether two specs quantize an operand as quant.quantize_rows_and_cols does."""
    return (
        nd >= 2
        and axes == {nd - 1, nd - 2}
        and first == second
        and first.quantized
        and schemes.scheme_of(first.fmt) == "fp8"
        and first.granularity == "tile"
        and first.scaling == "current"
    )


def take_operand(
    t, spec: QuantSpec, caxis: int, recipe: Recipe, dstate=None
) -> tuple[QTensor | jax.Array, scaling.DelayedState | None]:
    """:func:`quantize_operand`, or ``t`` itself when it arrives quantized as ``spec`` says.

    A quantized ``t`` (e.g. a weight gathered in FP8, tokens dispatched in
    FP8) goes into the GEMM with the codes it travelled with, never
    dequantized and quantized again; its scheme, granularity, tile, element
    format and (for runs along one axis) contraction axis must be those
    ``spec`` would give.  Delayed specs need the high-precision tensor for
    their amax history, so they take arrays only.
    """
    if not is_quantized(t):
        return quantize_operand(t, spec, caxis, recipe, dstate)
    if (
        not spec.quantized
        or schemes.scheme_of(spec.fmt) != t.scheme
        or not t.layout.matches(Layout.of(spec, caxis % len(t.shape)))
        or spec.scaling == "delayed"
        or (t.scheme == "fp8" and t.dtype != as_format(spec.fmt))
    ):
        raise ValueError(
            f"recipe {recipe.name!r}: a pre-quantized operand ({t.scheme} {t.dtype}, "
            f"{t.granularity} {t.tile} along axis {t.axis}) is not what its spec gives "
            f"({spec.fmt} {spec.granularity} {spec.tile} along axis {caxis % len(t.shape)}, "
            f"{spec.scaling} scaling)"
        )
    if spec.scale_fmt == "ue8m0":
        # A UE8M0 consumer: scales that are not powers of two are refused
        # (ValueError, or NaN under jit), never rounded to one.
        t = ue8m0_scales(t)
    return float32_scales(t), None


def value_cotangent(q: QTensor, g: jax.Array) -> QTensor:
    """The cotangent of a quantized input: ``g`` (the gradient of the values it
    represents, straight through the rounding) in its codes' place, zero for its scales."""
    return dataclasses.replace(jax.tree.map(jnp.zeros_like, q), data=g)


def requantize(
    cached, spec: QuantSpec, caxis: int, recipe: Recipe, prev_spec: QuantSpec, dstate=None
) -> QTensor | jax.Array:
    """The operand as ``spec`` wants it, from its cached copy (quantized or array).

    Reuses the cached quantized tensor when its scale layout is already right
    (same spec and a layout that does not depend on the contraction axis: per
    tensor, or 128x128 blocks, which serve W and W^T alike); otherwise
    dequantizes the cached values and quantizes them again along ``caxis``
    (DeepSeek-V3 turns its cached 1x128 activation tiles into 128x1 tiles this
    way).  A delayed spec re-uses this step's delayed scale of the tensor.
    """
    if _reusable(cached, spec, prev_spec):
        return float32_scales(cached)
    if _retiles(cached, spec, caxis):
        return _requantize_transposed(cached, spec, caxis % len(cached.shape), recipe)
    hp = materialize(cached, jnp.float32)
    if spec.quantized and spec.scaling == "delayed":
        # The same tensor was already quantized with this delayed scale this step.
        return float32_scales(schemes.quantize(hp, spec, caxis, scale=dstate.scale))
    out, _ = quantize_operand(hp, spec, caxis, recipe)
    return out


def _reusable(cached, spec: QuantSpec, prev_spec: QuantSpec) -> bool:
    """Whether the cached quantized tensor already is the operand ``spec`` wants."""
    return is_quantized(cached) and spec == prev_spec and not Layout.of(spec).along_axis


def _retiles(cached, spec: QuantSpec, caxis: int) -> bool:
    """Whether :func:`requantize` takes FP8 codes tiled along the last axis to tiles
    along ``caxis`` (online scales), the way that may run as one kernel."""
    last = len(cached.shape) - 1
    return (
        is_quantized(cached)
        and cached.scheme == "fp8"
        and spec.quantized
        and spec.scaling != "delayed"
        and Layout.of(spec, caxis).tiled
        and caxis % len(cached.shape) != last
        and cached.layout.tiled
        and cached.layout.axis == last
    )


@dataclasses.dataclass(frozen=True)
class Requantizable:
    """Where a GEMM kernel may requantize its operand itself: ``cached`` (FP8 codes in
    1x128 tiles along the last axis, float32 scales) and the ``spec`` that quantizes it
    again in 128-long tiles along the second-to-last axis.  The operand is
    :func:`requantize_tpu_kernel` (``cached``, ``spec``), the same bits."""

    cached: QTensor
    spec: QuantSpec


def requantizable(
    cached, spec: QuantSpec, caxis: int, prev_spec: QuantSpec
) -> Requantizable | None:
    """``cached`` and ``spec`` where :func:`requantize` (same arguments) runs the
    requantizing kernel on a TPU, else None."""
    if _reusable(cached, spec, prev_spec):
        return None
    cached = float32_scales(cached)
    if _retiles(cached, spec, caxis) and requantize_kernel_fits(
        cached, spec, caxis % len(cached.shape)
    ):
        return Requantizable(cached, spec)
    return None


def _requantize_transposed(cached: QTensor, spec: QuantSpec, caxis: int, recipe: Recipe):
    """Tiles along ``caxis`` from a cache tiled along the last axis, the same codes.

    On a CUDA GPU the FP8 codes (one byte each) are transposed first, so that
    the dequantize-and-quantize pass reduces along contiguous elements and
    writes its codes contiguous along ``caxis``, which the Wgrad kernel reads
    (K-major); elsewhere the values are quantized in place.  Transposes are
    exact: the codes and scales are the same either way.
    """

    def in_place(cached):
        out, _ = quantize_operand(materialize(cached, jnp.float32), spec, caxis, recipe)
        return out

    ways = {
        "transposed": partial(requantize_through_transpose, spec=spec, caxis=caxis, recipe=recipe),
        "in place": in_place,
        "tpu kernel": partial(requantize_tpu_kernel, spec=spec),
        "gpu kernel": partial(requantize_gpu_kernel, spec=spec),
    }
    kernel = requantize_kernel_fits(cached, spec, caxis)

    def decide(p: str) -> str:
        if p == "cuda":
            return "gpu kernel" if kernel and quant.gpu_kernels() is not None else "transposed"
        return "tpu kernel" if p == "tpu" and kernel else "in place"

    return platforms.choose(decide, ways.__getitem__, (cached,))


def requantize_kernel_fits(cached: QTensor, spec: QuantSpec, caxis: int) -> bool:
    """Whether the requantizing kernels (:func:`fp8jax.kernels.tpu_quantize.requantize_col`,
    :func:`fp8jax.kernels.gpu_quantize.requantize_col_t`) give ``in place``'s operand:
    FP8 codes in 1x128 tiles along the last axis, quantized again (online, plain) in
    128-long tiles along the second-to-last (leading axes stack matrices)."""
    nd = len(cached.shape)
    return (
        cached.scheme == "fp8"
        and nd >= 2
        and caxis % nd == nd - 2
        and cached.layout.tiled
        and cached.axis == nd - 1
        and cached.tile == 128
        and cached.dtype in IEEE_FP8
        and kernel_tiles(spec)
    )


def kernel_tiles(spec: QuantSpec, granularity: str = "tile") -> bool:
    """Whether ``spec`` quantizes as the quantizing kernels do: online (plain) scales of
    128-long tiles (or, ``granularity`` "block", 128x128 blocks), E4M3 or E5M2
    (:func:`kernel_settings` names the rest)."""
    return (
        spec.quantized
        and schemes.scheme_of(spec.fmt) == "fp8"
        and as_format(spec.fmt) in IEEE_FP8
        and spec.granularity == granularity
        and spec.tile == 128
        and spec.scaling == "current"
        and not (spec.hadamard or spec.stochastic)
    )


def kernel_settings(spec: QuantSpec) -> dict:
    """The keywords of the quantizing kernels (``fmt``, ``pow2``, ``amax_floor``,
    ``ue8m0``) for an online FP8 ``spec``."""
    return dict(
        fmt=as_format(spec.fmt),
        pow2=spec.pow2,
        amax_floor=spec.amax_floor,
        # The operand carries float32 scales either way (quantize_operand).
        ue8m0=spec.scale_fmt == "ue8m0",
    )


def requantize_tpu_kernel(
    cached: QTensor, spec: QuantSpec, cache_scales: jax.Array | None = None
) -> QTensor:
    """``in place`` in one Mosaic TPU kernel: the codes read once, no float32 copy in HBM.

    ``cache_scales``: the float32 scales of the whole cache ``cached`` was
    taken from (by default its own).  Dequantization reads every element on
    the bit patterns when any of them is subnormal, so every matrix of a
    stack gets that one flag.
    """
    from fp8jax.kernels import tpu_quantize

    cached = float32_scales(cached)
    subnormal = tpu_quantize.subnormal_scales(
        cached.scale if cache_scales is None else cache_scales
    )
    run = partial(tpu_quantize.requantize_col, **kernel_settings(spec))
    # The flag as an argument, one per matrix of the stack (the same for
    # all), not bound into run: the kernel then waits for a TPU lowering.
    flag = jnp.broadcast_to(subnormal, cached.data.shape[:-2])
    data, scale = tpu_quantize.on_tpu(run, cached.data, cached.scale, flag)
    return QTensor(data, scale, Layout(spec.granularity, len(cached.shape) - 2, spec.tile))


def requantize_gpu_kernel(cached: QTensor, spec: QuantSpec, interpret: bool = False) -> QTensor:
    """``transposed`` in one kernel (Mosaic GPU, or Triton where asked for:
    ``quant.gpu_kernels()``): the codes read once, the new codes written K-major
    (as the Wgrad kernel reads them), no float32 copy in HBM.  ``interpret``:
    the kernel in its interpreter on any platform, a 2-D ``cached`` (the tests)."""
    from fp8jax.kernels import gpu_quantize

    cached = float32_scales(cached)
    run = partial(quant.gpu_kernels().requantize_col_t, **kernel_settings(spec))
    if interpret:
        data_t, scale_t = run(cached.data, cached.scale, interpret=True)
    else:
        data_t, scale_t = gpu_quantize.on_gpu(run, cached.data, cached.scale)
    last = len(cached.shape) - 1
    out = QTensor(data_t, scale_t, Layout(spec.granularity, last, spec.tile))
    return out.swapaxes(last - 1, last)


def requantize_through_transpose(cached: QTensor, spec: QuantSpec, caxis: int, recipe: Recipe):
    """``cached`` (tiles along its last axis) quantized again along ``caxis``, with its
    codes and scales transposed before and after (see :func:`_requantize_transposed`)."""
    last = len(cached.shape) - 1
    swapped = cached.swapaxes(caxis, last)
    out, _ = quantize_operand(materialize(swapped, jnp.float32), spec, last, recipe)
    return out.swapaxes(caxis, last)


def materialize(op, dtype) -> jax.Array:
    """A quantized operand dequantized to ``dtype`` (its scheme's dequantizer), or an array cast.

    Differentiable straight through the rounding: a quantized operand's
    cotangent is the gradient of the values it represents in float32
    (:func:`value_cotangent`), as the GEMMs give one; an array's is autodiff's.
    """
    if is_quantized(op):
        return _dequantized(op, jnp.dtype(dtype))
    return op.astype(dtype)


def source_values(op, dtype) -> jax.Array:
    """The values ``op`` stands for, as what must see them (telemetry, a rescaled weight)
    wants them: a quantized operand's ``source`` (the values its codes were made
    from) where it keeps one, else :func:`materialize`'s.

    Differentiable as :func:`materialize`: a quantized operand's cotangent is
    the gradient of the values in its codes' place (:func:`value_cotangent`),
    the form the GEMMs give, so the two sum where both use one operand.
    """
    if is_quantized(op) and op.source is not None:
        return _source(op, jnp.dtype(dtype))
    return materialize(op, dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _source(q: QTensor, dtype) -> jax.Array:
    return q.source.astype(dtype)


def _source_fwd(q, dtype):
    return q.source.astype(dtype), q


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _dequantized(q: QTensor, dtype) -> jax.Array:
    return schemes.dequantize(q, dtype)


def _dequantized_fwd(q, dtype):
    return schemes.dequantize(q, dtype), q


def _dequantized_bwd(dtype, q, g):
    # Straight through: d(values)/d(values) = 1; the codes' rounding has no
    # useful derivative and the scales get none.
    return (value_cotangent(q, g.astype(jnp.float32)),)


_dequantized.defvjp(_dequantized_fwd, _dequantized_bwd)
# The kept values' gradient takes the dequantized values' form.
_source.defvjp(_source_fwd, _dequantized_bwd)


def after_gradient(cached, qdy):
    """The cached quantized ``cached``, usable only once ``qdy`` exists; same values.

    Wgrad re-quantizes the cached activation, work that depends on forward
    values only, so XLA may schedule it for every layer during the forward
    pass and keep each result (widened to float32 for its dot on a CPU)
    alive until that layer's backward step, which undoes what the FP8 cache
    saves.  OR-ing min(b, 0) of the bit pattern b of the gradient's first
    scale (0: scales are positive) into the cached scales' bit patterns makes
    the work wait for this layer's gradient without changing a bit.  Anything
    else (an array, or scales that are not float32) passes through.  A cache
    with UE8M0 scales is read back as float32 scales (exact) first.
    """
    cached = float32_scales(cached)
    f32 = jnp.dtype(jnp.float32)
    if not (
        is_quantized(cached)
        and is_quantized(qdy)
        and cached.scale.dtype == f32
        and qdy.scale.dtype == f32
    ):
        return cached
    # On the bit patterns (an integer OR of 0), so a subnormal scale is not
    # flushed as a float addition on a flush-to-zero backend would.
    dep = jax.lax.bitcast_convert_type(qdy.scale.reshape(-1)[0], jnp.int32)
    bits = jax.lax.bitcast_convert_type(cached.scale, jnp.int32)
    scale = jax.lax.bitcast_convert_type(bits | jnp.minimum(dep, 0), jnp.float32)
    return dataclasses.replace(cached, scale=scale)


# Largest value with 7 significant bits below bfloat16's overflow threshold:
# a decoded E5M6 value saturates here instead of rounding to Inf in bfloat16.
_BF16_E5M6_LIMIT = (2.0 - 2.0**-6) * 2.0**127


@traced_inline
def e5m6_tiles(x: jax.Array, axis: int = -1, tile: int = 128) -> jax.Array:
    """x in E5M6 with one power-of-two scale per 1 x ``tile`` run along ``axis``, decoded.

    DeepSeek-V3's cache of the input of the linear after attention (section
    3.3.3).  Per tile: amax over its finite elements, the scale 2^k with k
    the smallest integer such that amax / 2^k <= 65024
    (:func:`fp8jax.formats.e5m6_scale_exponent`; 2^0 for an all-zero tile),
    each element x * 2^-k (exact) rounded to E5M6 (nearest, ties to even;
    no finite element saturates), and the value code * 2^k returned in
    bfloat16, which holds it exactly (7 significant bits) for magnitudes
    from 2^-126 up; smaller ones take bfloat16's subnormal rounding, and
    finite values whose rounding passes (2 - 2^-6) * 2^127 saturate there.
    NaN and +-Inf propagate.  Shapes need not be multiples of ``tile``: an
    edge tile takes the scale of its own elements.
    """
    xf = x.astype(jnp.float32)
    axis = axis % xf.ndim
    amax = group_amax(xf, "tile", axis, tile)
    # Power-of-two scale rule: the smallest 2^k with amax / 2^k <= 65024, so
    # the tile's largest element lands in E5M6's top binade and none clips.
    k = expand_scale(e5m6_scale_exponent(amax), xf.shape, "tile", axis, tile)
    # Dividing by 2^k is exact (bit patterns, no flush-to-zero); rounding to
    # E5M6 is the only rounding; multiplying back by 2^k is exact again.
    values = ldexp_exact(round_to_e5m6(ldexp_exact(xf, -k)), k)
    limit = jnp.float32(_BF16_E5M6_LIMIT)
    values = jnp.where(jnp.isfinite(xf), jnp.clip(values, -limit, limit), values)
    # bfloat16 storage: 16 bits per element, every E5M6 value x 2^k exact in it.
    return values.astype(jnp.bfloat16)


def cache_for_wgrad(x: jax.Array, qx, recipe: Recipe):
    """What the forward pass keeps of x for Wgrad (the residual).

    By default (``recipe.x_cache`` None) the FP8 operand itself (codes +
    scales, no high-precision copy); a UE8M0 spec caches its scales as E8M0
    bytes (one per tile instead of four).  ``"e5m6"`` (DeepSeek-V3's cache
    for the input of the linear after attention): x in E5M6 with power-of-two
    scales per 1x128 tile along the contraction axis K (:func:`e5m6_tiles`),
    which Wgrad re-quantizes in 128x1 E4M3 tiles along the tokens.
    ``"e5m6_unscaled"`` (a named variant only): x rounded to E5M6 without
    scales, finite values saturating at +-65024.  Both stored in bfloat16.
    """
    if not schemes.requantizes_codes(recipe.wgrad.lhs.fmt):
        # Block formats quantize Wgrad's x along the tokens (after the RHT) from
        # x itself, as Transformer Engine's columnwise copy is made from the
        # high-precision tensor: re-quantizing 4-bit codes would round twice.
        return x
    if recipe.x_cache == "e5m6" and recipe.wgrad.lhs.quantized:
        # E5M6 keeps 6 mantissa bits: Wgrad re-quantizes from it, not from
        # E4M3.  The contraction axis of x is its last (dense (B, M, K),
        # grouped (M, K)): the cache's 1x128 tiles run along K as Fprop's do.
        return e5m6_tiles(x, axis=-1, tile=recipe.fprop.lhs.tile)
    if recipe.x_cache == "e5m6_unscaled" and recipe.wgrad.lhs.quantized:
        # The unscaled variant: E5M6's own range only, large values clip at 65024.
        return round_to_e5m6(x.astype(jnp.float32)).astype(jnp.bfloat16)
    if recipe.fprop.lhs.scale_fmt == "ue8m0":
        # Power-of-two scales as their exponent bytes: exact, a quarter of the bytes.
        return ue8m0_scales(qx)
    return qx
