"""Expert parallelism: tokens travel to their experts' devices in FP8, results return in BF16.

Runs inside ``jax.shard_map`` over the mesh; ``axis_name`` (the "expert"
axis, S shards) splits the E routed experts into S groups of E / S local
experts.  On every device, with its T tokens routed top-k (A = T * k
assignments):

1. **Plan** (:func:`plan_route`): assignments sorted by expert fill a send
   buffer of S blocks of C rows, block s for shard s's experts, rows ordered
   by local expert.  A per-(shard, local expert) count matrix travels first
   (one small int32 all-to-all), so the receiver knows which of its experts
   each received row belongs to.
2. **Dispatch** (:func:`dispatch`): FP8 recipes quantize the tokens once, in
   1x128 tiles along the features exactly as the expert up-projection's
   Fprop would, *before* the all-to-all; the codes travel as float8 and the
   scales as float32, or, with power-of-two scales (DeepSeek-V3's dispatch,
   ``Recipe.dispatch_pow2``: UE8M0), as their 8-bit exponents (a power of
   two is exactly its exponent), so a row of D features moves D + D/128
   bytes instead of 2D.  The receiver gets a :class:`~fp8jax.QTensor` of its
   rows sorted by local expert, which the expert up-projection
   (:func:`fp8jax.grouped.grouped_dot`) consumes as it is.  In the backward pass the gradient of those rows is quantized the
   same way (E4M3, 1x128 tiles, power-of-two scales) before the reverse
   all-to-all, dequantized on the token's device and summed over the k
   slots in float32.  Recipes without FP8 activations move rows in their
   compute dtype (the BF16 baseline) and differentiate the exchange as is.
3. **Combine** (:func:`combine`): the experts' outputs return in BF16 by the
   reverse all-to-all and are summed over the k slots with the gate weights
   in float32 (their gradient travels in BF16 too).

Capacity: each (source, destination) pair has C rows.  ``capacity_factor=None``
is dropless: C = A, enough for every assignment to go to one shard (the
buffer is then S times the routed rows, but nothing is ever dropped).  A
factor c gives C = ceil(c * A / S); assignments past C in a destination
block are dropped (the highest expert ids of that shard first, the output
of a dropped slot is zero) and counted in ``Route.dropped``.

Gradient contract of the QTensor that :func:`dispatch` returns: the cotangent
of its ``data`` is the cotangent of the values it represents
(``data * scale``, float, straight-through); the cotangent of ``scale`` is
ignored (scales are a function of the tokens, not free inputs).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import schemes
from fp8jax.gemm import with_dot_algorithm
from fp8jax.layout import Layout
from fp8jax.quant import QTensor, dequantize
from fp8jax.recipes import QuantSpec, Recipe
from fp8jax.telemetry import operand_stats


class Route(NamedTuple):
    """One device's dispatch plan (all int32; S shards, C rows per block, A assignments).

    slot_token: (S*C,) token whose row fills each send-buffer slot (0 for empty slots).
    slot_valid: (S*C,) bool, the slot holds an assignment.
    send_pos: (A,) send-buffer slot of each (token, slot) assignment; S*C if dropped.
    recv_order: (S*C,) received rows in local-expert order (empty rows last).
    group_sizes: (E/S,) rows received per local expert.
    dropped: () assignments of this device over capacity (0 when dropless).
    """

    slot_token: jax.Array
    slot_valid: jax.Array
    send_pos: jax.Array
    recv_order: jax.Array
    group_sizes: jax.Array
    dropped: jax.Array


def capacity_rows(n_assign: int, n_shards: int, capacity_factor: float | None) -> int:
    """Rows C of each (source, destination) block: A when dropless, else ceil(c * A / S)."""
    if capacity_factor is None:
        return n_assign
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
    return max(1, min(n_assign, math.ceil(capacity_factor * n_assign / n_shards)))


def plan_route(
    idx_TxK: jax.Array, n_experts: int, axis_name: str, capacity_factor: float | None = None
) -> Route:
    """The dispatch plan of this device's top-k expert ids (inside ``shard_map``)."""
    n_shards = lax.axis_size(axis_name)
    if n_experts % n_shards:
        raise ValueError(f"{n_experts} experts do not split over {n_shards} expert shards")
    e_loc = n_experts // n_shards
    t, k = idx_TxK.shape
    a = t * k
    cap = capacity_rows(a, n_shards, capacity_factor)
    flat = idx_TxK.reshape(-1).astype(jnp.int32)
    # Sorting by global expert id groups assignments by destination shard,
    # then by local expert: the layout the receiver expects.
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    e_sorted = flat[order]
    dest = e_sorted // e_loc
    per_dest = jnp.zeros((n_shards,), jnp.int32).at[dest].add(1)
    rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]
    keep = rank < cap
    n_slots = n_shards * cap
    pos_sorted = jnp.where(keep, dest * cap + rank, n_slots)
    send_pos = jnp.zeros((a,), jnp.int32).at[order].set(pos_sorted)
    slot_assign = jnp.full((n_slots + 1,), a, jnp.int32).at[pos_sorted].set(order)[:n_slots]
    slot_valid = slot_assign < a
    slot_token = jnp.where(slot_valid, slot_assign // k, 0)
    send_counts = (
        jnp.zeros((n_shards, e_loc), jnp.int32)
        .at[dest, e_sorted % e_loc]
        .add(keep.astype(jnp.int32))
    )
    # Row s of the result: what shard s sends to this device, per local expert.
    with jax.named_scope("dispatch_plan"):
        recv_counts = lax.all_to_all(send_counts, axis_name, 0, 0)
    ends = jnp.cumsum(recv_counts, axis=1)
    rows = jnp.arange(cap, dtype=jnp.int32)
    # Local expert of received row j of block s; e_loc marks an empty row.
    local = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends).astype(jnp.int32)
    recv_order = jnp.argsort(local.reshape(-1), stable=True).astype(jnp.int32)
    return Route(
        slot_token=slot_token,
        slot_valid=slot_valid,
        send_pos=send_pos,
        recv_order=recv_order,
        group_sizes=jnp.sum(recv_counts, axis=0),
        dropped=a - jnp.sum(keep.astype(jnp.int32)),
    )


# --------------------------------------------------------------------------
# The wire format of FP8 rows
# --------------------------------------------------------------------------


def pack_pow2(scale: jax.Array) -> jax.Array:
    """Power-of-two float32 scales -> their 8-bit biased exponents (uint8, exact)."""
    # A normal power of two has a zero mantissa: its exponent field is the
    # whole value.  Scales are >= float32's smallest normal, so the field is >= 1.
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    return (bits >> 23).astype(jnp.uint8)


def unpack_pow2(exps: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_pow2`."""
    return lax.bitcast_convert_type(exps.astype(jnp.uint32) << 23, jnp.float32)


def to_wire(codes: jax.Array) -> jax.Array:
    """FP8 codes as uint8 (a bitcast): XLA would widen an FP8 collective to 16 bits on CPU."""
    return lax.bitcast_convert_type(codes, jnp.uint8)


def from_wire(wire: jax.Array, dtype) -> jax.Array:
    """The inverse of :func:`to_wire`."""
    return lax.bitcast_convert_type(wire, dtype)


def _exchange(t: jax.Array, axis_name: str, n_shards: int) -> jax.Array:
    """(S*C, ...) rows, block s to shard s -> (S*C, ...) rows, block s from shard s."""
    blocks = t.reshape(n_shards, -1, *t.shape[1:])
    return lax.all_to_all(blocks, axis_name, 0, 0).reshape(t.shape)


def _send_rows(rows: jax.Array, route: Route) -> jax.Array:
    """Fill the send buffer (S*C, D) from per-token rows (T, D); empty slots are zero."""
    buf = rows[route.slot_token]
    return jnp.where(route.slot_valid[:, None], buf, jnp.zeros((), rows.dtype))


def _quantize_rows(x: jax.Array, spec: QuantSpec) -> QTensor:
    # Exactly as the expert up-projection would quantize its input (the
    # recipe's 1x128 tile spec), so the received rows are its operand as is.
    return schemes.quantize(x, spec, 1)


def _exchange_q(q: QTensor, axis_name: str, n_shards: int, pow2: bool) -> QTensor:
    """All-to-all of FP8 rows: codes as bytes; scales as 8-bit exponents when powers of two."""
    data = from_wire(_exchange(to_wire(q.data), axis_name, n_shards), q.data.dtype)
    if pow2:
        scale = unpack_pow2(_exchange(pack_pow2(q.scale), axis_name, n_shards))
    else:
        scale = _exchange(q.scale, axis_name, n_shards)
    return dataclasses.replace(q, data=data, scale=scale)


def _inverse(perm: jax.Array) -> jax.Array:
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


# --------------------------------------------------------------------------
# Dispatch (FP8 both ways) and combine (BF16)
# --------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dispatch_fp8(x, route, axis_name, n_shards, spec, grad_spec):
    return _dispatch_fp8_fwd(x, route, axis_name, n_shards, spec, grad_spec)[0]


def _dispatch_fp8_fwd(x, route, axis_name, n_shards, spec, grad_spec):
    q = _quantize_rows(x, spec)
    # Rows are quantized per token, so a token's copies share one set of
    # codes; the buffer is filled with FP8 codes, never with x itself.
    send = dataclasses.replace(q, data=_send_rows(q.data, route), scale=_send_rows(q.scale, route))
    with jax.named_scope("dispatch"):
        recv = _exchange_q(send, axis_name, n_shards, spec.pow2)
    order = route.recv_order
    out = dataclasses.replace(recv, data=recv.data[order], scale=recv.scale[order])
    # An empty (T, 0) array carries x's row count and dtype to the backward pass.
    return out, (route, jnp.zeros((x.shape[0], 0), x.dtype))


def _dispatch_fp8_bwd(axis_name, n_shards, spec, grad_spec, res, ct):
    route, x_like = res
    t, d = x_like.shape[0], ct.data.shape[1]
    # Back to the received (block) layout, then FP8 for the reverse exchange.
    g = ct.data.astype(jnp.float32)[_inverse(route.recv_order)]
    with jax.named_scope("dispatch"):
        qg = _exchange_q(_quantize_rows(g, grad_spec), axis_name, n_shards, grad_spec.pow2)
    # Dequantize on the token's device: FP8 -> float32 is exact, the scales
    # are powers of two, so each row's value is exactly its codes x scale.
    g_slots = jnp.concatenate([dequantize(qg, jnp.float32), jnp.zeros((1, d), jnp.float32)])
    # Sum the k copies of each token in float32; dropped copies add zero.
    dx = g_slots[route.send_pos].reshape(t, -1, d).sum(axis=1)
    return dx.astype(x_like.dtype), jax.tree.map(lambda r: None, route)


_dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


def fp8_dispatch_spec(recipe: Recipe) -> tuple[QuantSpec, QuantSpec] | None:
    """(token spec, gradient spec) when the up-projection's input is quantized in 1x128 tiles.

    ``recipe`` is the up-projection's (``fp8jax.recipes.for_site(r, "dispatch")``):
    the tokens are quantized exactly as its Fprop wants them (power-of-two
    scales when ``dispatch_pow2``), so the experts see the operand the
    unsharded GEMM would.  The gradient rows always use power-of-two scales
    (one byte each, dequantized exactly) in the tiles the tokens left in.
    Anything else (the BF16 baseline, per-tensor or row scaling, delayed
    scaling) dispatches in the compute dtype and quantizes on arrival.
    """
    fx, dy = recipe.fprop.lhs, recipe.dgrad.lhs
    ok = (
        fx.quantized
        and dy.quantized
        and schemes.scheme_of(fx.fmt) == schemes.scheme_of(dy.fmt) == "fp8"
        and Layout.of(fx).tiled
        and fx.scaling == "current"
        and dy.scaling == "current"
    )
    if not ok:
        return None
    return fx, QuantSpec(dy.fmt, "tile", fx.tile, "current", True, dy.amax_floor)


def dispatch_stats(x_TxD: jax.Array, recipe: Recipe) -> dict[str, jax.Array] | None:
    """Telemetry (:func:`fp8jax.telemetry.operand_stats`) of the tokens as :func:`dispatch`
    quantizes them, or None when they travel unquantized (the GEMM quantizes on arrival).

    The same quantization as the FP8 dispatch's, so the statistics are
    those of the codes that travel.
    """
    specs = fp8_dispatch_spec(recipe)
    if specs is None:
        return None
    # Statistics carry no gradient: autodiff stays out of this quantization
    # (the kernels of a platform choice's other branches have no JVP rule).
    x = lax.stop_gradient(x_TxD)
    return operand_stats(x, _quantize_rows(x, specs[0]))


def dispatch(x_TxD: jax.Array, route: Route, axis_name: str, recipe: Recipe) -> QTensor | jax.Array:
    """Send every assignment's token row to its expert's shard (inside ``shard_map``).

    Returns the received rows (S*C, D) sorted by local expert (rows past
    ``sum(route.group_sizes)`` are empty): a QTensor of E4M3 codes with
    power-of-two 1x128 scales for FP8 recipes (see :func:`fp8_dispatch_spec`),
    else an array in the recipe's compute dtype.
    """
    n_shards = lax.axis_size(axis_name)
    specs = fp8_dispatch_spec(recipe)
    if specs is not None:
        return _dispatch_fp8(x_TxD, route, axis_name, n_shards, specs[0], specs[1])
    # The baseline moves rows in its compute dtype (one rounding, as the GEMM would).
    rows = _send_rows(x_TxD.astype(recipe.compute), route)
    with jax.named_scope("dispatch"):
        return _exchange(rows, axis_name, n_shards)[route.recv_order]


def combine(
    y_RxD: jax.Array, route: Route, gates_TxK: jax.Array, axis_name: str, wire_dtype=jnp.bfloat16
) -> jax.Array:
    """Return the experts' rows (sorted as :func:`dispatch` gave them) and sum them per token.

    The rows travel in ``wire_dtype`` (BF16, DeepSeek-V3's combine; the
    recipe's compute dtype for recipes computing in float32); the
    gate-weighted sum over the k slots is in float32 and returned as float32 (T, D).
    """
    n_shards = lax.axis_size(axis_name)
    t, k = gates_TxK.shape
    d = y_RxD.shape[-1]
    # One rounding to the wire dtype; the reverse exchange (this one's
    # transpose) carries the gradient in the same dtype.
    rows = y_RxD.astype(wire_dtype)[_inverse(route.recv_order)]
    with jax.named_scope("combine"):
        back = _exchange(rows, axis_name, n_shards)
    back = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])
    y_TxKxD = back[route.send_pos].reshape(t, k, d).astype(jnp.float32)
    gates = gates_TxK.astype(jnp.float32)
    # Each platform's float32 algorithm (TPUs refuse the F32_F32_F32 preset).
    return with_dot_algorithm(
        jnp.float32, lambda alg: jnp.einsum("tkd,tk->td", y_TxKxD, gates, precision=alg)
    )
