"""Variable types of the fp8jax layers (Flax NNX).

Three kinds of state live in an fp8jax model, and a training step treats each
differently (filter them with ``nnx.split(model, nnx.Param, FP8State, RouterBias, ...)``):

* ``nnx.Param``: trainable weights, updated by the optimizer.
* :class:`FP8State`: the delayed-scaling amax history and scale of one GEMM
  (a :class:`fp8jax.scaling.DelayedGemmState`).  Its *gradient* is the
  updated state ("overwrite with gradient"): replace it, never optimize it;
  microbatches merge with :func:`fp8jax.scaling.merge_delayed_states`.
* :class:`RouterBias`: the auxiliary-loss-free routing bias of DeepSeek-V3.
  It only selects experts (no gradient flows into it) and is moved by
  :func:`fp8jax.models.update_router_bias` after each step.
"""

from __future__ import annotations

from flax import nnx


class FP8State(nnx.Variable):
    """Delayed-scaling state (DelayedGemmState) of one FP8 GEMM; replaced by its gradient."""


class RouterBias(nnx.Variable):
    """Aux-loss-free routing bias (selection only); updated outside the optimizer."""
