"""Random Hadamard transform (RHT) in 16-element blocks along one axis.

For a block ``v`` of ``n`` elements (n a power of two, 16 by default) the
transform is

    RHT(v) = H_n (s * v) / sqrt(n)

with ``H_n`` the Sylvester Hadamard matrix (entries +-1, ``H_n H_n = n I``)
and ``s`` a random sign vector drawn once from a seed.  The matrix
``Q = H_n diag(s) / sqrt(n)`` is orthonormal (``Q^T Q = I``), so transforming
both operands of a product along their shared contraction axis leaves the
product unchanged in exact arithmetic:

    sum_k RHT(a)_k RHT(b)_k = a^T Q^T Q b = a^T b.

NVIDIA's NVFP4 recipe applies it to the two Wgrad operands (activations and
output gradients, along the token axis) before quantizing them to 16-element
blocks: an outlier in a block is spread over all 16 elements, so the block
scale no longer crushes the other 15 values to zero.

Numerics: the product by ``H_n`` is the fast Walsh-Hadamard transform, log2(n)
stages of pairwise float32 additions and subtractions in a fixed order, so
the result is deterministic and a numpy reference can reproduce it bit for
bit; the sign flip and the scaling by ``1/sqrt(16) = 1/4`` are exact (powers
of two).  The axis is zero-padded to a multiple of ``n``; the padded length
is kept in the output, because cropping it would break the orthogonality
that makes the transform cancel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.layout import pad_axis

RHT_BLOCK = 16


def hadamard_matrix(n: int) -> np.ndarray:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), float64, entries +-1."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def random_signs(seed: int, n: int = RHT_BLOCK) -> jnp.ndarray:
    """A reproducible float32 vector of ``n`` random signs (+-1) from an integer seed."""
    key = jax.random.key(seed)
    return jax.random.rademacher(key, (n,), dtype=jnp.float32)


def _fwht_last(x: jnp.ndarray) -> jnp.ndarray:
    """H_n x along the last axis (length n, a power of two): Sylvester order butterflies."""
    n = x.shape[-1]
    h = 1
    while h < n:
        # Pair element j with j + h inside each group of 2h: (a + b, a - b).
        g = x.reshape(x.shape[:-1] + (n // (2 * h), 2, h))
        a, b = g[..., 0, :], g[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(x.shape[:-1] + (n,))
        h *= 2
    return x


def rht(x: jnp.ndarray, signs: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """Random Hadamard transform of ``x`` (float32, or float64 when given) in blocks of ``len(signs)`` along ``axis``.

    The axis is zero-padded to a multiple of the block (zeros map to zeros
    and add nothing to a product); the result keeps the padded length.
    """
    n = int(signs.shape[0])
    if n < 1 or n & (n - 1):
        raise ValueError(f"RHT block must be a power of two, got {n}")
    if x.ndim == 0:
        raise ValueError("rht needs at least a 1-d tensor")
    axis = axis % x.ndim
    # float32 at least (bf16 inputs are exact in it); float64 stays float64.
    dt = jnp.promote_types(x.dtype, jnp.float32)
    xf = jnp.moveaxis(x.astype(dt), axis, -1)
    xf = pad_axis(xf, xf.ndim - 1, n)
    blocks = xf.reshape(xf.shape[:-1] + (-1, n))
    # The sign flip is exact; the 1/sqrt(n) scaling is exact for even powers
    # of two (n = 16 -> 1/4) and rounded once otherwise.
    y = _fwht_last(blocks * signs.astype(dt)) * jnp.asarray(1.0 / math.sqrt(n), dt)
    y = y.reshape(xf.shape)
    return jnp.moveaxis(y, -1, axis)


def inverse_rht(y: jnp.ndarray, signs: jnp.ndarray, axis: int = -1) -> jnp.ndarray:
    """Inverse of :func:`rht` (on the padded length): s * H_n y / sqrt(n)."""
    n = int(signs.shape[0])
    if y.shape[axis] % n:
        raise ValueError(f"inverse_rht needs the axis length to be a multiple of {n}")
    axis = axis % y.ndim
    dt = jnp.promote_types(y.dtype, jnp.float32)
    yf = jnp.moveaxis(y.astype(dt), axis, -1)
    blocks = yf.reshape(yf.shape[:-1] + (-1, n))
    # H_n is symmetric and H_n H_n = n I, so Q^-1 = Q^T = diag(s) H_n / sqrt(n).
    x = _fwht_last(blocks) * jnp.asarray(1.0 / math.sqrt(n), dt) * signs.astype(dt)
    return jnp.moveaxis(x.reshape(yf.shape), -1, axis)
