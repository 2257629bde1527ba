"""Summation in JAX: naive (sequential), Kahan, Neumaier and pairwise.

All functions flatten their input, sum in the input's floating dtype (no
hidden upcast: the point is to see what that dtype's arithmetic does) and are
jit-compiled.

* :func:`naive_sum`: left-to-right recursive summation, one accumulator. The
  rounding error grows like n * eps * sum|x| in the worst case.
  (``jnp.sum`` is *not* this: XLA reduces in a tree, which is already much
  closer to pairwise.)
* :func:`kahan_sum`: compensated summation (Kahan 1965): a second variable
  carries the low-order bits lost by each addition; the error is about
  2 eps sum|x|, independent of n.
* :func:`neumaier_sum`: Kahan-Babuska-Neumaier: also correct when an addend
  is larger than the running sum (Kahan's compensation is lost then, e.g.
  1 + 1e100 + 1 - 1e100).
* :func:`pairwise_sum`: recursive halving, error ~ log2(n) eps sum|x|, fully
  parallel.

``lanes``: the compensated sums run ``lanes`` independent accumulators side
by side (a (n / lanes, lanes) scan, vectorised) and merge them at the end with
Neumaier's rule.  Each lane is still compensated, so the accuracy is that of
the compensated sum; lanes=1 is the strictly sequential textbook algorithm.
The scan is over n / lanes steps, which matters on CPU where one scan step
costs about a microsecond.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.layout import pad_axis


def _flat(x) -> jnp.ndarray:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"summation needs a floating dtype, got {x.dtype}")
    return x.reshape(-1)


def _lanes(x: jnp.ndarray, lanes: int) -> jnp.ndarray:
    if lanes < 1:
        raise ValueError("lanes must be >= 1")
    # Zero padding does not change a sum (x + 0 == x exactly).
    x = pad_axis(x, 0, lanes)
    return x.reshape(-1, lanes)


@jax.jit
def naive_sum(x) -> jnp.ndarray:
    """Left-to-right sum with one accumulator in x's dtype."""
    x = _flat(x)

    def step(s, v):
        return s + v, None

    s, _ = lax.scan(step, jnp.zeros((), x.dtype), x)
    return s


def _kahan_step(carry, v):
    s, c = carry
    y = v - c  # remove the error made by the previous addition
    t = s + y  # low-order bits of y are lost here ...
    c = (t - s) - y  # ... and recovered here (algebraically zero)
    return (t, c), None


def _neumaier_step(carry, v):
    s, c = carry
    t = s + v
    # Whichever operand is smaller lost its low bits in t; recover them.
    c = c + jnp.where(jnp.abs(s) >= jnp.abs(v), (s - t) + v, (v - t) + s)
    return (t, c), None


def _merge(parts: jnp.ndarray) -> jnp.ndarray:
    """Neumaier-sum a short vector (the per-lane results)."""
    z = jnp.zeros((), parts.dtype)
    (s, c), _ = lax.scan(_neumaier_step, (z, z), parts)
    return s + c


@functools.partial(jax.jit, static_argnames="lanes")
def kahan_sum(x, lanes: int = 1) -> jnp.ndarray:
    """Kahan compensated sum (see the module docstring for ``lanes``)."""
    x = _lanes(_flat(x), lanes)
    z = jnp.zeros((lanes,), x.dtype)
    (s, c), _ = lax.scan(_kahan_step, (z, z), x)
    if lanes == 1:
        return s[0]
    # Lane i holds s_i with the error -c_i still to remove: merge s and -c.
    return _merge(jnp.concatenate([s, -c]))


@functools.partial(jax.jit, static_argnames="lanes")
def neumaier_sum(x, lanes: int = 1) -> jnp.ndarray:
    """Kahan-Babuska-Neumaier compensated sum (see the module docstring for ``lanes``)."""
    x = _lanes(_flat(x), lanes)
    z = jnp.zeros((lanes,), x.dtype)
    (s, c), _ = lax.scan(_neumaier_step, (z, z), x)
    if lanes == 1:
        return s[0] + c[0]
    return _merge(jnp.concatenate([s, c]))


@jax.jit
def pairwise_sum(x) -> jnp.ndarray:
    """Pairwise (cascade) sum: add the two halves, recursively, log2(n) levels."""
    x = _flat(x)
    n = x.shape[0]
    if n == 0:
        return jnp.zeros((), x.dtype)
    size = 1 << (n - 1).bit_length()
    x = jnp.pad(x, (0, size - n))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]
