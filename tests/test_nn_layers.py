"""Dense and Einsum layers: numerics vs float64 references, state ownership, telemetry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx

import fp8jax
from fp8jax.nn import Dense, Einsum, FP8State
from fp8jax.nn.einsum import parse_einsum
from fp8jax.nn.recording import capture


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_dense_deepseek_matches_tile_block_reference():
    r = fp8jax.recipes.deepseek_v3()
    layer = Dense(200, 160, recipe=r, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = _x((3, 50, 200))
    y = np.asarray(layer(jnp.asarray(x)))
    w = np.asarray(layer.kernel[...])
    # 1x128 tiles along K for x, 128x128 blocks for W (scales as the preset says), float64 product.
    xq = ref.ref_qdq(x.reshape(150, 200), ref.E4M3, "tile", axis=1, pow2=r.fprop.lhs.pow2)
    wq = ref.ref_qdq(w, ref.E4M3, "block", pow2=r.fprop.rhs.pow2)
    want = (xq @ wq).reshape(3, 50, 160)
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert layer.fp8_state is None


def test_dense_general_axes_and_bias():
    r = fp8jax.recipes.fp32()
    layer = Dense(
        (4, 8), 16, recipe=r, axis=(-2, -1), use_bias=True, dtype=jnp.float32, rngs=nnx.Rngs(1)
    )
    layer.bias[...] = jnp.arange(16.0)
    x = _x((5, 4, 8), 1)
    y = np.asarray(layer(jnp.asarray(x)))
    want = x.reshape(5, 32).astype(np.float64) @ np.asarray(layer.kernel[...]).reshape(
        32, 16
    ) + np.arange(16)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected"):
        layer(jnp.ones((5, 8, 4)))


def test_delayed_recipe_owns_state_and_its_gradient_updates_it():
    layer = Dense(64, 32, recipe=fp8jax.recipes.hybrid_delayed(), rngs=nnx.Rngs(0))
    assert isinstance(layer.fp8_state, FP8State)
    graph, params, st, rest = nnx.split(layer, nnx.Param, FP8State, ...)
    x = jnp.asarray(_x((8, 64)) * 0.5)

    def f(p, s):
        return jnp.sum(nnx.merge(graph, p, s, rest)(x).astype(jnp.float32))

    _, gs = jax.grad(f, argnums=(0, 1))(params, st)
    new = jax.tree.leaves(gs, is_leaf=lambda v: isinstance(v, fp8jax.scaling.DelayedGemmState))[0]
    np.testing.assert_allclose(float(new.x.amax_history[0]), float(jnp.max(jnp.abs(x))), rtol=1e-6)
    np.testing.assert_allclose(float(new.dy.amax_history[0]), 1.0)
    for name in ("bf16", "deepseek_v3", "current_tensor", "rowwise"):
        layer = Dense(64, 32, recipe=fp8jax.registry.get(name), rngs=nnx.Rngs(0))
        assert not jax.tree.leaves(nnx.state(layer, FP8State))


def test_einsum_matches_numpy_and_dense():
    r = fp8jax.recipes.fp32()
    lay = Einsum("btd,dnh->btnh", (16, 2, 8), recipe=r, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = _x((2, 5, 16), 2)
    want = np.einsum("btd,dnh->btnh", x.astype(np.float64), np.asarray(lay.kernel[...], np.float64))
    np.testing.assert_allclose(np.asarray(lay(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)
    # Batch dims and an output permutation.
    lay2 = Einsum("bhd,hde->ebh", (3, 4, 5), recipe=r, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x2 = _x((2, 3, 4), 3)
    want2 = np.einsum(
        "bhd,hde->ebh", x2.astype(np.float64), np.asarray(lay2.kernel[...], np.float64)
    )
    np.testing.assert_allclose(np.asarray(lay2(jnp.asarray(x2))), want2, rtol=1e-5, atol=1e-6)
    # Same FP8 numerics as a Dense layer holding the same kernel.
    d = fp8jax.recipes.deepseek_v3()
    e = Einsum("td,df->tf", (200, 64), recipe=d, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense = Dense(200, 64, recipe=d, dtype=jnp.float32, rngs=nnx.Rngs(0))
    dense.kernel[...] = e.kernel[...]
    xx = jnp.asarray(_x((7, 200), 4))
    np.testing.assert_array_equal(np.asarray(e(xx)), np.asarray(dense(xx)))


def test_einsum_parse_errors():
    assert parse_einsum("ab,bc->ac") == ((((1,), (0,)), ((), ())), (0, 1))
    for bad in ("ab,bc", "ab,bc->ad", "abb,bc->ac", "ab,cd->ac"):
        with pytest.raises(ValueError):
            parse_einsum(bad)


def test_telemetry_names_and_values():
    layer = Dense(64, 32, recipe=fp8jax.recipes.current_tensor(), name="proj", rngs=nnx.Rngs(0))
    x = np.zeros((4, 64), np.float32)
    x[0, 0] = 1e4  # one outlier: per-tensor scaling flushes the small values
    x[1:] = 1e-3 * _x((3, 64), 5)
    _, stats = capture(layer, jnp.asarray(x))
    assert set(stats) == {"proj/x", "proj/w"}
    np.testing.assert_allclose(float(stats["proj/x"]["amax"]), 1e4)
    # Independent count: values whose E4M3 code is zero under scale 1e4/448.
    s = np.float32(1e4) / np.float32(448)
    want = np.mean((x != 0) & (ref.ref_cast(x / s, ref.E4M3).astype(np.float32) == 0))
    np.testing.assert_allclose(float(stats["proj/x"]["flushed"]), want, rtol=1e-6)
    assert float(stats["proj/x"]["saturated"]) == 0

    # Two layers with one name cannot both report.
    class Twice(nnx.Module):
        def __init__(self):
            kw = dict(recipe=layer.recipe, name="proj")
            self.a = Dense(64, 64, rngs=nnx.Rngs(1), **kw)
            self.b = Dense(64, 64, rngs=nnx.Rngs(2), **kw)

        def __call__(self, x):
            return self.b(self.a(x))

    with pytest.raises(ValueError, match="duplicate"):
        capture(Twice(), jnp.asarray(x))
