"""Training on a mesh: the one setup call a training loop makes.

:func:`setup_training` builds the mesh named by the config's ``mesh`` field,
places the training state on it (parameters, FP32 master weights and BF16
moments by :mod:`fp8jax.parallel.placement`; FP8 state, router bias, step
replicated) and wraps the loss so FSDP-split parameters are gathered at its
top (FP8 blocks for FP8 recipes, :mod:`fp8jax.parallel.fsdp`).
:func:`in_mesh` makes a jitted function trace and run under the mesh, which
is what turns on expert parallelism in the MoE layers
(:mod:`fp8jax.parallel.experts`).  On one device all of it is the plain
single-device run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from fp8jax.parallel import placement
from fp8jax.parallel.fsdp import fsdp_loss, kernel_layouts
from fp8jax.parallel.mesh import AXES, make_mesh
from fp8jax.recipes import Recipe


def setup_training(
    mesh_cfg: Mapping[str, Any],
    state: Any,
    model: nnx.Module,
    recipe: Recipe,
    n_experts: int,
    loss_fn: Callable,
    batch_sizes: tuple[int, ...] = (),
) -> tuple[Mesh, Any, Callable]:
    """(mesh, state placed on it, loss gathering FSDP-split parameters).

    ``mesh_cfg``: {"data", "fsdp", "expert"} sizes (-1: the rest; other keys,
    such as the process settings, are ignored here).  ``state`` has the
    fields of ``fp8jax.train.state.TrainState``; ``model`` (or its
    ``nnx.eval_shape``) names the Dense kernels' layouts.  ``batch_sizes``
    must each divide by the device count (one row per device at least).
    """
    mesh = make_mesh({a: int(mesh_cfg[a]) for a in AXES})
    for b in batch_sizes:
        if b % mesh.size:
            raise ValueError(
                f"batch size {b} does not split over the mesh's {mesh.size} devices "
                f"{dict(mesh.shape)}; make it a multiple of {mesh.size}"
            )
    state = jax.device_put(state, placement.train_state_shardings(state, mesh, n_experts))
    loss = fsdp_loss(loss_fn, mesh, recipe, n_experts, kernel_layouts(model))
    return mesh, state, loss


def in_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` traced and run with ``mesh`` as the current mesh (``jax.set_mesh``)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    return wrapped
