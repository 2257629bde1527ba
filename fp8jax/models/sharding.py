"""Data + expert parallelism on a ``jax.sharding.Mesh`` with axes ('data', 'expert').

* Batch (tokens) and every activation that follows it: split over all
  devices, ``P(('data', 'expert'))`` on the batch axis.
* Routed expert weights (E, ., .) and their gradients / optimizer moments:
  ``P('expert')`` on the expert axis -- each 'expert' shard holds E / n_expert
  experts, replicated over 'data'.
* Everything else (attention, dense FFN, shared experts, router, norms,
  embedding, head, FP8 delayed-scaling state, router bias): replicated.

The model code is written for one device; ``jax.jit`` with these input
shardings lets XLA's SPMD partitioner insert the collectives (the all-to-all
style exchange of routed tokens becomes the gathers/reductions around the
grouped GEMM).  Losses and gradients equal the single-device ones up to
float32 reduction order.

Multi-GPU / multi-host: call ``jax.distributed.initialize()`` first on every
host (one process per host or per GPU), then ``make_mesh()`` over
``jax.devices()`` (all hosts' devices); each process feeds its slice of the
global batch (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "expert")
BATCH = P(AXES)


def make_mesh(n_expert: int | None = None, devices=None) -> Mesh:
    """A ('data', 'expert') mesh over ``devices`` (default: all), ``n_expert`` expert shards.

    ``n_expert`` defaults to the largest power of two <= 8 dividing the device count.
    """
    devs = list(jax.devices() if devices is None else devices)
    n = len(devs)
    if n_expert is None:
        n_expert = math.gcd(n, 8)
    if n % n_expert:
        raise ValueError(f"{n} devices cannot be split into {n_expert} expert shards")
    return Mesh(np.asarray(devs).reshape(n // n_expert, n_expert), AXES)


def _is_expert_weight(path) -> bool:
    """Routed expert weights are the MoE's own ``w13`` / ``w2`` arrays (E, ., .)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return bool(keys) and keys[-1] in ("w13", "w2") and "shared" not in keys


def state_shardings(state: nnx.State, mesh: Mesh, n_experts: int):
    """NamedShardings for a model state (any filter): experts over 'expert', rest replicated."""
    n_exp_shards = mesh.shape["expert"]

    def spec(path, leaf):
        shape = getattr(leaf, "shape", ())
        if (
            _is_expert_weight(path)
            and len(shape) == 3
            and shape[0] == n_experts
            and n_experts % n_exp_shards == 0
        ):
            return NamedSharding(mesh, P("expert", None, None))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(spec, state)


def shard_model(model: nnx.Module, mesh: Mesh) -> None:
    """Place a model's variables on ``mesh`` in place (see the module docstring)."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, model.cfg.n_routed_experts)
    nnx.update(model, jax.device_put(state, shardings))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [B, T]: batch split over all devices (B must divide by the device count)."""
    return NamedSharding(mesh, BATCH)
