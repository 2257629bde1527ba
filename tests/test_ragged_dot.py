"""fp8jax.ragged_dot: lax.ragged_dot's signature, a float64 per-group reference, the standard op
for unquantized recipes, zero-size operands and bad group sizes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_grouped as tg
from jax import lax

import fp8jax
from fp8jax.grouped import grouped_dot

FAST = {"xla_backend_optimization_level": 0}


def _grads(fn, x, w, dy, jit: bool):
    """y, dx, dw of ``fn(x, w)`` against the cotangent ``dy``, jitted or eager."""

    def run(x, w):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(jnp.asarray(dy, y.dtype)))

    run = jax.jit(run, compiler_options=FAST) if jit else run
    return [np.asarray(a) for a in run(jnp.asarray(x), jnp.asarray(w))]


# Group 0 spans two 128-row Wgrad tiles, group 1 is empty, the last 7 rows
# belong to no group; K spans two 1x128 tiles.
GROUPS = np.array([131, 0, 40, 3], np.int32)
M, K, N = 181, 160, 24


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    # Columns of very different magnitudes make per-tile scales matter.
    x *= np.exp(rng.uniform(-3, 3, (1, K))).astype(np.float32)
    w = (rng.standard_normal((len(GROUPS), K, N)) / np.sqrt(K)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, dy


def _standard_reference(x, w, dy):
    """float64 y, dx, dw of lax.ragged_dot on bfloat16 operands under JAX's autodiff.

    The operands are rounded to bfloat16, the incoming gradient is not (the
    output is float32), and dx, dw are rounded once to bfloat16 at the end
    (the cotangents of the bfloat16 casts).
    """
    xb, wb = tg._bf16(x), tg._bf16(w)
    dy = dy.astype(np.float64)
    y, dx, dw = np.zeros(dy.shape), np.zeros(x.shape), np.zeros(w.shape)
    off = 0
    for e, g in enumerate(GROUPS):
        r = slice(off, off + int(g))
        y[r], dx[r], dw[e] = xb[r] @ wb[e], dy[r] @ wb[e].T, xb[r].T @ dy[r]
        off += int(g)
    return y, dx, dw


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("name", ["deepseek_v3", "bf16"])
def test_matches_float64_per_group_reference(name, jit):
    recipe = fp8jax.registry.get(name)
    x, w, dy = _inputs(5)
    gs = jnp.asarray(GROUPS)
    fn = lambda x, w: fp8jax.ragged_dot(x, w, gs, recipe=recipe, preferred_element_type=jnp.float32)
    y, dx, dw = _grads(fn, x, w, dy, jit)
    if recipe.is_fp8:
        ry, rdx, rdw = tg.reference(x, w, dy, GROUPS, recipe)
        for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
            assert tg._relerr(got, want) < 1e-5
    else:
        ry, rdx, rdw = _standard_reference(x, w, dy)
        assert tg._relerr(y, ry) < 1e-6
        # Gradients: float32 sums, one rounding to bfloat16 (2^-8 relative).
        for got, want in ((dx, rdx), (dw, rdw)):
            err = np.abs(got - want)
            assert np.all(err <= 2.0**-8 * np.abs(want) + 1e-6 * np.abs(want).max())
    # Rows past sum(group_sizes) and the empty group: zeros, as lax.ragged_dot.
    assert np.all(y[GROUPS.sum() :] == 0) and np.all(dw[1] == 0)


@pytest.mark.parametrize("jit", [True, False])
def test_unquantized_recipe_is_the_standard_op_bit_for_bit(jit):
    """bf16: lax.ragged_dot on bfloat16 operands, float32 accumulation, gradients by JAX."""
    x, w, dy = _inputs(6)
    gs = jnp.asarray(GROUPS)
    bf = jnp.bfloat16
    ours = lambda x, w: fp8jax.ragged_dot(x, w, gs, recipe=fp8jax.recipes.bf16())
    std = lambda x, w: lax.ragged_dot(
        x.astype(bf),
        w.astype(bf),
        gs,
        precision=fp8jax.gemm.dot_algorithm(bf),
        preferred_element_type=jnp.float32,
    ).astype(jnp.float32)
    for a, b in zip(_grads(ours, x, w, dy, jit), _grads(std, x, w, dy, jit)):
        np.testing.assert_array_equal(a, b)


def test_quantized_recipe_is_the_grouped_core_bit_for_bit():
    x, w, dy = _inputs(7)
    gs = jnp.asarray(GROUPS)
    r = fp8jax.recipes.deepseek_v3()
    ours = lambda x, w: fp8jax.ragged_dot(x, w, gs, recipe=r)
    core = lambda x, w: grouped_dot(x, w, gs, recipe=r)
    for a, b in zip(_grads(ours, x, w, dy, True), _grads(core, x, w, dy, True)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("jit", [False, True])
def test_prequantized_weights_go_in_with_their_codes(jit):
    # Expert weights quantized before the call (an FP8 FSDP gather) give the
    # product of quantizing inside, bit for bit; their gradient is the
    # float32 gradient of the values they represent, in the codes' place.
    x, w, dy = _inputs(8)
    gs = jnp.asarray(GROUPS)
    r = fp8jax.recipes.deepseek_v3()
    qw = fp8jax.schemes.quantize(jnp.asarray(w), r.fprop.rhs, 1)

    def run(w_in):
        y, vjp = jax.vjp(lambda x, w: fp8jax.ragged_dot(x, w, gs, recipe=r), jnp.asarray(x), w_in)
        return (y, *vjp(jnp.asarray(dy)))

    run = jax.jit(run) if jit else run
    y, dx, dw = run(jnp.asarray(w))
    yq, dxq, dwq = run(qw)
    np.testing.assert_array_equal(np.asarray(yq), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dxq), np.asarray(dx))
    assert isinstance(dwq, fp8jax.QTensor) and dwq.data.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dwq.data), np.asarray(dw))
    assert not np.any(np.asarray(dwq.scale))


def test_signature_and_output_dtype_follow_lax():
    x = jnp.ones((6, 4), jnp.bfloat16)
    w = jnp.ones((2, 4, 3), jnp.bfloat16)
    gs = jnp.array([3, 2], jnp.int32)
    r = fp8jax.recipes.deepseek_v3()
    assert fp8jax.ragged_dot(x, w, gs, recipe=r).dtype == jnp.bfloat16
    y = fp8jax.ragged_dot(x, w, gs, recipe=r, preferred_element_type=jnp.float32, precision=None)
    assert y.dtype == jnp.float32 and y.shape == (6, 3)
    r = fp8jax.recipes.bf16()
    assert fp8jax.ragged_dot(x, w, gs, recipe=r).dtype == jnp.bfloat16
    with pytest.raises(NotImplementedError, match="group_offset"):
        fp8jax.ragged_dot(x, w, gs, recipe=r, group_offset=jnp.array([0]))
    with pytest.raises(ValueError, match="contraction"):
        fp8jax.ragged_dot(x, jnp.ones((2, 5, 3)), gs, recipe=r)
    with pytest.raises(ValueError, match="group_sizes"):
        fp8jax.ragged_dot(x, w, jnp.array([6]), recipe=r)
    with pytest.raises(TypeError, match="integer"):
        fp8jax.ragged_dot(x, w, jnp.array([3.0, 2.0]), recipe=r)


ALL = ["deepseek_v3", "hybrid_delayed", "mxfp8", "bf16"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(5, 0, 4), (0, 3, 4), (5, 3, 0)])
def test_zero_size_operands_give_what_lax_gives(name, shape):
    m, k, n = shape
    gs = jnp.array([2, 1], jnp.int32) if m else jnp.array([0, 0], jnp.int32)
    x, w = jnp.ones((m, k)), jnp.ones((2, k, n))
    recipe = fp8jax.registry.get(name)
    state = fp8jax.scaling.init_delayed_gemm_state(recipe) if fp8jax.needs_state(recipe) else None
    want = np.asarray(lax.ragged_dot(x, w, gs))
    for fn in (fp8jax.ragged_dot, grouped_dot):
        got = fn(x, w, gs, recipe=recipe, state=state)
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        # Differentiable: zero-size gradients or zeros.
        loss = lambda x, w, fn=fn: fn(x, w, gs, recipe=recipe, state=state).sum()
        dx, dw = jax.grad(loss, (0, 1))(x, w)
        assert dx.shape == x.shape and not np.any(np.asarray(dw))


@pytest.mark.parametrize("bad", [[-1, 3], [4, 3], [2**31 - 1, 2**31 - 1]])
def test_bad_group_sizes_are_refused(bad):
    x, w = jnp.ones((5, 3)), jnp.ones((2, 3, 4))
    gs = jnp.array(bad, jnp.int32)
    for name in ("deepseek_v3", "bf16"):
        r = fp8jax.registry.get(name)
        with pytest.raises(ValueError, match="group_sizes"):
            fp8jax.ragged_dot(x, w, gs, recipe=r)
        with pytest.raises(ValueError, match="group_sizes"):
            grouped_dot(x, w, gs, recipe=r)
    # Traced sizes cannot raise: the product is NaN, never silently wrong.
    run = jax.jit(lambda g: fp8jax.ragged_dot(x, w, g, recipe=fp8jax.recipes.bf16()))
    assert np.all(np.isnan(np.asarray(run(gs))))
    assert np.all(np.isfinite(np.asarray(run(jnp.array([2, 3], jnp.int32)))))


def test_integer_operands_are_refused():
    # As dot_general and einsum refuse them: no silent float result of int inputs.
    x = jnp.ones((4, 8), jnp.int32)
    w = jnp.ones((2, 8, 3), jnp.float32)
    gs = jnp.asarray([2, 2], jnp.int32)
    for lhs, rhs in ((x, w), (x.astype(jnp.float32), w.astype(jnp.int32))):
        with pytest.raises(TypeError, match="floating operands"):
            fp8jax.ragged_dot(lhs, rhs, gs, recipe=fp8jax.recipes.bf16())
        with pytest.raises(TypeError, match="floating operands"):
            fp8jax.interop.ragged_dot("deepseek_v3")(lhs, rhs, gs)
