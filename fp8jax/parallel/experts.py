"""The routed experts of a MoE layer under expert parallelism (one ``shard_map`` region).

Tokens arrive split over every device (the batch over ("data", "fsdp",
"expert")); the routed experts' weights are split over "expert".  On each
device: plan the route, dispatch (FP8 for FP8 recipes, see
:mod:`fp8jax.parallel.dispatch`), the up-projection on the received rows
(a pre-quantized QTensor for FP8 recipes), SwiGLU, the down-projection,
and the combine back to the tokens' devices in the recipe's compute dtype
(BF16, as DeepSeek-V3 combines).

Used by the MoE layer when the mesh set with ``jax.set_mesh`` has an
"expert" axis of size > 1 (:func:`expert_parallel_size`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8jax.parallel.dispatch import combine, dispatch, plan_route
from fp8jax.parallel.mesh import AXES, BATCH_SPEC
from fp8jax.ragged_dot import ragged_dot
from fp8jax.recipes import Recipe, needs_state


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


def routed_experts(
    x_TxD: jax.Array,
    idx_TxK: jax.Array,
    gates_TxK: jax.Array,
    w13_Ex2F: jax.Array,
    w2_ExFxD: jax.Array,
    *,
    recipe: Recipe,
    up_recipe: Recipe,
    activation: Callable[[jax.Array], jax.Array],
    dtype,
    capacity_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gate-weighted sum of the routed experts' outputs, float32 (T, D), and the dropped count.

    ``w13_Ex2F`` is (E, D, 2F) and ``w2_ExFxD`` (E, F, D); ``activation``
    maps the up-projection's (R, 2, F) output to the down-projection's
    (R, F) input; ``recipe`` is the down-projection's ("expert_down" site),
    ``up_recipe`` the up-projection's ("dispatch" site).  The dropped count is summed over all devices (0 when dropless).
    """
    n_experts = w13_Ex2F.shape[0]
    f = w2_ExFxD.shape[1]

    def body(x, idx, gates, w13, w2):
        route = plan_route(idx, n_experts, "expert", capacity_factor)
        rows = dispatch(x, route, "expert", up_recipe)
        gs = route.group_sizes
        h = ragged_dot(rows, w13, gs, recipe=up_recipe, preferred_element_type=dtype)
        act = activation(h.reshape(-1, 2, f))
        y = ragged_dot(act, w2, gs, recipe=recipe, preferred_element_type=dtype)
        dropped = lax.psum(route.dropped, AXES)
        # BF16 on the wire (the compute dtype of every recipe but fp32's).
        return combine(y, route, gates, "expert", recipe.compute), dropped

    expert = P("expert", None, None)
    return jax.shard_map(
        body,
        in_specs=(BATCH_SPEC, BATCH_SPEC, BATCH_SPEC, expert, expert),
        out_specs=(BATCH_SPEC, P()),
        check_vma=False,
    )(x_TxD, idx_TxK, gates_TxK, w13_Ex2F, w2_ExFxD)
