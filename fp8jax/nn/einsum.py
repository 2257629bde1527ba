"""Einsum layer whose contraction runs through :func:`fp8jax.dot_general`.

``Einsum("btd,dnh->btnh", (D, N, H), recipe=...)`` holds a kernel of the
given shape (the right-hand operand) and computes the einsum with the input
as left-hand operand: contracted letters (in both operands, not in the
output) form the GEMM's K, letters in both operands and the output are batch
dimensions, the rest are free.  The recipe decides the precision exactly as
for :class:`~fp8jax.nn.Dense`, and the GEMM is observed as Dense's is
(:func:`fp8jax.nn.observed.observed_gemm`: hook scope "dense" with the
einsum's dot_general dimension numbers, telemetry, and for block-format
gradients the noise probe on dot_general's output, whose last axis is the
kernel's last free axis).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.dot_general import dot_general_with_stats
from fp8jax.nn.dense import fan_in_init
from fp8jax.nn.grad_noise import init_grad_noise
from fp8jax.nn.observed import observed_gemm
from fp8jax.nn.variables import FP8State
from fp8jax.recipes import Recipe, needs_state
from fp8jax.scaling import init_delayed_gemm_state


def parse_einsum(spec: str) -> tuple[tuple, tuple[int, ...]]:
    """``"lhs,rhs->out"`` -> (lax dimension numbers, permutation of dot_general's output).

    dot_general returns (batch, lhs free, rhs free); the permutation brings that
    to the order of ``out``.
    """
    spec = spec.replace(" ", "")
    try:
        ins, out = spec.split("->")
        lhs, rhs = ins.split(",")
    except ValueError:
        raise ValueError(f"einsum spec must look like 'ab,bc->ac', got {spec!r}") from None
    for s in (lhs, rhs, out):
        if len(set(s)) != len(s) or not s.isalpha():
            raise ValueError(f"einsum spec {spec!r}: repeated or non-letter index in {s!r}")
    for c in lhs + rhs:
        if c not in out and not (c in lhs and c in rhs):
            raise ValueError(f"einsum spec {spec!r}: index {c!r} is summed in one operand only")
    for c in out:
        if c not in lhs and c not in rhs:
            raise ValueError(f"einsum spec {spec!r}: output index {c!r} not in any input")
    contract = [c for c in lhs if c in rhs and c not in out]
    batch = [c for c in lhs if c in rhs and c in out]
    lfree = [c for c in lhs if c not in rhs]
    rfree = [c for c in rhs if c not in lhs]
    dn = (
        (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
        (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
    )
    produced = batch + lfree + rfree
    perm = tuple(produced.index(c) for c in out)
    return dn, perm


class Einsum(nnx.Module):
    """``y = einsum(spec, x, kernel)`` with the contraction through fp8jax.dot_general.

    Args:
      spec: einsum spec "lhs,rhs->out"; lhs is the input, rhs the kernel.
      kernel_shape: shape of the kernel (must match rhs's letters).
      recipe: precision of the GEMMs.
      dtype / param_dtype / name / rngs: as :class:`~fp8jax.nn.Dense`.
    """

    def __init__(
        self,
        spec: str,
        kernel_shape: Sequence[int],
        *,
        recipe: Recipe,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        kernel_init: nnx.Initializer | None = None,
        name: str = "einsum",
        rngs: nnx.Rngs,
    ):
        self.spec = spec
        self.dn, self.perm = parse_einsum(spec)
        rhs = spec.replace(" ", "").split("->")[0].split(",")[1]
        if len(kernel_shape) != len(rhs):
            raise ValueError(f"kernel_shape {tuple(kernel_shape)} does not match {rhs!r}")
        self.recipe = recipe
        self.dtype = jnp.dtype(dtype)
        self.name = name
        fan_in = math.prod(kernel_shape[a] for a in self.dn[0][1])
        init = kernel_init or fan_in_init(fan_in)
        self.kernel = nnx.Param(init(rngs.params(), tuple(kernel_shape), jnp.dtype(param_dtype)))
        self.fp8_state = FP8State(init_delayed_gemm_state(recipe)) if needs_state(recipe) else None
        # Block-format gradients: their noise ratio (fp8jax.nn.grad_noise).
        self.grad_noise = init_grad_noise(recipe)

    def __call__(self, x: jax.Array) -> jax.Array:
        out = observed_gemm(
            self,
            self.name,
            "dense",
            dot_general_with_stats,
            x,
            self.kernel[...],
            self.dn,
            recipe=self.recipe,
            state_var=self.fp8_state,
            noise_var=self.grad_noise,
            # GEMM output in the activation dtype (accumulation is float32).
            preferred_element_type=self.dtype,
        )
        return jnp.transpose(out, self.perm)
