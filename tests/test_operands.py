"""GEMM operands: the cached FP8 activation tied to the layer's gradient keeps every bit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import ref_e5m6_tiles, ref_round_e5m6

import fp8jax
from fp8jax import recipes, variants
from fp8jax.formats import round_to_e5m6
from fp8jax.operands import (
    after_gradient,
    cache_for_wgrad,
    e5m6_tiles,
    materialize,
    quantize_operand,
    quantize_operand_twice,
    source_values,
)


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
    tied = f(fp8jax.QTensor(x.data, scale, x.layout), dy)
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


@pytest.mark.parametrize("use_jit", [False, True])
def test_source_values_are_the_kept_values_with_materializes_gradient(use_jit):
    # A QTensor that keeps the values its codes were made from gives those
    # (not the codes' values) to telemetry; its gradient takes the GEMMs'
    # form (the values' gradient in the codes' place), as materialize's does.
    rng = np.random.default_rng(4)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    c = rng.standard_normal((256, 128)).astype(np.float32)
    spec = fp8jax.recipes.deepseek_v3().fprop.rhs
    q = fp8jax.schemes.quantize(jnp.asarray(w), spec, 1)
    kept = dataclasses.replace(q, source=jnp.asarray(w))

    def loss(t):
        return jnp.sum(source_values(t, jnp.float32) * jnp.asarray(c))

    fn = jax.jit(jax.value_and_grad(loss)) if use_jit else jax.value_and_grad(loss)
    v, g = fn(kept)
    np.testing.assert_allclose(float(v), np.sum(w.astype(np.float64) * c), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(g.data), c)
    assert not np.any(np.asarray(g.scale)) and not np.any(np.asarray(g.source))
    # Without kept values: materialize's.
    np.testing.assert_array_equal(
        np.asarray(source_values(q, jnp.float32)), np.asarray(materialize(q, jnp.float32))
    )
    # The kept values move with the codes.
    b = kept.batched((1, 256, 128))
    np.testing.assert_array_equal(np.asarray(b.source), w[None])
    s = b.swapaxes(1, 2)
    np.testing.assert_array_equal(np.asarray(s.source), w.T[None])
    np.testing.assert_array_equal(np.asarray(s.take(jnp.array([0, 0])).source), np.stack([w.T] * 2))


def _heavy_rows(rng) -> np.ndarray:
    x = (rng.standard_normal((4, 320)) * np.exp(rng.uniform(-3, 3, (4, 1)))).astype(np.float32)
    x[0, 7], x[0, 200] = 1.0e5, -4.0e4  # massive activations, beyond 65,024
    x[1, 3] = 3.0e38  # near float32's largest value
    x[2, :128] *= np.float32(1e-30)  # a tiny tile
    x[2, 128:256] = 0.0  # an all-zero tile
    x[3, 5], x[3, 300] = np.inf, np.nan
    return x


@pytest.mark.parametrize("jit", [False, True])
def test_e5m6_tiles_matches_float64_reference(jit):
    x = _heavy_rows(np.random.default_rng(3))
    f = jax.jit(e5m6_tiles) if jit else e5m6_tiles
    got = f(jnp.asarray(x))
    assert got.dtype == jnp.bfloat16 and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got, np.float64), ref_e5m6_tiles(x), strict=True)
    # Along another axis (the edge tile of 64 takes its own scale).
    xt = np.ascontiguousarray(x[:, :192].T)
    got0 = np.asarray(e5m6_tiles(jnp.asarray(xt), axis=0), np.float64)
    np.testing.assert_array_equal(got0, ref_e5m6_tiles(xt, axis=0))


def test_e5m6_tiles_keep_massive_activations():
    x = _heavy_rows(np.random.default_rng(4))[:1]
    got = np.asarray(e5m6_tiles(jnp.asarray(x)), np.float64)
    # 7 significant bits: every element within 2^-7 of itself, nothing clipped.
    assert np.all(np.abs(got - x) <= 2.0**-7 * np.abs(x))
    # 1e5 in a tile scaled by 2: 50,000 rounds to 98 * 512 in E5M6's top binade.
    assert got[0, 7] == 2 * 98 * 512
    # The unscaled variant's rounding clips 1e5 at 65,024.
    assert np.asarray(round_to_e5m6(jnp.asarray(x)))[0, 7] == 65024.0


def test_cache_for_wgrad_per_cache_format():
    x = _heavy_rows(np.random.default_rng(5))[None, :2, :256]
    xj = jnp.asarray(x)
    site = recipes.for_site(recipes.deepseek_v3(), "attn_out")
    qx = fp8jax.quantize(xj, fp8jax.E4M3, "tile", axis=-1)
    np.testing.assert_array_equal(
        np.asarray(cache_for_wgrad(xj, qx, site), np.float64), ref_e5m6_tiles(x)
    )
    unscaled = recipes.for_site(variants.attn_out_e5m6_unscaled(), "attn_out")
    assert unscaled.x_cache == "e5m6_unscaled"
    np.testing.assert_array_equal(
        np.asarray(cache_for_wgrad(xj, qx, unscaled), np.float64), ref_round_e5m6(x)
    )
    # Elsewhere the FP8 operand itself is the residual.
    assert cache_for_wgrad(xj, qx, recipes.deepseek_v3()) is qx


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_1"])
def test_requantize_through_transpose_equals_in_place(name, use_jit):
    # Wgrad's 128-token tiles from the 1x128 FP8 cache: made through transposed
    # codes (what a CUDA GPU runs) or in place (elsewhere), the same codes and scales.
    from fp8jax.operands import quantize_operand, requantize, requantize_through_transpose

    recipe = fp8jax.registry.get(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256, 384)).astype(np.float32)
    x[0, :128, :128] *= 1e-30  # tiny tiles (the offset division)
    x[0, 130, 5] = 3e4  # an outlier
    cached, _ = quantize_operand(jnp.asarray(x), recipe.fprop.lhs, 2, recipe)

    def both(c):
        a = requantize(c, recipe.wgrad.lhs, 1, recipe, recipe.fprop.lhs)
        b = requantize_through_transpose(c, recipe.wgrad.lhs, 1, recipe)
        return a, b

    a, b = (jax.jit(both) if use_jit else both)(cached)
    assert a.layout == b.layout
    np.testing.assert_array_equal(
        np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


@pytest.mark.parametrize(
    "name", ["deepseek_v3", "deepseek_v3_1", "current_tensor", "rowwise", "mxfp8"]
)
def test_quantize_operand_twice_is_quantize_operand_per_axis(name):
    # An output gradient (B, M, N) for Dgrad (along N) and Wgrad (along M):
    # the same operands as two calls, whether or not one read serves both.
    recipe = fp8jax.registry.get(name)
    rng = np.random.default_rng(3)
    dy = jnp.asarray(rng.standard_normal((1, 256, 384)) * 1e-2, jnp.bfloat16)
    specs, axes = (recipe.dgrad.lhs, recipe.wgrad.rhs), (2, 1)
    got = quantize_operand_twice(dy, specs, axes, recipe)[:2]
    for q, spec, axis in zip(got, specs, axes):
        want, _ = quantize_operand(dy, spec, axis, recipe)
        for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        # One tensor scale serves both axes: Dgrad's operand is Wgrad's.
        assert q.layout.matches(want.layout)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_1", "current_tensor", "rowwise"])
def test_requantizable_where_requantize_takes_the_kernel(name):
    # The Wgrad's x: named as its cache exactly where requantize would run the
    # requantizing kernel on a TPU (DeepSeek-V3's 1x128 cache to 128-token
    # tiles), so a GEMM kernel that requantizes it itself gives the same bits.
    from fp8jax.operands import requantizable, requantize_kernel_fits

    recipe = fp8jax.registry.get(name)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 256, 384)), jnp.float32)
    cached, _ = quantize_operand(x, recipe.fprop.lhs, 2, recipe)
    src = requantizable(cached, recipe.wgrad.lhs, 1, recipe.fprop.lhs)
    fits = name.startswith("deepseek") and requantize_kernel_fits(cached, recipe.wgrad.lhs, 1)
    assert (src is not None) == fits == name.startswith("deepseek")
    if src is not None:
        assert src.spec == recipe.wgrad.lhs
        assert src.cached.scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(src.cached.data), np.asarray(cached.data))
    # Along the cache's own tile axis, or from an unquantized cache: nothing to requantize.
    assert requantizable(cached, recipe.wgrad.lhs, 2, recipe.fprop.lhs) is None
    assert requantizable(x, recipe.wgrad.lhs, 1, recipe.fprop.lhs) is None
