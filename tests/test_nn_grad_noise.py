"""The gradient-noise probe of block-format GEMMs against float64 numpy."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference_microscaling as ref
from flax import nnx

from fp8jax import recipes
from fp8jax.nn import Dense, Einsum
from fp8jax.nn.grad_noise import GradNoise, init_grad_noise, probe
from fp8jax.nn.recording import capture


def _want(dy):
    """(||dy||, ||Q(dy) - dy||) in float64, Q: MXFP8 rows along the last axis."""
    g = dy.reshape(-1, dy.shape[-1])
    q = ref.mx_quantize(g, ml_dtypes.float8_e4m3fn, -1, 32)[2].astype(np.float64)
    g = g.astype(np.float64)
    return np.array([np.linalg.norm(g), np.linalg.norm(q - g)])


@pytest.mark.parametrize("jit", [False, True])
def test_probe_is_the_identity_and_its_state_gets_the_gradient_noise(jit):
    recipe = recipes.mxfp8()
    var = init_grad_noise(recipe)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 8, 40)), jnp.float32)
    c = (rng.standard_normal((3, 8, 40)) * np.exp(rng.standard_normal((3, 8, 1)))).astype(
        np.float32
    )

    def f(x, pair):
        return jnp.sum(probe(x, pair, recipe) * c)

    g = jax.grad(f, argnums=(0, 1))
    dx, dpair = (jax.jit(g) if jit else g)(x, var.get_value())
    np.testing.assert_array_equal(np.asarray(dx), c)  # identity forward
    np.testing.assert_allclose(np.asarray(dpair, np.float64), _want(c), rtol=1e-5)
    assert 0 < float(dpair[1]) < float(dpair[0])


def test_only_block_format_gradients_are_probed():
    assert init_grad_noise(recipes.deepseek_v3()) is None
    assert init_grad_noise(recipes.bf16()) is None
    assert isinstance(init_grad_noise(recipes.nvfp4()), GradNoise)
    x = jnp.ones((2, 4))
    assert probe(x, None, recipes.deepseek_v3()) is x


def test_dense_layer_sows_the_last_steps_ratio():
    layer = Dense(32, 16, recipe=recipes.mxfp8(), name="d", rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 32)), jnp.bfloat16)
    _, st = capture(layer, x)
    assert math.isnan(float(st["d/dy"]["noise_ratio"]))  # nothing measured yet
    gdef, params, fp8, rest = nnx.split(layer, nnx.Param, GradNoise, ...)

    def loss(fp8):
        y = nnx.merge(gdef, params, fp8, rest)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    new = jax.grad(loss)(fp8)
    nnx.update(layer, new)
    pair = np.asarray(layer.grad_noise.get_value(), np.float64)
    assert pair[0] > 0 and pair[1] > 0
    _, st = capture(layer, x)
    np.testing.assert_allclose(float(st["d/dy"]["noise_ratio"]), pair[0] / pair[1], rtol=1e-6)


def test_einsum_layer_probes_its_gemm_as_dense_does():
    """Einsum's output gradient (dot_general's layout: batch, x free, kernel free)
    reaches its GradNoise as the float64 MXFP8 reference computes it."""
    layer = Einsum("btd,dh->bth", (32, 64), recipe=recipes.mxfp8(), name="e", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32)
    c = (rng.standard_normal((2, 3, 64)) * np.exp(rng.standard_normal((2, 3, 1)))).astype(
        np.float32
    )
    _, st = capture(layer, x)
    assert set(st) == {"e/x", "e/w", "e/dy"}
    gdef, params, noise, rest = nnx.split(layer, nnx.Param, GradNoise, ...)

    def loss(noise):
        y = nnx.merge(gdef, params, noise, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * c)

    pair = np.asarray(jax.grad(loss)(noise)["grad_noise"].get_value(), np.float64)
    # The layer's output is in its dtype (bfloat16): dy = c rounded to it.
    dy = np.asarray(jnp.asarray(c, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(pair, _want(dy), rtol=1e-5)
