"""GEMM operands: the cached FP8 activation tied to the layer's gradient keeps every bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.operands import after_gradient, materialize


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


@pytest.mark.parametrize("use_jit", [False, True])
def test_materialize_is_straight_through_for_quantized_operands(use_jit):
    # The values a QTensor represents, differentiated: the cotangent of its
    # codes is the gradient of those values in float32, its scales get zero
    # (the convention of the GEMMs' pre-quantized inputs).
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 128)) * np.exp(rng.normal(0, 2, (256, 1)))
    c = rng.standard_normal((256, 128))
    spec = fp8jax.recipes.deepseek_v3().fprop.rhs
    q = fp8jax.schemes.quantize(jnp.asarray(w, jnp.float32), spec, 1)
    values = np.asarray(q.data, np.float64) * np.repeat(
        np.repeat(np.asarray(q.scale, np.float64), 128, 0), 128, 1
    )

    def loss(q):
        return jnp.sum(materialize(q, jnp.float32) * jnp.asarray(c, jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss)) if use_jit else jax.value_and_grad(loss)
    v, g = fn(q)
    np.testing.assert_allclose(float(v), np.sum(values * c), rtol=1e-5)
    assert isinstance(g, fp8jax.QTensor) and g.data.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g.data), c.astype(np.float32))
    assert not np.any(np.asarray(g.scale))
