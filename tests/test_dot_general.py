import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import ref_linear_grads

import fp8jax
from fp8jax import scaling
from fp8jax.dot_general import dot_general, dot_general_with_stats

DN = (((2,), (1,)), ((0,), (0,)))  # canonical (B,M,K) x (B,K,N)
RECIPES = ["deepseek_v3", "current_tensor", "rowwise", "fp32", "bf16"]


def _inputs(b=2, m=130, k=200, n=72, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, m, k)).astype(np.float32)
    x[:, :, 3] *= 50.0  # an outlier channel
    w = (rng.standard_normal((b, k, n)) * 0.05).astype(np.float32)
    g = rng.standard_normal((b, m, n)).astype(np.float32)
    return x, w, g


def _run(recipe, x, w, g, jit, state=None):
    def f(x, w, state):
        y = dot_general(x, w, DN, recipe=recipe, state=state)
        return jnp.sum(y * g), y

    fn = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    if jit:
        fn = jax.jit(fn)
    (_, y), grads = fn(jnp.asarray(x), jnp.asarray(w), state)
    return y, grads


def _rel(a, b):
    a = np.asarray(a, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("jit", [False, True])
def test_forward_and_grads_match_reference(name, jit):
    recipe = fp8jax.registry.get(name)
    x, w, g = _inputs()
    y, (dx, dw, _) = _run(recipe, x, w, g, jit)
    ry, rdx, rdw = ref_linear_grads(x, w, g, recipe)
    # Quantized recipes: same quantization decisions as the reference, so the
    # only difference is float32 rounding of data*scale and f32 accumulation.
    # bf16: the reference is unquantized float64, so bf16 rounding remains.
    tol = 1e-2 if name == "bf16" else 2e-6
    assert y.dtype == jnp.float32 and dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    assert _rel(y, ry) < tol
    assert _rel(dx, rdx) < tol
    assert _rel(dw, rdw) < tol


def test_fp8_error_is_fp8_sized():
    x, w, g = _inputs(seed=3)
    y, (dx, dw, _) = _run(fp8jax.recipes.deepseek_v3(), x, w, g, True)
    ey = np.einsum("bmk,bkn->bmn", x.astype(np.float64), w)
    assert 1e-3 < _rel(y, ey) < 0.06


def test_hybrid_delayed_against_reference_and_state_update():
    recipe = fp8jax.recipes.hybrid_delayed(history_len=4)
    x, w, g = _inputs(m=64, k=96, n=40)
    st0 = scaling.init_delayed_gemm_state(recipe)
    # Give the state sensible scales first (one step), as training would.
    _, (_, _, st1) = _run(recipe, x, w, g, True, st0)
    np.testing.assert_allclose(float(st1.x.amax_history[0]), np.abs(x).max(), rtol=1e-6)
    np.testing.assert_allclose(float(st1.w.amax_history[0]), np.abs(w).max(), rtol=1e-6)
    np.testing.assert_allclose(float(st1.dy.amax_history[0]), np.abs(g).max(), rtol=1e-6)
    np.testing.assert_allclose(float(st1.dy.scale), np.abs(g).max() / 57344.0, rtol=1e-6)
    y, (dx, dw, st2) = _run(recipe, x, w, g, True, st1)

    def qdq(t, s, fmt):
        from reference import FMTS, ref_cast

        return ref_cast(t.astype(np.float32) / np.float32(s), FMTS[fmt]).astype(np.float64) * s

    sx, sw, sdy = float(st1.x.scale), float(st1.w.scale), float(st1.dy.scale)
    xq, wq, gq = qdq(x, sx, "e4m3"), qdq(w, sw, "e4m3"), qdq(g, sdy, "e5m2")
    assert _rel(y, np.einsum("bmk,bkn->bmn", xq, wq)) < 2e-6
    assert _rel(dx, np.einsum("bmn,bkn->bmk", gq, wq)) < 2e-6
    assert _rel(dw, np.einsum("bmk,bmn->bkn", xq, gq)) < 2e-6
    np.testing.assert_array_equal(np.asarray(st2.x.amax_history[1:]), st1.x.amax_history[:3])


def test_delayed_fresh_state_clips_first_step():
    recipe = fp8jax.recipes.hybrid_delayed()
    x = jnp.full((1, 4, 128), 1000.0)
    w = jnp.ones((1, 128, 8)) / 128
    st = scaling.init_delayed_gemm_state(recipe)
    y, stats = jax.jit(lambda x, w, st: dot_general_with_stats(x, w, DN, recipe=recipe, state=st))(
        x, w, st
    )
    # scale 1 on a fresh state: 1000 clips to 448.
    np.testing.assert_allclose(np.asarray(y), 448.0, rtol=1e-6)
    assert float(stats["x"]["saturated"]) == 1.0


def test_missing_state_is_a_clear_error():
    with pytest.raises(ValueError, match="delayed"):
        dot_general(
            jnp.ones((1, 2, 4)), jnp.ones((1, 4, 3)), DN, recipe=fp8jax.recipes.hybrid_delayed()
        )


def test_massive_activations_stats_and_tile_advantage():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256, 256)).astype(np.float32)
    x[0, 7, 11] = 1e5  # massive activation
    w = jnp.asarray(rng.standard_normal((1, 256, 64)).astype(np.float32) * 0.05)
    ref = np.einsum("bmk,bkn->bmn", x.astype(np.float64), np.asarray(w, np.float64))
    errs = {}
    for name in ["current_tensor", "deepseek_v3"]:
        f = jax.jit(
            lambda x, w, r=fp8jax.registry.get(name): dot_general_with_stats(  # noqa: B008
                x, w, DN, recipe=r
            )
        )
        y, st = f(jnp.asarray(x), w)
        per_tok = np.linalg.norm(np.asarray(y)[0] - ref[0], axis=-1) / np.linalg.norm(
            ref[0], axis=-1
        )
        errs[name] = np.median(per_tok)
        if name == "current_tensor":
            assert float(st["x"]["flushed"]) > 0.05  # the rest is pushed into underflow
    assert errs["deepseek_v3"] * 2 < errs["current_tensor"]


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dn",
    [
        ((6, 40), (40, 9), (((1,), (0,)), ((), ()))),
        ((40, 6), (9, 40), (((0,), (1,)), ((), ()))),  # both transposed
        ((3, 5, 40), (3, 40, 7), (((2,), (1,)), ((0,), (0,)))),  # batch dims
        ((5, 3, 8, 20), (8, 20, 3, 4), (((2, 3), (0, 1)), ((1,), (2,)))),  # 2 contracting dims
        ((2, 140), (140,), (((1,), (0,)), ((), ()))),  # matrix-vector
    ],
)
def test_any_dimension_numbers(lhs_shape, rhs_shape, dn):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal(lhs_shape).astype(np.float32))
    rhs = jnp.asarray(rng.standard_normal(rhs_shape).astype(np.float32))
    want = jax.lax.dot_general(lhs, rhs, dn, precision="highest")
    got32 = jax.jit(lambda a, b: dot_general(a, b, dn, recipe=fp8jax.recipes.fp32()))(lhs, rhs)
    assert got32.shape == want.shape
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-5)
    got8 = jax.jit(lambda a, b: dot_general(a, b, dn, recipe=fp8jax.recipes.deepseek_v3()))(
        lhs, rhs
    )
    assert got8.shape == want.shape
    assert _rel(got8, np.asarray(want, np.float64)) < 0.08
    g = jax.jit(
        jax.grad(
            lambda a, b: jnp.sum(dot_general(a, b, dn, recipe=fp8jax.recipes.deepseek_v3()) ** 2),
            (0, 1),
        )
    )(lhs, rhs)
    g_ref = jax.jit(
        jax.grad(
            lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dn, precision="highest") ** 2), (0, 1)
        )
    )(lhs, rhs)
    for a, b in zip(g, g_ref):
        assert a.shape == b.shape and _rel(a, np.asarray(b, np.float64)) < 0.1


def test_bad_dimension_numbers_error():
    with pytest.raises(TypeError):
        dot_general(
            jnp.ones((3, 4)),
            jnp.ones((5, 6)),
            (((1,), (0,)), ((), ())),
            recipe=fp8jax.recipes.deepseek_v3(),
        )


def test_dtypes_bf16_in_bf16_out():
    x = jnp.ones((4, 256), jnp.bfloat16)
    w = jnp.ones((256, 8), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    r = fp8jax.recipes.deepseek_v3()
    assert jax.eval_shape(lambda a, b: dot_general(a, b, dn, recipe=r), x, w).dtype == jnp.bfloat16
    f32 = jax.eval_shape(
        lambda a, b: dot_general(a, b, dn, recipe=r, preferred_element_type=jnp.float32), x, w
    )
    assert f32.dtype == jnp.float32
    gx, gw = jax.jit(
        jax.grad(lambda a, b: jnp.sum(dot_general(a, b, dn, recipe=r).astype(jnp.float32)), (0, 1))
    )(x, w)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16


def test_vmap_scan_checkpoint_consistent():
    r = fp8jax.recipes.deepseek_v3()
    dn = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((3, 8, 256)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((256, 16)).astype(np.float32))
    loop = jax.jit(
        lambda xs, w: jnp.stack([dot_general(xs[i], w, dn, recipe=r) for i in range(3)])
    )(xs, w)
    vm = jax.jit(jax.vmap(lambda x, w: dot_general(x, w, dn, recipe=r), (0, None)))(xs, w)
    np.testing.assert_allclose(vm, loop, rtol=1e-6)

    def scanned(w):
        def body(c, x):
            return c + jnp.sum(dot_general(x, w, dn, recipe=r)), None

        return jax.lax.scan(body, 0.0, xs)[0]

    def remat(w):
        f = jax.checkpoint(lambda x, w: jnp.sum(dot_general(x, w, dn, recipe=r)))
        return sum(f(xs[i], w) for i in range(3))

    g1 = jax.jit(jax.grad(scanned))(w)
    g2 = jax.jit(jax.grad(remat))(w)
    g3 = jax.jit(
        jax.grad(lambda w: sum(jnp.sum(dot_general(xs[i], w, dn, recipe=r)) for i in range(3)))
    )(w)
    assert np.abs(np.asarray(g3)).max() > 0
    np.testing.assert_allclose(g1, g3, rtol=1e-5)
    np.testing.assert_allclose(g2, g3, rtol=1e-5)


def test_residuals_are_fp8():
    r = fp8jax.recipes.deepseek_v3()
    dn = (((1,), (0,)), ((), ()))
    x = jnp.ones((256, 256))
    w = jnp.ones((256, 256))
    _, vjp = jax.vjp(lambda x, w: dot_general(x, w, dn, recipe=r), x, w)
    leaves = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "dtype")]
    big = [leaf for leaf in leaves if leaf.size >= 256 * 256]
    assert big and all(leaf.dtype == fp8jax.E4M3 for leaf in big)


def test_accumulation_emulation_switch():
    r = fp8jax.recipes.deepseek_v3(accumulation=fp8jax.Accumulation())
    x, w, g = _inputs(b=1, m=8, k=256, n=8)
    y, (dx, dw, _) = _run(r, x, w, g, True)
    y0, (dx0, dw0, _) = _run(fp8jax.recipes.deepseek_v3(), x, w, g, True)
    for a, b in [(y, y0), (dx, dx0), (dw, dw0)]:
        assert 0 < _rel(a, np.asarray(b, np.float64)) < 5e-3


def test_dequant_bf16_exact_for_pow2_scales():
    base = fp8jax.recipes.deepseek_v3(pow2=True)
    x, w, g = _inputs(b=1, m=32, k=256, n=16)
    y32, _ = _run(base, x, w, g, True)
    y16, _ = _run(dataclasses.replace(base, dequant_dtype="bfloat16"), x, w, g, True)
    np.testing.assert_allclose(y16, y32, rtol=1e-5, atol=1e-5)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["deepseek_v3", "current_tensor", "rowwise"]),
    m=st.sampled_from([1, 5, 130]),
    k=st.sampled_from([3, 128, 200]),
    special=st.lists(st.sampled_from([0.0, 448.0, -448.0, 1e-30, 2.0**-9, 1e6, -1e6]), max_size=6),
    seed=st.integers(0, 1000),
)
def test_finite_inputs_never_nan(name, m, k, special, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, m, k)).astype(np.float32)
    for v in special:
        x[0, rng.integers(m), rng.integers(k)] = v
    w = rng.standard_normal((1, k, 9)).astype(np.float32)
    y, (dx, dw, _) = _run(fp8jax.registry.get(name), x, w, np.ones((1, m, 9), np.float32), True)
    for a in (y, dx, dw):
        assert not np.any(np.isnan(np.asarray(a)))


@pytest.mark.parametrize("name", ["deepseek_v3", "current_tensor"])
def test_prequantized_weight_goes_in_with_its_codes(name):
    # A weight quantized before the call (as an FP8 gather delivers it) gives
    # the result of quantizing inside, bit for bit, and its gradient is the
    # gradient of the values it represents (zero for its scales).
    recipe = fp8jax.registry.get(name)
    x, w, g = (t[0] for t in _inputs())
    dn = (((1,), (0,)), ((), ()))
    qw = fp8jax.schemes.quantize(jnp.asarray(w), recipe.fprop.rhs, 0)

    def run(w_in):
        y, vjp = jax.vjp(lambda x, w: dot_general(x, w, dn, recipe=recipe), jnp.asarray(x), w_in)
        return (y, *vjp(jnp.asarray(g)))

    # Like with like: XLA may sum a run in another float32 order under jit.
    y, dx, dw = jax.jit(run)(jnp.asarray(w))
    yq, dxq, dwq = jax.jit(run)(qw)
    y_eager, dx_eager, _ = run(qw)
    y0, dx0, _ = run(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(yq), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(y_eager), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(dxq), np.asarray(dx))
    np.testing.assert_array_equal(np.asarray(dx_eager), np.asarray(dx0))
    assert isinstance(dwq, fp8jax.QTensor)
    np.testing.assert_array_equal(np.asarray(dwq.data), np.asarray(dw))
    assert not np.any(np.asarray(dwq.scale))


def test_prequantized_operand_must_match_its_spec():
    recipe = fp8jax.recipes.deepseek_v3()
    x, w, _ = (t[0] for t in _inputs())
    # Tiles where the recipe wants 128x128 blocks: refused, not re-quantized.
    qw = fp8jax.quantize(jnp.asarray(w), fp8jax.E4M3, "tile", axis=0)
    with pytest.raises(ValueError, match="pre-quantized operand"):
        dot_general(jnp.asarray(x), qw, (((1,), (0,)), ((), ())), recipe=recipe)
    qwt = fp8jax.schemes.quantize(jnp.asarray(w.T), recipe.fprop.rhs, 1)
    with pytest.raises(ValueError, match="order the GEMM reads it"):
        dot_general(jnp.asarray(x), qwt, (((1,), (1,)), ((), ())), recipe=recipe)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shapes", [((0, 8), (8, 3)), ((4, 0), (0, 3)), ((4, 8), (8, 0))])
def test_zero_size_delayed_gemm_keeps_the_state(jit, shapes):
    # A zero-size operand observes no amax: the updated state is the old one
    # (it used to be all zeros, scale 0, which gives NaN at the next step).
    recipe = fp8jax.recipes.hybrid_delayed(history_len=3)
    st = scaling.init_delayed_gemm_state(recipe)
    st = jax.tree.map(lambda a: a * 0 + 0.25, st)  # not the fresh state: scale 0.25
    dn = (((1,), (0,)), ((), ()))
    x, w = jnp.ones(shapes[0]), jnp.ones(shapes[1])
    loss = lambda x, w, s: dot_general(x, w, dn, recipe=recipe, state=s).sum()  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    gx, gw, new = (jax.jit(grad) if jit else grad)(x, w, st)
    assert gx.shape == x.shape and gw.shape == w.shape
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(st)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_1", "mxfp8", "nvfp4", "rowwise"])
@pytest.mark.parametrize("jit", [False, True])
def test_forward_is_the_quantized_operands_gemm_for_every_scheme(name, jit):
    # The Fprop takes x's operand and runs the GEMM core on it (on a TPU one
    # kernel may do both, the same bits): here, exactly take_operand then gemm,
    # for the FP8 tiles and the block formats alike.
    from fp8jax.gemm import gemm
    from fp8jax.operands import take_operand

    recipe = fp8jax.registry.get(name)
    x, w, _ = _inputs(b=1, m=64, k=256, n=128, seed=4)

    def both(x, w):
        y = dot_general(x, w, DN, recipe=recipe)
        qx, _ = take_operand(x, recipe.fprop.lhs, 2, recipe)
        qw, _ = take_operand(w, recipe.fprop.rhs, 1, recipe)
        return y, gemm(qx, qw, "fprop", recipe, out_dtype=y.dtype)

    y, want = (jax.jit(both) if jit else both)(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(y).view(np.uint32), np.asarray(want).view(np.uint32))
