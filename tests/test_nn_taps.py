"""Layer GEMM hooks: a hook sees each Dense and expert GEMM traced inside its block, in
order, may wrap the output, composes with other hooks, and leaves modules untouched."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fp8jax
import fp8jax.models.moe as moe
import fp8jax.nn.dense as dense
from fp8jax.models import MoETransformer, loss_fn
from fp8jax.models.config import ModelConfig
from fp8jax.nn import taps
from fp8jax.nn.dense import Dense
from fp8jax.nn.einsum import Einsum


def _dense():
    return Dense(8, 4, recipe=fp8jax.recipes.fp32(), dtype=jnp.float32, rngs=nnx.Rngs(0))


def test_outside_a_block_the_call_is_the_gemm_itself():
    layer = _dense()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8)), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
    np.testing.assert_allclose(np.asarray(layer(x)), ref, rtol=1e-6)


def test_hooks_compose_outermost_first_and_may_replace_the_output():
    layer = _dense()
    x = jnp.ones((2, 8), jnp.float32)
    seen = []

    def outer(scope, call, x, w, dims, **kw):
        seen.append(("outer", scope, w.shape))
        y, st = call(x, w, dims, **kw)
        return y + 1.0, st

    def inner(scope, call, x, w, dims, **kw):
        seen.append(("inner", scope, w.shape))
        y, st = call(x, w, dims, **kw)
        return y * 2.0, st

    plain = np.asarray(layer(x))
    with taps.tapping(outer), taps.tapping(inner):
        y = np.asarray(layer(x))
    assert seen == [("outer", "dense", (8, 4)), ("inner", "dense", (8, 4))]
    np.testing.assert_array_equal(y, plain * 2.0 + 1.0)
    # Closed blocks leave nothing behind.
    np.testing.assert_array_equal(np.asarray(layer(x)), plain)


def test_model_gemms_reach_the_hook_without_reassigning_module_attributes():
    before = (dense.dot_general_with_stats, moe.ragged_dot_with_stats)
    model = MoETransformer(ModelConfig.tiny(), fp8jax.recipes.bf16(), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
    scopes = []

    def hook(scope, call, x, w, groups, **kw):
        scopes.append(scope)
        assert (dense.dot_general_with_stats, moe.ragged_dot_with_stats) == before
        return call(x, w, groups, **kw)

    graph, params, rest = nnx.split(model, nnx.Param, ...)
    with taps.tapping(hook):
        jax.eval_shape(lambda p: loss_fn(nnx.merge(graph, p, rest), tokens)[0], params)
    # Every expert GEMM of the MoE layer (up and down projections) is seen, with the dense ones.
    assert scopes.count("expert") == 2
    assert scopes.count("dense") > 0


def test_einsum_gemm_reaches_the_hook_with_its_dimension_numbers():
    layer = Einsum("btd,dh->bth", (8, 4), recipe=fp8jax.recipes.fp32(), rngs=nnx.Rngs(0))
    x = jnp.ones((2, 3, 8), jnp.float32)
    seen = []

    def hook(scope, call, x, w, dims, **kw):
        seen.append((scope, dims, w.shape))
        return call(x, w, dims, **kw)

    plain = np.asarray(layer(x))
    with taps.tapping(hook):
        np.testing.assert_array_equal(np.asarray(layer(x)), plain)
    assert seen == [("dense", layer.dn, (8, 4))]
