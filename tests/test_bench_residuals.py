"""Saved residuals: exactly what autodiff keeps for a function with known residuals
(sin keeps cos x, a product keeps both factors), arguments told apart, summaries that
add up; an FP8 Dense layer keeps FP8 codes where BF16 keeps BF16 activations."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

import fp8jax
from fp8jax.bench.residuals import residual_summary, saved_residuals
from fp8jax.nn.dense import Dense


def test_known_residuals_and_summary():
    def f(x, y):
        return jnp.sum(jnp.sin(x) * y.astype(jnp.float32))

    x = jnp.ones((64, 32), jnp.float32)
    y = jnp.ones((64, 32), jnp.bfloat16)
    rows = saved_residuals(f, x, y)
    made = [r for r in rows if r["source"] != "argument"]
    # cos(x) for sin's derivative, sin(x) and the float32 y for the product's.
    assert [r["bytes"] for r in made] == [64 * 32 * 4] * 3
    assert all(r["source"].startswith("test_bench_residuals.py:") for r in made)
    s = residual_summary(rows)
    assert s["total_bytes"] == sum(r["bytes"] for r in made)
    assert s["by_dtype"] == {"float32": s["total_bytes"]}
    assert sum(b for _, b in s["top_sources"]) == s["total_bytes"]


def _dense_residuals(recipe):
    layer = Dense(256, 256, recipe=recipe, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((512, 256)), jnp.bfloat16)

    def f(x, p):
        return jnp.sum(nnx.merge(graph, p, rest)(jnp.tanh(x)).astype(jnp.float32))

    return residual_summary(saved_residuals(f, x, params))


def test_fp8_layer_keeps_codes_not_activations():
    bf16 = _dense_residuals(fp8jax.recipes.bf16())
    fp8 = _dense_residuals(fp8jax.recipes.deepseek_v3())
    assert fp8["by_dtype"].get("float8_e4m3fn", 0) >= 512 * 256
    assert bf16["by_dtype"].get("bfloat16", 0) >= 512 * 256 * 2
    assert "float8_e4m3fn" not in bf16["by_dtype"]


def test_ue8m0_cache_holds_one_byte_per_scale():
    f32 = _dense_residuals(fp8jax.recipes.deepseek_v3(pow2=True))
    e8 = _dense_residuals(fp8jax.recipes.deepseek_v3_1())
    # Same FP8 codes; x's 512 x 2 tile scales as bytes instead of float32.
    assert e8["by_dtype"]["float8_e4m3fn"] == f32["by_dtype"]["float8_e4m3fn"]
    assert e8["by_dtype"]["float8_e8m0fnu"] == 512 * 2
    assert f32["total_bytes"] - e8["total_bytes"] == 3 * 512 * 2
