"""The routed experts' two (dispatch, collect) pairs: on one device and expert-parallel.

A MoE layer runs route -> dispatch -> experts -> SwiGLU -> experts ->
collect.  The middle (the two expert GEMMs and SwiGLU) is one function of
the layer, ``experts(rows, w13, w2, noise13, noise2) -> (y, stats)``,
which gets the rows sorted by expert (:class:`ExpertRows`) and returns
their outputs in the same order with its telemetry (see
:func:`fp8jax.models.moe.MoE`).  The two pairs around it have one
signature, ``(experts, x (T, D), idx (T, K), gates (T, K), w13, w2, noise)
-> (float32 (T, D), stats)``:

* :func:`run_local`: one device (the partitioner places the GEMMs on a
  mesh without an "expert" axis): dispatch sorts the (token, slot) rows by
  expert (a gather), collect un-sorts them and sums the k slots with their
  gates in float32.
* :func:`run_expert_parallel`: one ``shard_map`` region.  Tokens arrive
  split over every device (the batch over ("data", "fsdp", "expert")); the
  routed experts' weights over "expert".  On each device: plan the route,
  dispatch (FP8 for FP8 recipes, see :mod:`fp8jax.parallel.dispatch`),
  ``experts`` on the received rows, and the combine back to the tokens'
  devices in the recipe's compute dtype (BF16, as DeepSeek-V3 combines).
  The body returns each device's telemetry; it is merged outside
  (:func:`merge_shard_stats`), so the layer records the same keys with the
  same meaning as on one device.

Used by the MoE layer when the mesh set with ``jax.set_mesh`` has an
"expert" axis of size > 1 (:func:`expert_parallel_size`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fp8jax.gemm import with_dot_algorithm
from fp8jax.nn.grad_noise import per_shard
from fp8jax.parallel.dispatch import combine, dispatch, dispatch_stats, plan_route
from fp8jax.parallel.mesh import AXES, BATCH_SPEC
from fp8jax.quant import QTensor
from fp8jax.recipes import Recipe, needs_state
from fp8jax.telemetry import merge_operand_stats


def expert_parallel_size(recipe: Recipe | None = None) -> int:
    """Size of the "expert" axis of the current mesh (``jax.set_mesh``); 1 without one.

    Delayed-scaling recipes keep one amax history for all experts, which
    per-shard GEMMs cannot update consistently: they report 1 (the
    partitioner then places the experts' GEMMs itself).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "expert" not in mesh.axis_names:
        return 1
    if recipe is not None and needs_state(recipe):
        return 1
    return int(mesh.shape["expert"])


class ExpertRows(NamedTuple):
    """What a dispatch hands the experts.

    rows: (R, D) rows sorted by expert (an array, or the QTensor of an FP8
      dispatch); rows past ``sum(group_sizes)`` are empty (zeros).
    group_sizes: int32 (E_here,) rows of each expert held here.
    first: bool (R,) rows of each sequence's first token, or None where the
      rows do not carry their token's position (expert parallelism).
    """

    rows: jax.Array | QTensor
    group_sizes: jax.Array
    first: jax.Array | None


Experts = Callable[..., tuple[jax.Array, dict[str, Any]]]


def sort_by_expert(idx_TxK: jax.Array, n_experts: int):
    """Dispatch plan: (row order, token of each sorted row, group sizes int32 (E,)).

    Row r of the sorted layout is the (token, slot) pair ``order[r]`` of the
    flattened (T*K,) assignments; the sort is stable so tokens keep their order
    within each expert.
    """
    k = idx_TxK.shape[1]
    flat = idx_TxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = (order // k).astype(jnp.int32)
    group_sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    return order, token, group_sizes


def row_experts(group_sizes: jax.Array, n_rows: int) -> jax.Array:
    """int32 (n_rows,): the expert of each row sorted by expert.

    Rows past ``sum(group_sizes)`` (the empty rows of a receive buffer) get
    ``len(group_sizes)``, an id no expert has, so per-expert reductions
    (``jax.ops.segment_*``) leave them out.
    """
    e = group_sizes.shape[0]
    sizes = jnp.concatenate([group_sizes, (n_rows - jnp.sum(group_sizes))[None]]).astype(jnp.int32)
    return jnp.repeat(jnp.arange(e + 1, dtype=jnp.int32), sizes, total_repeat_length=n_rows)


def run_local(
    experts: Experts,
    x_TxD: jax.Array,
    idx_TxK: jax.Array,
    gates_TxK: jax.Array,
    w13: Any,
    w2: Any,
    noise: tuple[jax.Array | None, jax.Array | None],
    *,
    n_experts: int,
    seq: int,
) -> tuple[jax.Array, dict[str, Any]]:
    """The pair on one device: sort rows by expert, ``experts``, un-sort and gate-sum (float32).

    ``seq``: tokens per sequence (``x`` is (B * seq, D)), which marks the
    rows of first tokens.  Returns (float32 (T, D), ``experts``' stats).
    """
    t, k = idx_TxK.shape
    d = x_TxD.shape[-1]
    order, token, group_sizes = sort_by_expert(idx_TxK, n_experts)
    # (T*k, D) rows sorted by expert, each marked if its token is a sequence's first.
    rows = ExpertRows(x_TxD[token], group_sizes, (token % seq) == 0)
    y, stats = experts(rows, w13, w2, *noise)
    # Combine in float32: un-sort the rows (a gather) and sum the k slots
    # weighted by their gates.
    inv = jnp.argsort(order)
    y_tk = y[inv].astype(jnp.float32).reshape(t, k, d)
    # Each platform's float32 algorithm (TPUs refuse the F32_F32_F32 preset).
    out = with_dot_algorithm(
        jnp.float32, lambda alg: jnp.einsum("tkd,tk->td", y_tk, gates_TxK, precision=alg)
    )
    return out, stats


def run_expert_parallel(
    experts: Experts,
    x_TxD: jax.Array,
    idx_TxK: jax.Array,
    gates_TxK: jax.Array,
    w13: Any,
    w2: Any,
    noise: tuple[jax.Array | None, jax.Array | None],
    *,
    n_experts: int,
    up_recipe: Recipe,
    wire_dtype: Any,
) -> tuple[jax.Array, dict[str, Any]]:
    """The expert-parallel pair, dropless: FP8 dispatch, ``experts`` per shard, BF16 combine.

    ``w13`` (E, D, 2F) and ``w2`` (E, F, D) (arrays or FSDP-gathered
    QTensors) are split over "expert"; ``up_recipe``: the up-projection's
    (its input is what :func:`fp8jax.parallel.dispatch.dispatch` sends);
    ``wire_dtype``: the combine's.  ``noise``: the GEMMs' (2,) GradNoise
    values (or None), probed per shard (:func:`fp8jax.nn.grad_noise.per_shard`).
    Returns (float32 (T, D), stats merged over the shards as
    :func:`merge_shard_stats` says).
    """
    mesh = jax.sharding.get_abstract_mesh()
    n_dev = int(mesh.size)
    n_shards = int(mesh.shape["expert"])
    noise_S = tuple(per_shard(p, n_dev) for p in noise)

    def body(x, idx, gates, w13, w2, noise_S):
        route = plan_route(idx, n_experts, "expert")
        rows = dispatch(x, route, "expert", up_recipe)
        # This device's row of each GradNoise (its own rows' norms).
        noise = tuple(p[0] if p is not None else None for p in noise_S)
        y, stats = experts(ExpertRows(rows, route.group_sizes, None), w13, w2, *noise)
        # The rows each x-operand fraction is over, and how many are real rows.
        n_rows, valid = y.shape[0], jnp.sum(route.group_sizes)
        counts = {"experts_w2": (n_rows, valid), "experts_w13": (n_rows, valid)}
        tokens = dispatch_stats(x, up_recipe)
        if tokens is not None:
            # An FP8 dispatch quantized the tokens on their own device, as
            # the one-device up-projection quantizes its rows (row-local
            # tiles; each token is k rows): their telemetry is the GEMM input's.
            stats["experts_w13"]["x"] = tokens
            counts["experts_w13"] = (x.shape[0], x.shape[0])
        counts = jax.tree.map(lambda c: jnp.asarray(c, jnp.float32), counts)
        out = combine(y, route, gates, "expert", wire_dtype)
        # One entry per device: merged outside the body.
        return out, jax.tree.map(lambda s: s[None], (stats, counts))

    expert = P("expert", None, None)
    out, (stats_S, counts_S) = jax.shard_map(
        body,
        in_specs=(BATCH_SPEC, BATCH_SPEC, BATCH_SPEC, expert, expert, P(AXES, None)),
        out_specs=(BATCH_SPEC, P(AXES)),
        check_vma=False,
    )(x_TxD, idx_TxK, gates_TxK, w13, w2, noise_S)
    return out, merge_shard_stats(stats_S, counts_S, n_shards)


def merge_shard_stats(stats_S: dict[str, Any], counts_S: dict[str, Any], n_shards: int) -> dict:
    """The experts' telemetry over all devices from each device's (leading axis: the device).

    GEMM operands (:func:`fp8jax.telemetry.merge_operand_stats`): x's
    fractions over the real rows of every device (``counts_S[gemm]``: rows
    and real rows per device), w's over the experts' weights (every device
    holds an equal share).  ``channel_amax`` (per device: (E / S, F) of its
    local experts): the devices in mesh order have the "expert" axis
    minor, so a reshape lines the local experts up as global ones and a
    NaN-skipping max merges the devices holding the same experts.  Other
    entries pass as they are.
    """
    out = {}
    for key, val in stats_S.items():
        if key in counts_S:
            n, valid = counts_S[key]
            w_n = jnp.ones_like(n)
            out[key] = {
                "x": merge_operand_stats(val["x"], n, valid),
                "w": merge_operand_stats(val["w"], w_n),
            }
        elif key == "channel_amax":
            n_dev, e_loc, f = val.shape
            amax = val.reshape(n_dev // n_shards, n_shards * e_loc, f)
            out[key] = jnp.nanmax(amax, axis=0)
        else:
            out[key] = val
    return out
