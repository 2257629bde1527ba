"""``jnp.where``, ``jnp.clip``, ``jnp.isinf`` and ``jnp.isfinite`` with their values, traced inline.

jax.numpy wraps each of these in a ``jax.jit`` of its own: every call inside
a trace binds a nested jit, and lowering writes each distinct signature as a
private function that XLA inlines again.  The quantizer calls them dozens of
times per operand, and an FP8 train step quantizes dozens of operands: in
the tiny MoE step those wrappers were some 350 of the lowered module's 460
functions and about a quarter of its CPU trace + lower + compile time.

These are the same operations (the same dtype promotion, broadcasting and
``lax.select`` / ``lax.max`` / ``lax.min`` order), bound directly.

:func:`traced_inline` does the same for a whole function: the quantizer's
integer and bit arithmetic is written with jax.numpy's operators, each of
them a jit too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def where(condition: jax.Array, x, y) -> jax.Array:
    """``jnp.where(condition, x, y)``: x where ``condition``, else y, in
    ``jnp.result_type(x, y)``, broadcast together."""
    dtype = jnp.result_type(x, y)
    x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    shape = jnp.broadcast_shapes(jnp.shape(condition), x.shape, y.shape)
    return lax.select(
        jnp.broadcast_to(condition, shape), jnp.broadcast_to(x, shape), jnp.broadcast_to(y, shape)
    )


def clip(x: jax.Array, lo, hi) -> jax.Array:
    """``jnp.clip(x, lo, hi)``: ``minimum(hi, maximum(lo, x))`` (a NaN stays NaN)."""
    return jnp.minimum(hi, jnp.maximum(lo, x))


def isinf(x: jax.Array) -> jax.Array:
    """``jnp.isinf(x)`` of a floating-point ``x``: |x| == Inf (False for NaN)."""
    return lax.abs(x) == jnp.asarray(jnp.inf, x.dtype)


def isfinite(x: jax.Array) -> jax.Array:
    """``jnp.isfinite(x)`` of a floating-point ``x``: |x| < Inf (False for +-Inf and NaN).

    A comparison every backend lowers: Mosaic GPU has no ``is_finite``, and
    the quantizer kernels share this with the XLA paths.
    """
    return lax.abs(x) < jnp.asarray(jnp.inf, x.dtype)


def traced_inline[**P, R](fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with jax.numpy's jit wrappers off while it runs (``jax.disable_jit``).

    Every jax.numpy operator (``x + 1``, ``x << 3``, ``jnp.maximum``) is a
    ``jax.jit`` of its own, cached per shape: inside a trace, each one met
    with a new shape traces its wrapper again (0.4-1.7 ms a call on a 2-core
    CPU, where binding the primitives it holds takes about 0.1 ms).  The
    integer and bit arithmetic of a quantizer is dozens of such operators per
    operand, and a train step quantizes operands of dozens of shapes.  With
    the wrappers off, the same primitives are bound in the same order (the
    same program).

    Not for a function with a ``lax.scan`` or ``lax.while_loop`` (under
    ``jax.disable_jit`` they run their bodies in Python, unrolled into the
    trace) or one that calls a jit of the project's own (it would lose its
    trace cache).  A ``lax.cond`` or platform choice on traced values keeps
    its branches.
    """

    @functools.wraps(fn)
    def inline(*args: P.args, **kwargs: P.kwargs) -> R:
        with jax.disable_jit():
            return fn(*args, **kwargs)

    return inline
