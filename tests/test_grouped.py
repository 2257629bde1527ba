"""Grouped expert GEMM vs an independent per-expert float64 loop reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference as ref

import fp8jax
from fp8jax.dot_general import dot_general
from fp8jax.grouped import grouped_dot

M, K, N = 300, 200, 160
# Expert 1 gets no token, expert 0 spans two 128-row wgrad tiles (128 + 2),
# and the last 27 rows belong to no expert.
GROUPS = np.array([130, 0, 100, 3, 40], np.int32)
E = len(GROUPS)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    # Columns with very different magnitudes make per-tile scales matter.
    x *= np.exp(rng.uniform(-3, 3, (1, K))).astype(np.float32)
    w = (rng.standard_normal((E, K, N)) / np.sqrt(K)).astype(np.float32)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    return x, w, dy


def _bf16(a):
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _qdq(t, spec, caxis, groups=None):
    """Quantize-dequantize ``t`` per spec; returns (float64 value, float32 value)."""
    if spec.fmt is None:
        v = _bf16(t)
        return v, v.astype(np.float32)
    groups = (
        groups
        if groups is not None
        else ref.groups_for(t.shape, spec.granularity, caxis, spec.tile)
    )
    data, s = ref.ref_quantize_groups(t, groups, ref.FMTS[spec.fmt], spec.pow2, spec.amax_floor)
    # The float32 product is what a dequantized FP8 cache holds.
    return data.astype(np.float64) * s, data.astype(np.float32) * s.astype(np.float32)


def _token_groups(shape, spec, gs):
    """Scale groups of a wgrad operand: along tokens, within each expert's rows."""
    if spec.granularity == "tensor":
        return ref.groups_for(shape, "tensor", 0)
    out, off = [], 0
    for g in gs:
        for grp in ref.groups_for((int(g), shape[1]), spec.granularity, 0, spec.tile):
            rows, cols = grp
            start, stop, _ = rows.indices(int(g))
            out.append((slice(off + start, off + stop), cols))
        off += int(g)
    return out


def reference(x, w, dy, gs, recipe):
    """y, dx, dw of the grouped GEMM, one expert at a time, float64."""
    f, d, wg = recipe.fprop, recipe.dgrad, recipe.wgrad
    xq, xq32 = _qdq(x, f.lhs, 1)
    wq, wq32 = _qdq(w, f.rhs, 1)
    dyq, _ = _qdq(dy, d.lhs, 1)
    if d.rhs == f.rhs and d.rhs.granularity in ("tensor", "block"):
        wd = wq
    else:
        wd, _ = _qdq(wq32, d.rhs, 2)
    if wg.lhs == f.lhs and wg.lhs.granularity == "tensor":
        xw = xq
    elif wg.lhs.fmt is None:
        xw = _bf16(xq32)
    else:
        xw, _ = _qdq(xq32, wg.lhs, 0, _token_groups(x.shape, wg.lhs, gs))
    if wg.rhs.fmt is None:
        dyw = _bf16(dy)
    else:
        dyw, _ = _qdq(dy, wg.rhs, 0, _token_groups(dy.shape, wg.rhs, gs))
    y = np.zeros(dy.shape)
    dx = np.zeros(x.shape)
    dw = np.zeros(w.shape)
    off = 0
    for e, g in enumerate(gs):
        r = slice(off, off + int(g))
        y[r] = xq[r] @ wq[e]
        dx[r] = dyq[r] @ wd[e].T
        dw[e] = xw[r].T @ dyw[r]
        off += int(g)
    return y, dx, dw


def _run(x, w, dy, gs, recipe, state=None):
    def f(x, w, state):
        y = grouped_dot(x, w, gs, recipe=recipe, state=state, preferred_element_type=jnp.float32)
        return jnp.sum(y * dy), y

    grad_fn = jax.value_and_grad(f, (0, 1, 2), has_aux=True)
    # Small test programs: XLA's backend optimizations cost more time than they save.
    fast = {"xla_backend_optimization_level": 0}
    (_, y), (dx, dw, dstate) = jax.jit(grad_fn, compiler_options=fast)(
        jnp.asarray(x), jnp.asarray(w), state
    )
    return np.asarray(y), np.asarray(dx), np.asarray(dw), dstate


def _relerr(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def _froberr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["deepseek_v3", "current_tensor", "rowwise", "bf16"])
def test_matches_per_expert_reference(name):
    recipe = fp8jax.registry.get(name)
    x, w, dy = _inputs()
    gs = jnp.asarray(GROUPS)
    y, dx, dw, _ = _run(x, w, dy, gs, recipe)
    ry, rdx, rdw = reference(x, w, dy, GROUPS, recipe)
    # Same quantized values; only float32 accumulation order differs.
    assert _relerr(y, ry) < 1e-5
    assert _relerr(dx, rdx) < 1e-5
    assert _relerr(dw, rdw) < 1e-5
    # Expert 1 received no token: zero weight gradient; unassigned rows: zero.
    assert np.all(dw[1] == 0)
    assert np.all(y[GROUPS.sum() :] == 0) and np.all(dx[GROUPS.sum() :] == 0)


def test_deepseek_close_to_exact_and_pow2():
    x, w, dy = _inputs(1)
    gs = jnp.asarray(GROUPS)
    recipe = fp8jax.recipes.deepseek_v3(pow2=True)
    y, dx, dw, _ = _run(x, w, dy, gs, recipe)
    ry, rdx, rdw = reference(x, w, dy, GROUPS, recipe)
    assert _relerr(y, ry) < 1e-5 and _relerr(dx, rdx) < 1e-5 and _relerr(dw, rdw) < 1e-5
    # And within FP8 error of the unquantized product.
    ey, edx, edw = reference(x, w, dy, GROUPS, fp8jax.recipes.fp32())
    assert _froberr(y, ey) < 0.05 and _froberr(dx, edx) < 0.05 and _froberr(dw, edw) < 0.05


def test_wgrad_tiles_do_not_straddle_experts():
    """A tile shared by two experts would give the small expert the big one's scale."""
    x, w, dy = _inputs(2)
    gs_np = np.array([5, 123, 0, 100, 72], np.int32)
    # Expert 0's tokens are tiny: with a straddling tile they would flush to zero.
    x[:5] *= 1e-6
    recipe = fp8jax.recipes.deepseek_v3()
    _, _, dw, _ = _run(x, w, dy, jnp.asarray(gs_np), recipe)
    exact = x[:5].astype(np.float64).T @ dy[:5].astype(np.float64)
    assert _froberr(dw[0], exact) < 0.1


def test_delayed_state_gradient_is_updated_state():
    recipe = fp8jax.recipes.hybrid_delayed()
    x, w, dy = _inputs(3)
    x = x / np.abs(x).max()  # inside E4M3 range at the fresh scale of 1
    gs = jnp.asarray(GROUPS)
    st = fp8jax.scaling.init_delayed_gemm_state(recipe)
    y, dx, dw, new = _run(x, w, dy, gs, recipe, st)
    np.testing.assert_allclose(float(new.x.amax_history[0]), np.abs(x).max(), rtol=1e-6)
    np.testing.assert_allclose(float(new.w.amax_history[0]), np.abs(w).max(), rtol=1e-6)
    np.testing.assert_allclose(float(new.dy.amax_history[0]), np.abs(dy).max(), rtol=1e-6)
    ey, _, _ = reference(x, w, dy, GROUPS, fp8jax.recipes.fp32())
    assert _froberr(y, ey) < 0.1


def test_bad_inputs():
    r = fp8jax.recipes.bf16()
    with pytest.raises(ValueError):
        grouped_dot(jnp.ones((4, 3)), jnp.ones((2, 4, 5)), jnp.array([2, 2]), recipe=r)
    with pytest.raises(ValueError):
        grouped_dot(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.array([4]), recipe=r)
    blk = dataclasses.replace(
        fp8jax.recipes.deepseek_v3(),
        fprop=fp8jax.GemmSpec(fp8jax.QuantSpec("e4m3", "block"), fp8jax.QuantSpec("e4m3", "block")),
    )
    with pytest.raises(ValueError, match="block"):
        grouped_dot(jnp.ones((4, 3)), jnp.ones((2, 3, 5)), jnp.array([2, 2]), recipe=blk)


@pytest.mark.parametrize("name", ["deepseek_v3", "current_tensor", "rowwise"])
def test_chunked_impl_matches_reference(name):
    """impl='chunked' (codes per 128-run in bfloat16, scales at promotion) on the experts."""
    recipe = dataclasses.replace(fp8jax.registry.get(name), impl="chunked")
    x, w, dy = _inputs(4)
    y, dx, dw, _ = _run(x, w, dy, jnp.asarray(GROUPS), recipe)
    ry, rdx, rdw = reference(x, w, dy, GROUPS, recipe)
    assert _relerr(y, ry) < 1e-5 and _relerr(dx, rdx) < 1e-5 and _relerr(dw, rdw) < 1e-5


def test_accumulation_emulator_reaches_the_experts():
    """With recipe.accumulation set, y, dx and dW of the experts come from the emulator:
    they differ from exact FP32 accumulation and equal a per-expert loop of the dense GEMM
    (dW up to the float32 adds of its token tiles)."""
    gs_np = np.array([130, 0, 60, 3], np.int32)
    e, m, k, n = len(gs_np), 200, 256, 96
    rng = np.random.default_rng(6)
    # Positive inputs: the emulator's truncation error does not cancel.
    x = jnp.asarray(rng.uniform(0, 1, (m, k)), jnp.float32)
    w = jnp.asarray(rng.uniform(0, 1, (e, k, n)), jnp.float32)
    dy = jnp.asarray(rng.uniform(0, 1, (m, n)), jnp.float32)
    acc = fp8jax.recipes.deepseek_v3(accumulation=fp8jax.Accumulation(promote_every=None))
    exact = fp8jax.recipes.deepseek_v3()

    def grouped(recipe):
        f = lambda x, w: grouped_dot(
            x, w, jnp.asarray(gs_np), recipe=recipe, preferred_element_type=jnp.float32
        )
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    def per_expert(recipe):
        ys, dxs, dws, off = [], [], [], 0
        dn = (((1,), (0,)), ((), ()))
        for i, g in enumerate(gs_np):
            r = slice(off, off + int(g))
            f = lambda xe, we: dot_general(
                xe, we, dn, recipe=recipe, preferred_element_type=jnp.float32
            )
            y, vjp = jax.vjp(f, x[r], w[i])
            dx_e, dw_e = vjp(dy[r])
            ys.append(y), dxs.append(dx_e), dws.append(dw_e)
            off += int(g)
        pad = jnp.zeros((m - off, n)), jnp.zeros((m - off, k))
        return (
            jnp.concatenate(ys + [pad[0]]),
            jnp.concatenate(dxs + [pad[1]]),
            jnp.stack(dws),
        )

    got = jax.jit(lambda: grouped(acc))()
    loop = per_expert(acc)
    plain = grouped(exact)
    for name, a, b, c in zip(("y", "dx", "dw"), got, loop, plain):
        a, b = np.asarray(a), np.asarray(b)
        if name == "dw":
            # Wgrad: the grouped GEMM adds its 128-token tiles' promoted results
            # in float32 after the emulator, where the dense GEMM's FFMA
            # promotion adds each chain into one accumulator with one rounding:
            # the two may differ by the roundings of those few adds.
            np.testing.assert_allclose(a, b, rtol=4 * 2.0**-24, atol=0)
        else:
            np.testing.assert_array_equal(a, b)
        assert np.any(a != np.asarray(c))


@pytest.mark.slow
def test_pallas_kernel_plug_in_matches_xla_path():
    """recipe.impl='pallas' runs Fprop/Dgrad through the grouped Pallas kernel (interpret on CPU)."""
    rng = np.random.default_rng(5)
    gs = jnp.asarray([90, 0, 70], jnp.int32)
    x = jnp.asarray(rng.standard_normal((200, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 256, 128)) / 16, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((200, 128)), jnp.float32)

    def run(impl):
        r = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl=impl)
        f = lambda x, w: jnp.sum(
            grouped_dot(x, w, gs, recipe=r, preferred_element_type=jnp.float32) * dy
        )
        return jax.value_and_grad(f, (0, 1))(x, w)

    for a, b in zip(jax.tree.leaves(run("xla")), jax.tree.leaves(run("pallas"))):
        assert _relerr(np.asarray(b), np.asarray(a, np.float64)) < 1e-5


def test_dgrad_blocks_stay_inside_each_expert():
    """128x128 blocks of dy (DeepSeek-V3 B.2's setting) are cut per expert: the grouped dx
    equals a per-expert loop of the dense GEMM with the same recipe."""

    recipe = fp8jax.registry.get("dgrad_blocks")
    x, w, dy = _inputs(7)
    gs_np = GROUPS
    f = lambda x, w: grouped_dot(
        x, w, jnp.asarray(gs_np), recipe=recipe, preferred_element_type=jnp.float32
    )
    _, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, _ = vjp(jnp.asarray(dy))
    off, dn = 0, (((1,), (0,)), ((), ()))
    for e, g in enumerate(gs_np):
        r = slice(off, off + int(g))
        fe = lambda xe, we: dot_general(
            xe, we, dn, recipe=recipe, preferred_element_type=jnp.float32
        )
        _, vjp_e = jax.vjp(fe, jnp.asarray(x[r]), jnp.asarray(w[e]))
        dx_e, _ = vjp_e(jnp.asarray(dy[r]))
        np.testing.assert_allclose(np.asarray(dx)[r], np.asarray(dx_e), rtol=1e-5, atol=1e-6)
        off += int(g)


def test_prequantized_weights_go_in_with_their_codes():
    # Expert weights quantized before the call (an FP8 gather) give the
    # result of quantizing inside, bit for bit; their gradient is that of the
    # values they represent.
    recipe = fp8jax.recipes.deepseek_v3()
    x, w, dy = _inputs()
    qw = fp8jax.schemes.quantize(jnp.asarray(w), recipe.fprop.rhs, 1)

    @jax.jit
    def run(w_in):
        f = lambda x, w: grouped_dot(x, w, jnp.asarray(GROUPS), recipe=recipe)  # noqa: E731
        y, vjp = jax.vjp(f, jnp.asarray(x), w_in)
        return (y, *vjp(jnp.asarray(dy)))

    y, dx, dw = run(jnp.asarray(w))
    yq, dxq, dwq = run(qw)
    np.testing.assert_array_equal(np.asarray(yq), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dxq), np.asarray(dx))
    np.testing.assert_array_equal(np.asarray(dwq.data), np.asarray(dw))
    assert not np.any(np.asarray(dwq.scale))
    with pytest.raises(ValueError, match="pre-quantized operand"):
        grouped_dot(
            jnp.asarray(x),
            fp8jax.quantize(jnp.asarray(w), fp8jax.E4M3, "tensor"),
            jnp.asarray(GROUPS),
            recipe=recipe,
        )


@pytest.mark.parametrize("name", ["bf16", "deepseek_v3"])
@pytest.mark.parametrize("sizes", [[-3, 7], [9, 9], [2**31 - 1, 0]])
def test_invalid_group_sizes_are_refused_eagerly_and_nan_under_jit(name, sizes):
    recipe = fp8jax.registry.get(name)
    x = jnp.ones((4, 128), jnp.float32)
    w = jnp.ones((2, 128, 128), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_dot(x, w, gs, recipe=recipe)
    y = jax.jit(lambda x, w, g: grouped_dot(x, w, g, recipe=recipe))(x, w, gs)
    assert bool(jnp.all(jnp.isnan(y)))
    # Valid traced sizes stay untouched.
    y = jax.jit(lambda x, w, g: grouped_dot(x, w, g, recipe=recipe))(x, w, jnp.asarray([1, 3]))
    assert bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize("use_jit", [False, True])
def test_gpu_requantized_tiles_are_the_dequantized_paths_bits(use_jit):
    # Wgrad's x from its 1x128 FP8 cache in expert-aligned 128-token tiles: the
    # GPU's requantizing kernel (interpreted) on the cache's tiles gives the
    # codes and scales of dequantizing, tiling and quantizing along the tokens.
    from fp8jax.gemm import tile_rows
    from fp8jax.grouped import _quantize_tokens, gpu_requantized_tiles
    from fp8jax.groups import group_layout, to_tiles
    from fp8jax.operands import materialize, quantize_operand

    recipe = fp8jax.recipes.deepseek_v3()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 256)).astype(np.float32)
    x[:64, :128] *= 1e-30  # tiny tiles (subnormal scales)
    x[150, 7] = 3e4  # an outlier
    cached, _ = quantize_operand(jnp.asarray(x), recipe.fprop.lhs, 1, recipe)
    layout = group_layout(jnp.asarray([100, 0, 150], jnp.int32), 300)
    spec = recipe.wgrad.lhs

    def both(c):
        got = gpu_requantized_tiles(tile_rows(c, layout), spec, interpret=True)
        x_t = to_tiles(materialize(c, jnp.float32), layout)
        return got, _quantize_tokens(x_t, spec, layout, recipe, None)

    got, want = (jax.jit(both) if use_jit else both)(cached)
    assert got.layout == want.layout and got.shape == want.shape == (layout.num_tiles, 128, 256)
    np.testing.assert_array_equal(
        np.asarray(got.data).view(np.uint8), np.asarray(want.data).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
