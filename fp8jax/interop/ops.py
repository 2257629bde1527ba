"""The intercepted dot_general and einsum, each run through a recipe with fp8jax's own GEMMs.

Each returns (y, telemetry) with y exactly what ``fp8jax.dot_general`` gives
for the same operands and recipe, in the layout the replaced ``lax`` / ``jnp``
op gives (``lax.ragged_dot`` already has the shape of
:func:`fp8jax.ragged_dot.ragged_dot_with_stats`, which the callers use as is).
fp8jax quantizes its left operand as an activation (1 x tile tiles) and its right one as a weight (blocks);
``weight="lhs"`` says the model's weight is the left operand, and the op
runs with the operands exchanged (then transposed back): the roles follow
the tensors, not their positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import scaling
from fp8jax.dot_general import dot_general_with_stats
from fp8jax.interop.einsum_dims import einsum_dims, explicit_spec, swapped
from fp8jax.recipes import Recipe

Stats = dict[str, dict[str, jax.Array]]


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    recipe: Recipe,
    *,
    weight: str = "rhs",
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, Stats]:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` through ``recipe``."""
    if weight == "rhs":
        return dot_general_with_stats(
            lhs,
            rhs,
            dimension_numbers,
            recipe=recipe,
            state=state,
            preferred_element_type=preferred_element_type,
        )
    if weight != "lhs":
        raise ValueError(f"weight must be 'lhs' or 'rhs', got {weight!r}")
    (lc, rc), (lb, rb) = dimension_numbers
    y, stats = dot_general_with_stats(
        rhs,
        lhs,
        ((rc, lc), (rb, lb)),
        recipe=recipe,
        state=state,
        preferred_element_type=preferred_element_type,
    )
    # Exchanged operands give (batch, rhs free, lhs free): back to lax's order.
    nb = len(lb)
    n_lf = jnp.ndim(lhs) - len(lc) - nb
    n_rf = jnp.ndim(rhs) - len(rc) - nb
    perm = (
        tuple(range(nb)) + tuple(range(nb + n_rf, nb + n_rf + n_lf)) + tuple(range(nb, nb + n_rf))
    )
    return jnp.transpose(y, perm), stats


def einsum(
    spec: str,
    lhs: jax.Array,
    rhs: jax.Array,
    recipe: Recipe,
    *,
    weight: str = "rhs",
    state: scaling.DelayedGemmState | None = None,
    preferred_element_type: Any = None,
) -> tuple[jax.Array, Stats]:
    """Two-operand ``jnp.einsum(spec, lhs, rhs)`` as one dot_general through ``recipe``."""
    spec = explicit_spec(spec, jnp.ndim(lhs), jnp.ndim(rhs))
    if weight == "lhs":
        spec, lhs, rhs = swapped(spec), rhs, lhs
    elif weight != "rhs":
        raise ValueError(f"weight must be 'lhs' or 'rhs', got {weight!r}")
    dn, perm = einsum_dims(spec, jnp.ndim(lhs), jnp.ndim(rhs))
    y, stats = dot_general_with_stats(
        lhs, rhs, dn, recipe=recipe, state=state, preferred_element_type=preferred_element_type
    )
    return jnp.transpose(y, perm), stats
