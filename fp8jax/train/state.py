"""The training state: one pytree with the model split by variable kind.

``nnx.split(model, nnx.Param, FP8State, RouterBias, ...)`` gives four
states that training treats differently:

* ``params``  (nnx.Param): FP32 master weights, updated by AdamW;
* ``fp8``     (fp8jax.nn.FP8State): delayed-scaling amax histories and
  scales, replaced by their gradient (overwrite-with-gradient), never
  clipped or optimized;
* ``bias``    (fp8jax.nn.RouterBias): the aux-loss-free routing bias,
  updated from the expert load after each step, not by gradient;
* ``rest``    (everything else, e.g. RNG counters): carried unchanged.

The graph definition stays outside the pytree (it is static under jit).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fp8jax.nn import FP8State, RouterBias


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    fp8: Any
    bias: Any
    rest: Any
    opt_state: Any


def variable_filters():
    """(Param, FP8State, RouterBias) filters; FP8State/RouterBias come from fp8jax.nn."""
    return nnx.Param, FP8State, RouterBias


def split_model(model: nnx.Module):
    """-> (graphdef, params, fp8, bias, rest)."""
    param_t, fp8_t, bias_t = variable_filters()
    return nnx.split(model, param_t, fp8_t, bias_t, ...)


def create_train_state(
    model: nnx.Module, tx: optax.GradientTransformation
) -> tuple[Any, TrainState]:
    """Split the model and initialize the optimizer on its Params only."""
    graphdef, params, fp8, bias, rest = split_model(model)
    bad = [
        (path, leaf.dtype)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if leaf.dtype != jnp.float32
    ]
    if bad:
        # Master weights must be FP32: the update would otherwise round away.
        raise ValueError(f"master weights must be float32; got {bad[:3]}")
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        fp8=fp8,
        bias=bias,
        rest=rest,
        opt_state=tx.init(params),
    )
    return graphdef, state


def count_params(params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))
