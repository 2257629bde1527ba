"""FSDP weight gathers in FP8: quantize the shard in 128x128 blocks, gather codes and scales.

A weight sharded over the "fsdp" axis is needed whole by the GEMM that uses
it.  For FP8 recipes the GEMM would quantize it in ``tile`` x ``tile`` blocks
anyway, so each device quantizes its own shard and the all-gather moves E4M3
codes (1 byte per element) plus one float32 scale per block (4 bytes per
128 x 128 elements) instead of 2 (BF16) or 4 (FP32) bytes per element.

Equality with quantize-then-gather: the blocks are over the last two axes of
the array as given (the GEMM's (K, N) weight layout).  Gathering along a
leading axis, or along one of the last two with shards whose length is a
multiple of the tile, never cuts a block, so every block's amax, scale and
codes are those of quantizing the whole array (bit for bit).  A shard that
would cut a block is refused with a clear error.

The gathered :class:`~fp8jax.QTensor` goes into the GEMM as it travelled:
:func:`fp8jax.dot_general` and the grouped GEMM take a quantized weight and
use its codes and scales (no dequantize and quantize again), so the GEMM on
a mesh multiplies the codes it would have made on one device.  A Dense
kernel arrives in its GEMM's 2-d (K, N) layout (``Dense`` merges the
input's contracted axes to match); routed experts in their (E, K, N) layout.

The gradient goes back by a reduce-scatter (``psum_scatter``) of the
per-device partial gradients in ``reduce_dtype`` (float32 by default;
bfloat16 halves the bytes at the cost of a BF16 sum).

The collectives run inside ``jax.shard_map`` over the axis they gather;
:func:`gather_params` opens that region itself for a whole parameter tree.
Which weights move in FP8 there: the routed experts and the Dense kernels
whose shards hold whole 128-row bands of their GEMM's (K, N) matrix (the
sharding rules split a Dense kernel on its first axis for this).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fp8jax import schemes
from fp8jax.layout import Layout
from fp8jax.nn.dense import Dense
from fp8jax.parallel.dispatch import from_wire, to_wire
from fp8jax.parallel.placement import is_routed_expert_keys, param_spec
from fp8jax.quant import QTensor
from fp8jax.recipes import QuantSpec, Recipe


def _check_aligned(shape: tuple[int, ...], axis: int, tile: int) -> None:
    nd = len(shape)
    if axis >= nd - 2 and shape[axis] % tile:
        raise ValueError(
            f"an FP8 gather along axis {axis} needs shards whose length is a multiple of "
            f"the {tile}-element block, got a shard of shape {shape}"
        )


def all_gather_fp8(w_shard: jax.Array, spec: QuantSpec, axis_name: str, axis: int) -> QTensor:
    """Quantize this device's shard in blocks, then all-gather codes and scales along ``axis``.

    Equals ``fp8jax.schemes.quantize(all_gather(w), spec, -1)`` bit for bit
    (see the module docstring).
    """
    if w_shard.ndim < 2:
        raise ValueError(f"block quantization needs at least 2 axes, got shape {w_shard.shape}")
    axis = axis % w_shard.ndim
    _check_aligned(w_shard.shape, axis, spec.tile)
    # The blocks lie over the last two axes whatever the contraction axis.
    q = schemes.quantize(w_shard, spec, w_shard.ndim - 1)
    # The codes travel as bytes (see fp8jax.parallel.dispatch.to_wire).
    data = from_wire(lax.all_gather(to_wire(q.data), axis_name, axis=axis, tiled=True), q.dtype)
    # The scale array has one entry per block: its axis lines up with the
    # data's axis, shard by shard.
    scale = lax.all_gather(q.scale, axis_name, axis=axis, tiled=True)
    return dataclasses.replace(q, data=data, scale=scale)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather_fp8(w_shard, spec, axis_name, view, view_axis, reduce_dtype):
    return _gather_fp8_fwd(w_shard, spec, axis_name, view, view_axis, reduce_dtype)[0]


def _gather_fp8_fwd(w_shard, spec, axis_name, view, view_axis, reduce_dtype):
    # The GEMM takes these codes and scales as they travelled: no dequantize
    # and quantize again, so its product is the one-device product bit for bit.
    q = all_gather_fp8(w_shard.reshape(view), spec, axis_name, view_axis)
    # An empty array carries the shard's shape and dtype to the backward pass.
    return q, jnp.zeros((0, *w_shard.shape), w_shard.dtype)


def _gather_fp8_bwd(spec, axis_name, view, view_axis, reduce_dtype, res, ct):
    # The GEMM gives a quantized input the gradient of the values it
    # represents in its codes' place (fp8jax.operands.value_cotangent).
    g = _reduce_scatter(ct.data, axis_name, view_axis, reduce_dtype)
    return (g.reshape(res.shape[1:]).astype(res.dtype),)


_gather_fp8.defvjp(_gather_fp8_fwd, _gather_fp8_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_plain(w_shard, dtype, axis_name, axis, reduce_dtype):
    return lax.all_gather(w_shard.astype(dtype), axis_name, axis=axis, tiled=True)


def _gather_plain_fwd(w_shard, dtype, axis_name, axis, reduce_dtype):
    out = _gather_plain(w_shard, dtype, axis_name, axis, reduce_dtype)
    return out, jnp.zeros((0,), w_shard.dtype)


def _gather_plain_bwd(dtype, axis_name, axis, reduce_dtype, res, ct):
    return (_reduce_scatter(ct, axis_name, axis, reduce_dtype).astype(res.dtype),)


_gather_plain.defvjp(_gather_plain_fwd, _gather_plain_bwd)


def _reduce_scatter(ct: jax.Array, axis_name: str, axis: int, reduce_dtype) -> jax.Array:
    # The partial gradients are summed in reduce_dtype (float32 unless told:
    # a BF16 sum over many devices loses the small contributions).
    return lax.psum_scatter(ct.astype(reduce_dtype), axis_name, scatter_dimension=axis, tiled=True)


def gather_weight(
    w_shard: jax.Array,
    axis_name: str,
    axis: int,
    *,
    spec: QuantSpec | None = None,
    view: tuple[int, ...] | None = None,
    view_axis: int | None = None,
    dtype=None,
    reduce_dtype=jnp.float32,
) -> QTensor | jax.Array:
    """The whole weight from this device's shard along ``axis``; differentiable.

    With ``spec`` (quantized, current scaling, "block"): an FP8 gather of
    the shard seen as ``view`` (its GEMM's (..., K, N) layout, blocks over the
    last two axes; default: the shard as it is) along ``view_axis``; the
    result is the gathered :class:`~fp8jax.QTensor` in that layout, which
    :func:`fp8jax.dot_general` and the grouped GEMM take as it is (its codes
    are those of quantizing the whole weight).  Otherwise the shard is cast
    to ``dtype`` (default: its own) and gathered.  Backward: a reduce-scatter
    of the per-device partial gradients in ``reduce_dtype`` (for the FP8
    gather, the gradient of the values the codes represent).
    """
    axis = axis % w_shard.ndim
    rd = jnp.dtype(reduce_dtype)
    if spec is not None and is_block_fp8(spec):
        view = tuple(view) if view is not None else tuple(w_shard.shape)
        view_axis = axis if view_axis is None else view_axis % len(view)
        return _gather_fp8(w_shard, spec, axis_name, view, view_axis, rd)
    dt = jnp.dtype(dtype) if dtype is not None else w_shard.dtype
    return _gather_plain(w_shard, dt, axis_name, axis, rd)


def is_block_fp8(spec: QuantSpec) -> bool:
    """The weight spec quantizes FP8 online in blocks (what an FP8 gather reproduces).

    Not the block formats: NVFP4's tensor scale spans the whole weight, which
    no shard sees.
    """
    return (
        spec.quantized
        and schemes.scheme_of(spec.fmt) == "fp8"
        and spec.scaling == "current"
        and Layout.of(spec).blocked
    )


# --------------------------------------------------------------------------
# The model's parameters: one gather per step at the top of the loss
# --------------------------------------------------------------------------


class KernelLayout(NamedTuple):
    """A GEMM weight's layout: how many leading axes it contracts, and its weight spec.

    A Dense kernel contracts its first ``n_in`` axes; routed experts
    (E, K, N) have ``n_in`` 1 (their K axis) and ``routed`` True.
    """

    n_in: int
    spec: QuantSpec
    routed: bool = False

    def gemm_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The weight's shape as its GEMM reads it: (K, N) for a Dense kernel (its
        contracted axes merged, then its output axes), routed experts as they are."""
        if self.routed:
            return tuple(shape)
        return (math.prod(shape[: self.n_in]), math.prod(shape[self.n_in :]))


def kernel_layouts(model: nnx.Module) -> dict[tuple[str, ...], KernelLayout]:
    """``{path of a GEMM weight: its KernelLayout}``: every Dense kernel and routed expert weight.

    The spec is the weight spec of the recipe of the layer that owns the
    weight (a block the recipe keeps in high precision has its own,
    :func:`fp8jax.recipes.for_layer`); routed experts are named by their
    layer's ``gemm_weights()`` ({parameter name: its GEMM's recipe}).
    """
    out = {}
    for path, module in nnx.iter_modules(model):
        prefix = tuple(str(p) for p in path)
        if isinstance(module, Dense):
            out[prefix + ("kernel",)] = KernelLayout(
                len(module.in_features), module.recipe.fprop.rhs
            )
        elif callable(getattr(module, "gemm_weights", None)):
            for name, recipe in module.gemm_weights().items():
                out[prefix + (name,)] = KernelLayout(1, recipe.fprop.rhs, routed=True)
    return out


def param_keys(path) -> tuple[str, ...]:
    """The keys of a parameter tree's path, as :func:`kernel_layouts` names its weights."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def _gemm_view(shape, axis, routed, layout, tile):
    """(view, view_axis) of a shard whose FP8 blocks match its GEMM's, or None.

    Routed experts (E, K, N) are their own view; a Dense kernel split on its
    first axis is a band of rows of its (K, N) matrix.  The gathered axis
    must hold whole blocks.
    """
    if routed:
        return (shape, axis) if axis in (1, 2) and shape[axis] % tile == 0 else None
    if layout is None or axis != 0:
        return None
    view = layout.gemm_shape(shape)
    return (view, 0) if view[0] % tile == 0 else None


def _local_shape(shape: tuple[int, ...], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """The shape of one device's shard of a global array laid out by ``spec``."""
    out = list(shape)
    for i, names in enumerate(tuple(spec)):
        for name in (names,) if isinstance(names, str) else names or ():
            out[i] //= mesh.shape[name]
    return tuple(out)


def gather_params(
    params: Any,
    mesh: Mesh,
    recipe: Recipe,
    n_experts: int | None,
    layouts: dict[tuple[str, ...], KernelLayout],
    *,
    reduce_dtype=jnp.float32,
) -> Any:
    """Gather every FSDP-split parameter (one ``shard_map`` over the tree), differentiably.

    GEMM weights (Dense kernels, routed experts) move as FP8 blocks when
    their GEMM quantizes weights in blocks (the recipe of the layer that
    owns them, as ``layouts`` names it; ``recipe`` only for routed experts
    that ``layouts`` does not name) and the shard holds whole blocks of
    the GEMM's (K, N) matrix: the result is then a :class:`~fp8jax.QTensor`
    in that (K, N) layout (``(E, K, N)`` for experts), which the GEMM takes
    with the codes it travelled with.  Otherwise they move in the recipe's
    compute dtype when it does not quantize weights (what the GEMM would
    cast them to), and in their own dtype else.  Other parameters
    (embedding, head, norms, router) move in their own dtype.  Routed
    experts stay split over "expert".  Gradients return by reduce-scatter in
    ``reduce_dtype``.
    """
    n_fsdp = mesh.shape["fsdp"]
    if n_fsdp == 1:
        return params
    in_specs = jax.tree_util.tree_map_with_path(
        lambda p, x: param_spec(p, tuple(x.shape), mesh, n_experts), params
    )

    def plan(path, x, spec):
        """How a split parameter moves: ("fp8", spec, view, view_axis) or ("cast",
        dtype) or ("own",) for a GEMM weight, ("other",) for any other
        parameter, None when it is not split over "fsdp"."""
        if "fsdp" not in tuple(spec):
            return None
        keys = param_keys(path)
        routed = is_routed_expert_keys(list(keys), x.shape, n_experts)
        layout = layouts.get(keys)
        if not routed and layout is None:
            return ("other",)
        # Each weight follows its own layer's recipe (a block kept in high
        # precision gathers its experts unquantized).
        wspec = layout.spec if layout is not None else recipe.fprop.rhs
        axis = tuple(spec).index("fsdp")
        if is_block_fp8(wspec):
            local = _local_shape(tuple(x.shape), spec, mesh)
            vw = _gemm_view(local, axis, routed, layout, wspec.tile)
            if vw is not None:
                return ("fp8", wspec, *vw)
        # The GEMM casts an unquantized weight to the compute dtype first:
        # moving it in that dtype changes nothing.
        return ("cast", recipe.compute) if not wspec.quantized else ("own",)

    plans = jax.tree_util.tree_map_with_path(plan, params, in_specs)

    def out_spec(spec, how):
        # A Dense kernel gathered in FP8 comes out in its GEMM's 2-d (K, N)
        # layout, whole on every device.
        if how is not None and how[0] == "fp8" and len(how[2]) != len(tuple(spec)):
            return P()
        return P(*(None if a == "fsdp" else a for a in spec))

    out_specs = jax.tree.map(out_spec, in_specs, plans, is_leaf=lambda s: isinstance(s, P))

    def one(shard, spec, how):
        if how is None:
            return shard
        axis = tuple(spec).index("fsdp")
        if how[0] == "fp8":
            _, wspec, view, view_axis = how
            with jax.named_scope("gemm_weights"):
                return gather_weight(
                    shard,
                    "fsdp",
                    axis,
                    spec=wspec,
                    view=view,
                    view_axis=view_axis,
                    reduce_dtype=reduce_dtype,
                )
        dtype = how[1] if how[0] == "cast" else shard.dtype
        with jax.named_scope("other_params" if how[0] == "other" else "gemm_weights"):
            out = gather_weight(shard, "fsdp", axis, dtype=dtype, reduce_dtype=reduce_dtype)
        return out.astype(shard.dtype)

    def body(tree):
        with jax.named_scope("fsdp_gather"):
            return jax.tree.map(one, tree, in_specs, plans, is_leaf=lambda s: isinstance(s, P))

    return jax.shard_map(
        body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False
    )(params)


def fsdp_loss(
    loss_fn: Callable, mesh: Mesh, recipe: Recipe, n_experts: int | None, layouts
) -> Callable:
    """``loss_fn(model, tokens)`` that first gathers the model's FSDP-split parameters."""
    if mesh.shape["fsdp"] == 1:
        return loss_fn

    def wrapped(model, tokens):
        # A new module over the gathered parameters (no mutation of ``model``,
        # which may belong to an outer trace).
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        gathered = gather_params(params, mesh, recipe, n_experts, layouts)
        return loss_fn(nnx.merge(graph, gathered, rest), tokens)

    return wrapped
