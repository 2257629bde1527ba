"""Where each array of the training state lives on a ("data", "fsdp", "expert") mesh.

One rule for parameters, FP32 master weights and their AdamW moments (a
moment has its parameter's path and shape, so it gets the same sharding):

* routed experts (the MoE's own ``w13`` / ``w2``, shape (E, ., .)): axis 0
  over "expert" when E divides by the expert axis;
* FSDP: the largest remaining axis whose length divides by the fsdp axis
  is split over "fsdp" (ties: the later axis, a GEMM's output features);
  a Dense ``kernel`` (in_features + out_features) is split over its first
  axis when that divides: each shard is then a band of whole rows of the
  GEMM's (K, N) weight matrix, so 128x128 FP8 blocks never straddle two
  shards (see :mod:`fp8jax.parallel.fsdp`); arrays with no divisible axis
  stay replicated;
* everything else (FP8 delayed-scaling state, router bias, step counters,
  scalars): replicated.

Nothing is split over "data": those devices hold full copies.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROUTED_EXPERT_NAMES = ("w13", "w2")


def _dict_keys(path) -> list[str]:
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def is_routed_expert(path, shape: tuple[int, ...], n_experts: int | None) -> bool:
    """A routed expert weight: the MoE's own w13 / w2 (E, ., .), not a shared expert's."""
    return is_routed_expert_keys(_dict_keys(path), shape, n_experts)


def is_routed_expert_keys(keys, shape: tuple[int, ...], n_experts: int | None) -> bool:
    """:func:`is_routed_expert` on the path's dictionary keys."""
    keys = list(keys)
    return (
        bool(keys)
        and keys[-1] in ROUTED_EXPERT_NAMES
        and "shared" not in keys
        and len(shape) == 3
        and (n_experts is None or shape[0] == n_experts)
    )


def fsdp_axis(shape: tuple[int, ...], n_fsdp: int, skip: tuple[int, ...] = ()) -> int | None:
    """The axis FSDP splits: the largest one divisible by ``n_fsdp`` (later axis on ties)."""
    if n_fsdp <= 1:
        return None
    best = None
    for ax, n in enumerate(shape):
        if ax in skip or n % n_fsdp or n < n_fsdp:
            continue
        if best is None or n >= shape[best]:
            best = ax
    return best


def param_spec(path, shape: tuple[int, ...], mesh: Mesh, n_experts: int | None = None) -> P:
    """The PartitionSpec of one parameter-like array (a parameter or one of its moments)."""
    spec: list[Any] = [None] * len(shape)
    skip: tuple[int, ...] = ()
    n_exp = mesh.shape["expert"]
    if is_routed_expert(path, shape, n_experts) and n_exp > 1 and shape[0] % n_exp == 0:
        spec[0] = "expert"
        skip = (0,)
    n_fsdp = mesh.shape["fsdp"]
    keys = _dict_keys(path)
    if keys and keys[-1] == "kernel" and n_fsdp > 1 and shape[0] % n_fsdp == 0:
        ax = 0
    else:
        ax = fsdp_axis(shape, n_fsdp, skip)
    if ax is not None:
        spec[ax] = "fsdp"
    return P(*spec)


def tree_shardings(tree: Any, mesh: Mesh, n_experts: int | None = None) -> Any:
    """NamedShardings for every leaf of ``tree`` (params, optimizer state, a whole TrainState).

    Scalars and arrays without a divisible axis are replicated.
    """

    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, param_spec(path, shape, mesh, n_experts))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated_shardings(tree: Any, mesh: Mesh) -> Any:
    """Every leaf replicated (FP8 scaling state, router bias, RNG counters)."""
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def train_state_shardings(state: Any, mesh: Mesh, n_experts: int | None = None) -> Any:
    """Shardings of a training state with fields step, params, fp8, bias, rest, opt_state.

    Params and optimizer state follow :func:`tree_shardings`; the step, the
    FP8 scaling state, the router bias and the rest are replicated.
    """
    rep = replicated_shardings
    return state._replace(
        step=NamedSharding(mesh, P()),
        params=tree_shardings(state.params, mesh, n_experts),
        fp8=rep(state.fp8, mesh),
        bias=rep(state.bias, mesh),
        rest=rep(state.rest, mesh),
        opt_state=tree_shardings(state.opt_state, mesh, n_experts),
    )


def shard_tree(tree: Any, mesh: Mesh, n_experts: int | None = None) -> Any:
    """``device_put`` every leaf of ``tree`` with :func:`tree_shardings`."""
    return jax.device_put(tree, tree_shardings(tree, mesh, n_experts))
