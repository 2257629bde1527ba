"""MXFP8 / NVFP4 recipes through dot_general and the grouped GEMM: Fprop, Dgrad and
Wgrad against a float64 product of the same quantization (tests/reference_microscaling.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference_microscaling as ref

import fp8jax
from fp8jax import blockscaled, recipes, registry
from fp8jax.grouped import grouped_dot
from fp8jax.groups import group_layout, to_tiles
from fp8jax.registry import get as get_recipe

E4M3 = ml_dtypes.float8_e4m3fn
DN = (((1,), (0,)), ((), ()))


def _deq(x, spec, axis, bits=None):
    """float64 dequantized reference quantization of x per a block-format spec."""
    two_d = spec.granularity == "block"
    if spec.fmt == "mxfp8":
        out = ref.mx_quantize(x, E4M3, axis, 32, two_d, bits, spec.scale_rounding)
        return out[2].astype(np.float64)
    return ref.nvfp4_quantize(x, axis, 16, two_d, bits)[3].astype(np.float64)


def _sr_bits(recipe, salt, t):
    """The uint32 bits the library draws for a stochastic operand ``t`` (its key rule)."""
    key = blockscaled.operand_key(recipe.seed, salt, jnp.asarray(t))
    return np.asarray(jax.random.bits(key, t.shape, jnp.uint32))


def _signs(recipe):
    return np.asarray(fp8jax.hadamard.random_signs(recipe.seed))


def dense_reference(recipe, x, w, dy):
    """(y, dx, dw) in float64 for y = x @ w with x (M, K), w (K, N), dy (M, N)."""
    f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad
    y = _deq(x, f.lhs, 1) @ _deq(w, f.rhs, 0)
    # Dgrad: w's 16x16 blocks are reused; 1-d runs are re-quantized along N
    # from the dequantized Fprop copy (the cached operand).
    w_d = (
        _deq(w, f.rhs, 0)
        if d.rhs.granularity == "block"
        else _deq(_deq(w, f.rhs, 0).astype(np.float32), d.rhs, 1)
    )
    bits = _sr_bits(recipe, 32, dy[None])[0] if d.lhs.stochastic else None
    dx = _deq(dy, d.lhs, 1, bits) @ w_d.T
    # Wgrad over the tokens, from x itself; RHT along the tokens on both sides.
    xw, dyw = x, dy
    if g.lhs.hadamard:
        xw, dyw = ref.rht(x, _signs(recipe), 0), ref.rht(dy, _signs(recipe), 0)
    bits = _sr_bits(recipe, 31, dyw[None])[0] if g.rhs.stochastic else None
    dw = _deq(xw, g.lhs, 0).T @ _deq(dyw, g.rhs, 0, bits)
    return y, dx, dw


RECIPES = ["mxfp8", "mxfp8_ceil", "nvfp4", "nvfp4_rtn", "nvfp4_no_rht", "nvfp4_1d"]


def _recipe(name):
    if name == "nvfp4_1d":
        return dataclasses.replace(recipes.nvfp4(weight_2d=False), name="nvfp4_1d")
    return get_recipe(name)


def _close(got, want, tol=2e-5):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", RECIPES)
def test_dense_fprop_dgrad_wgrad_match_float64_reference(name, jit):
    recipe = _recipe(name)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 70)) * np.exp(rng.standard_normal((37, 1)))).astype(np.float32)
    x[3, 5] = 40.0  # an outlier
    w = (rng.standard_normal((70, 45)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((37, 45)) * 1e-3).astype(np.float32)

    def f(x, w):
        return fp8jax.dot_general(x, w, DN, recipe=recipe)

    fn = jax.jit(lambda x, w, dy: jax.vjp(f, x, w)[1](dy) + (f(x, w),)) if jit else None
    if jit:
        dx, dw, y = fn(x, w, dy)
    else:
        y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
        dx, dw = vjp(jnp.asarray(dy))
    y_r, dx_r, dw_r = dense_reference(recipe, x, w, dy)
    assert y.dtype == jnp.float32
    _close(y, y_r)
    _close(dx, dx_r)
    _close(dw, dw_r)
    # The quantization is doing something: far from the unquantized product.
    assert np.linalg.norm(np.asarray(y) - x @ w) > 1e-3 * np.linalg.norm(x @ w)


def test_dense_batched_dimension_numbers():
    # Batch dims and a 3-d contraction layout reach the same block quantization.
    recipe = recipes.mxfp8()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 33, 40)).astype(np.float32)
    w = rng.standard_normal((2, 40, 7)).astype(np.float32)
    dn = (((2,), (1,)), ((0,), (0,)))
    y = fp8jax.dot_general(x, w, dn, recipe=recipe)
    for b in range(2):
        want = _deq(x[b], recipe.fprop.lhs, 1) @ _deq(w[b], recipe.fprop.rhs, 0)
        _close(y[b], want)


def grouped_reference(recipe, x, w, gs, dy):
    """(y, dx, dw) in float64 of the grouped GEMM (rows sorted by expert)."""
    f, d, g = recipe.fprop, recipe.dgrad, recipe.wgrad
    ends = np.cumsum(gs)
    starts = ends - gs
    # Fprop / Dgrad quantize all rows at once (one NVFP4 tensor scale) and all
    # experts' weights at once.
    qx = _deq(x, f.lhs, 1)
    qw = _deq_experts(w, f.rhs, 1)
    bits = _sr_bits(recipe, 21, dy) if d.lhs.stochastic else None
    qdy = _deq(dy, d.lhs, 1, bits)
    w_d = qw if d.rhs.granularity == "block" else _deq_experts(qw.astype(np.float32), d.rhs, 2)
    y = np.zeros((x.shape[0], w.shape[2]))
    dx = np.zeros(x.shape)
    for e in range(len(gs)):
        rows = slice(starts[e], ends[e])
        y[rows] = qx[rows] @ qw[e]
        dx[rows] = qdy[rows] @ w_d[e].T
    # Wgrad in the library's expert-aligned tiles of one block of rows (zero padding).
    layout = group_layout(jnp.asarray(gs), x.shape[0], g.lhs.tile)
    xt = np.asarray(to_tiles(jnp.asarray(x), layout))
    dyt = np.asarray(to_tiles(jnp.asarray(dy), layout))
    if g.lhs.hadamard:
        xt, dyt = ref.rht(xt, _signs(recipe), 1), ref.rht(dyt, _signs(recipe), 1)
    bits = _sr_bits(recipe, 31, dyt) if g.rhs.stochastic else None
    qxt, qdyt = _deq(xt, g.lhs, 1), _deq(dyt, g.rhs, 1, bits)
    tile_group = np.asarray(layout.tile_group)
    dw = np.zeros(w.shape)
    for t, e in enumerate(tile_group):
        if e >= 0:
            dw[e] += qxt[t].T @ qdyt[t]
    return y, dx, dw


def _deq_experts(w, spec, axis):
    """Reference quantization of all experts' weights as one tensor (E, K, N)."""
    two_d = spec.granularity == "block"
    if spec.fmt == "mxfp8":
        out = ref.mx_quantize(w, E4M3, axis, 32, two_d, None, spec.scale_rounding)
        return out[2].astype(np.float64)
    return ref.nvfp4_quantize(w, axis, 16, two_d)[3].astype(np.float64)


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8_ceil", "nvfp4", "nvfp4_1d"])
def test_grouped_fprop_dgrad_wgrad_match_float64_reference(name):
    recipe = _recipe(name)
    rng = np.random.default_rng(2)
    gs = np.array([5, 0, 21, 9], np.int32)
    m = 40  # 5 rows past the groups: output 0, gradient 0
    x = rng.standard_normal((m, 48)).astype(np.float32)
    w = (rng.standard_normal((4, 48, 20)) * 0.1).astype(np.float32)
    dy = (rng.standard_normal((m, 20)) * 1e-2).astype(np.float32)

    def f(x, w):
        return grouped_dot(x, w, jnp.asarray(gs), recipe=recipe)

    dy[gs.sum() :] = 0  # rows in no group receive no gradient
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    y_r, dx_r, dw_r = grouped_reference(recipe, x, w, gs, dy)
    _close(y, y_r)
    _close(dx, dx_r)
    _close(dw, dw_r)
    assert np.all(np.asarray(y)[gs.sum() :] == 0) and np.all(np.asarray(dx)[gs.sum() :] == 0)


def test_stochastic_rounding_reproducible_and_step_dependent():
    recipe = recipes.nvfp4()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 16)) * 0.1, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)

    def grads(dy):
        return jax.vjp(lambda x, w: fp8jax.dot_general(x, w, DN, recipe=recipe), x, w)[1](dy)

    a, b = grads(dy), grads(dy)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    # A different gradient draws differently (not just scaled): dx(2 dy) != 2 dx(dy).
    c = grads(2 * dy)
    assert not np.allclose(np.asarray(c[0]), 2 * np.asarray(a[0]))
    # Another seed, other draws.
    other = dataclasses.replace(recipe, seed=1)
    d = jax.vjp(lambda x, w: fp8jax.dot_general(x, w, DN, recipe=other), x, w)[1](dy)
    assert not np.array_equal(np.asarray(d[0]), np.asarray(a[0]))


def test_recipe_presets_and_validation():
    r = recipes.nvfp4()
    assert r.wgrad.lhs.hadamard and r.wgrad.rhs.hadamard and not r.fprop.lhs.hadamard
    assert r.dgrad.lhs.stochastic and r.wgrad.rhs.stochastic and not r.fprop.lhs.stochastic
    assert r.fprop.rhs.granularity == "block" and r.fprop.rhs.tile == 16
    assert registry.get("mxfp8").fprop.lhs == fp8jax.QuantSpec("mxfp8", "tile", 32)
    for name in ("nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_rtn"):
        assert get_recipe(name).name == name
    with pytest.raises(ValueError, match="tile=16"):
        fp8jax.QuantSpec("nvfp4", "tile", 32)
    with pytest.raises(ValueError, match="1x32 runs only"):
        fp8jax.QuantSpec("mxfp8", "block", 32)
    with pytest.raises(ValueError, match="own online scales"):
        fp8jax.QuantSpec("nvfp4", "tile", 16, pow2=True)
    with pytest.raises(ValueError, match="block formats"):
        fp8jax.QuantSpec("e4m3", "tile", 128, stochastic=True)
    x, w = jnp.ones((4, 32)), jnp.ones((32, 8))
    with pytest.raises(ValueError, match="not 'chunked'"):
        fp8jax.dot_general(x, w, DN, recipe=dataclasses.replace(recipes.mxfp8(), impl="chunked"))
    mixed = dataclasses.replace(
        recipes.mxfp8(), fprop=fp8jax.GemmSpec(recipes.mxfp8().fprop.lhs, fp8jax.QuantSpec())
    )
    with pytest.raises(ValueError, match="mixes schemes"):
        fp8jax.dot_general(x, w, DN, recipe=mixed)
