"""GEMM operands: the cached FP8 activation tied to the layer's gradient keeps every bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.operands import after_gradient


@pytest.mark.parametrize("use_jit", [False, True])
def test_after_gradient_keeps_codes_and_scales(use_jit):
    rng = np.random.default_rng(0)
    x = fp8jax.quantize(jnp.asarray(rng.normal(size=(4, 256)) * 1e-3, jnp.float32), fp8jax.E4M3)
    dy = fp8jax.quantize(jnp.asarray(rng.normal(size=(4, 128)) * 1e5, jnp.float32), fp8jax.E4M3)
    f = jax.jit(after_gradient) if use_jit else after_gradient
    tied = f(x, dy)
    assert (tied.granularity, tied.axis, tied.tile) == (x.granularity, x.axis, x.tile)
    np.testing.assert_array_equal(np.asarray(tied.data), np.asarray(x.data))
    # Scales bit for bit (float32 patterns), a subnormal one included.
    scale = x.scale.at[0, 0].set(jnp.float32(1e-40))
    tied = f(fp8jax.QTensor(x.data, scale, x.granularity, x.axis, x.tile), dy)
    np.testing.assert_array_equal(
        np.asarray(tied.scale).view(np.uint32), np.asarray(scale).view(np.uint32)
    )


def test_after_gradient_passes_other_operands_through():
    x = jnp.ones((4, 8), jnp.bfloat16)
    dy = fp8jax.quantize(jnp.ones((4, 128), jnp.float32), fp8jax.E4M3)
    assert after_gradient(x, dy) is x
    q = fp8jax.quantize(jnp.ones((4, 128), jnp.float32), fp8jax.E4M3)
    assert after_gradient(q, jnp.ones((4, 8))) is q
