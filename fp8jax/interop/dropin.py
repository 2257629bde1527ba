"""Drop-in replacements for ``lax.dot_general``, ``jnp.einsum`` and ``lax.ragged_dot``.

``make_dot_general(recipe)`` makes a function with ``lax.dot_general``'s
signature that runs fp8jax's differentiable GEMM with the recipe
(``make_einsum`` and ``make_ragged_dot`` likewise), for the hooks Flax layers
offer.  ``dot_general``, ``einsum`` and ``ragged_dot`` are the same factories
under the names the hooks take (``fp8jax.interop.dot_general(r)`` reads as
"the dot_general for r")::

    nnx.Linear(d, f, dot_general=fp8jax.interop.dot_general("deepseek_v3"), rngs=...)
    nnx.Einsum("btd,dnh->btnh", (d, n, h), einsum_op=fp8jax.interop.einsum("deepseek_v3"), ...)
    flax.linen.Dense(f, dot_general=fp8jax.interop.dot_general(recipe))   # also DenseGeneral

The right operand is taken as the weight (the layers above pass the input
first and the kernel second).  These callables hold no state: a
delayed-scaling recipe needs its amax history carried between steps, which
the Qwix provider (:class:`fp8jax.interop.QwixProvider`) or fp8jax's own
layers (:mod:`fp8jax.nn`) keep; here it raises ValueError.

Non-finite operands: E4M3 (float8_e4m3fn) has no Inf code, so with an E4M3
recipe (deepseek_v3, current_tensor, rowwise, ...) an +-Inf element
quantizes to NaN and every output whose sum has a product with it (its row
of the output for an activation element, its column for a weight element;
Wgrad and Dgrad likewise) is NaN where ``lax`` gives +-Inf.  Scales are taken
from the finite elements, so all other outputs are bit for bit those of the
same op with that element set to 0.  bf16 / fp32 keep ``lax``'s Inf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.interop import ops
from fp8jax.interop.rules import resolve_recipe
from fp8jax.ragged_dot import ragged_dot_with_stats
from fp8jax.recipes import Recipe, needs_state


def _stateless(recipe: str | Recipe | None, what: str) -> Recipe | None:
    r = resolve_recipe(recipe)
    if r is not None and needs_state(r):
        raise ValueError(
            f"{what}({r.name!r}): delayed scaling keeps state between steps; "
            "use fp8jax.interop.QwixProvider or the fp8jax.nn layers"
        )
    return r


def _no_sharding(out_sharding) -> None:
    if out_sharding is not None:
        raise NotImplementedError("fp8jax drop-in ops do not take out_sharding")


def make_dot_general(recipe: str | Recipe | None) -> Callable[..., jax.Array]:
    """Make a ``lax.dot_general`` whose GEMMs (and gradients) follow ``recipe``; None: lax itself."""
    r = _stateless(recipe, "dot_general")
    if r is None:
        return lax.dot_general

    def fp8_dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        # The recipe decides the precision; ``precision`` is the model's request
        # for an unquantized dot and has no meaning here.
        del precision
        _no_sharding(out_sharding)
        y, _ = ops.dot_general(
            lhs, rhs, dimension_numbers, r, preferred_element_type=preferred_element_type
        )
        return y

    return fp8_dot_general


def make_einsum(recipe: str | Recipe | None) -> Callable[..., jax.Array]:
    """Make a two-operand ``jnp.einsum`` whose contraction follows ``recipe``; None: jnp itself."""
    r = _stateless(recipe, "einsum")
    if r is None:
        return jnp.einsum

    def fp8_einsum(
        spec: str,
        lhs,
        rhs,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
        **unused: Any,
    ) -> jax.Array:
        del precision, unused
        _no_sharding(out_sharding)
        y, _ = ops.einsum(spec, lhs, rhs, r, preferred_element_type=preferred_element_type)
        return y

    return fp8_einsum


def make_ragged_dot(recipe: str | Recipe | None) -> Callable[..., jax.Array]:
    """Make a ``lax.ragged_dot`` whose expert GEMMs follow ``recipe``; None: lax itself."""
    r = _stateless(recipe, "ragged_dot")
    if r is None:
        return lax.ragged_dot

    def fp8_ragged_dot(
        lhs,
        rhs,
        group_sizes,
        precision: Any = None,
        preferred_element_type: Any = None,
        group_offset: Any = None,
        out_sharding: Any = None,
    ) -> jax.Array:
        del precision
        _no_sharding(out_sharding)
        if group_offset is not None:
            raise NotImplementedError("fp8jax ragged_dot: group_offset is not supported")
        y, _ = ragged_dot_with_stats(
            lhs, rhs, group_sizes, recipe=r, preferred_element_type=preferred_element_type
        )
        return y

    return fp8_ragged_dot


# The names of the hooks they fill: ``nnx.Linear(dot_general=interop.dot_general(r))``.
dot_general = make_dot_general
einsum = make_einsum
ragged_dot = make_ragged_dot
