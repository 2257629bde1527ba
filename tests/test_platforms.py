"""Per-platform choices at lowering: choose, only_on, refuse, the CUDA target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

from fp8jax import inline_ops, platforms

DIMS = (((1,), (0,)), ((), ()))


def _f8_dot(a, b):
    return lax.dot_general(
        a,
        b,
        DIMS,
        precision=lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
        preferred_element_type=jnp.float32,
    )


def _widened(a, b):
    # The same products, exact in bfloat16, summed in float32.
    return lax.dot_general(
        a.astype(jnp.bfloat16),
        b.astype(jnp.bfloat16),
        DIMS,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _product(a, b):
    """Hardware FP8 dots on CUDA, a refusal on ROCm, the widened dot elsewhere."""

    def decide(p):
        return {"cuda": "fp8", "rocm": "no"}.get(p, "widened")

    def build(d):
        if d == "fp8":
            return lambda: platforms.only_on(("cuda",), _f8_dot, a, b)
        if d == "no":
            return lambda: platforms.refuse("rocm cannot run this", (a.shape[0], b.shape[1]))
        return lambda: _widened(a, b)

    return platforms.choose(decide, build)


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.uniform(-8, 8, (8, 256)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.uniform(-8, 8, (256, 16)), jnp.float8_e4m3fn)
    return a, b


def _reference(a, b):
    return np.asarray(a, np.float64) @ np.asarray(b, np.float64)


@pytest.mark.parametrize("use_jit", [False, True])
def test_choose_runs_this_platforms_branch(use_jit):
    a, b = _operands()
    f = jax.jit(_product) if use_jit else _product
    got = np.asarray(f(a, b), np.float64)
    # Exact products of 256 terms summed in float32.
    np.testing.assert_allclose(got, _reference(a, b), rtol=1e-6, atol=1e-3)


def test_choose_under_vmap():
    a, b = _operands()
    bs = jnp.stack([b, b[:, ::-1]])
    got = jax.vmap(_product, in_axes=(None, 0))(a, bs)
    for i in range(2):
        np.testing.assert_allclose(
            np.asarray(got[i], np.float64), _reference(a, bs[i]), rtol=1e-6, atol=1e-3
        )


def test_one_trace_lowers_to_each_platforms_program():
    a, b = _operands()
    traced = jax.jit(_product).trace(a, b)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "lhs_precision_type = f8E4M3FN" in cuda and "xbf16>" not in cuda
    assert "f8E4M3FN" not in cpu.split("func.func")[-1].split("dot_general")[1][:200]
    assert "xbf16>" in cpu
    with pytest.raises(ValueError, match="rocm cannot run this"):
        traced.lower(lowering_platforms=("rocm",))


def test_multi_platform_lowering_keeps_every_platforms_branch():
    # JAX's CPU lowering refuses the FP8 preset; only_on keeps it out of the
    # CPU branch of a program lowered for CPU and CUDA together.
    a, b = _operands()
    text = jax.jit(_product).trace(a, b).lower(lowering_platforms=("cpu", "cuda", "tpu")).as_text()
    assert "lhs_precision_type = f8E4M3FN" in text and "xbf16>" in text


def test_multi_platform_export():
    a, b = _operands()
    f = lambda a, b: platforms.choose(  # noqa: E731
        lambda p: p == "cpu",
        lambda cpu: (
            (lambda: _widened(a, b))
            if cpu
            else (
                lambda: platforms.only_on(
                    ("cuda", "rocm", "tpu"), lambda a, b: _widened(a, b) * 1.0, a, b
                )
            )
        ),
    )
    exp = export.export(jax.jit(f), platforms=["cpu", "cuda", "tpu"])(a, b)
    assert exp.platforms == ("cpu", "cuda", "tpu")
    np.testing.assert_allclose(
        np.asarray(exp.call(a, b), np.float64), _reference(a, b), rtol=1e-6, atol=1e-3
    )


def test_cuda_target():
    assert platforms.cuda_capability() == (
        platforms.local_cuda_capability() or platforms.DEFAULT_CUDA_TARGET
    )
    with platforms.cuda_target("10.0"):
        assert platforms.cuda_at_least("9.0") and platforms.cuda_at_least("10.0")
        with platforms.cuda_target("8.0"):
            assert not platforms.cuda_at_least("8.9")
        assert platforms.cuda_capability() == "10.0"
    with pytest.raises(ValueError, match="compute capability"):
        with platforms.cuda_target("hopper"):
            pass
    with pytest.raises(ValueError, match="no known GPU"):
        with platforms.lowering_for_cuda("7.5"):
            pass


def test_identical_decisions_make_no_branch():
    a, b = _operands()
    f = lambda a, b: platforms.choose(lambda p: "same", lambda d: lambda: _widened(a, b))  # noqa: E731
    assert "case" not in str(jax.make_jaxpr(f)(a, b))
    assert "cond" in str(jax.make_jaxpr(_product)(a, b))


def _declared(a, b):
    return jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32)


@pytest.mark.parametrize("use_jit", [False, True])
def test_only_on_with_out_shape_traces_at_lowering(use_jit):
    # Declared results: nothing of the computation in the jaxpr, its program in
    # the lowering for its platform, zeros for any other; run where it is.
    a, b = _operands()
    calls = []

    def widened(a, b):
        calls.append(1)
        return _widened(a, b)

    def f(a, b):
        return platforms.only_on(("cpu",), widened, a, b, out_shape=_declared(a, b))

    got = (jax.jit(f) if use_jit else f)(a, b)
    np.testing.assert_allclose(np.asarray(got, np.float64), _reference(a, b), rtol=1e-6)
    calls.clear()
    traced = jax.jit(f).trace(a, b)
    assert not calls
    assert "dot_general" not in str(traced.jaxpr)
    assert "dot_general" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "dot_general" not in traced.lower(lowering_platforms=("tpu",)).as_text()


def test_only_on_with_out_shape_under_vmap_and_a_wrong_declaration():
    a, b = _operands()
    stack = jnp.stack([a, a])

    def f(a):
        return platforms.only_on(("cpu",), _widened, a, b, out_shape=_declared(a, b))

    got = jax.jit(jax.vmap(f))(stack)
    np.testing.assert_allclose(np.asarray(got[1], np.float64), _reference(a, b), rtol=1e-6)
    wrong = jax.ShapeDtypeStruct((a.shape[0], b.shape[1] + 1), jnp.float32)
    g = jax.jit(lambda a: platforms.only_on(("cpu",), _widened, a, b, out_shape=wrong))
    with pytest.raises(ValueError, match="declared as"):
        g.trace(a).lower(lowering_platforms=("cpu",))


def _traced_per_decision(calls):
    """A choice with operands whose branches note when they are traced."""

    def build(d):
        def branch(a, b):
            calls.append(d)
            out = jnp.dot(
                a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST
            )
            return out * 2.0 if d == "twice" else out

        return branch

    return lambda a, b: platforms.choose(
        lambda p: "once" if p == platforms.tracing_platform() else "twice", build, (a, b)
    )


@pytest.mark.parametrize("use_jit", [False, True])
def test_choose_with_operands_traces_the_other_branches_at_lowering(use_jit):
    a, b = _operands()
    calls = []
    f = _traced_per_decision(calls)
    got = np.asarray((jax.jit(f) if use_jit else f)(a, b), np.float64)
    np.testing.assert_allclose(got, _reference(a, b), rtol=1e-6, atol=1e-3)
    calls.clear()
    # A new function, not one from the jit cache.
    traced = jax.jit(_traced_per_decision(calls)).trace(a, b)
    # Only this platform's branch, once; another platform's when lowered for it.
    assert calls == ["once"]
    here = platforms.tracing_platform()
    other = "tpu" if here != "tpu" else "cpu"
    text = traced.lower(lowering_platforms=(other,)).as_text()
    assert calls == ["once", "twice"] and "dot_general" in text
    traced.lower(lowering_platforms=(here,))
    assert calls == ["once", "twice"]


def test_choose_with_operands_under_grad_and_vmap():
    a, b = _operands()
    x = jnp.asarray(a, jnp.float32)
    f = _traced_per_decision([])

    def loss(x):
        return jnp.sum(f(x, jnp.asarray(b, jnp.float32)))

    # d/dx sum(x @ b) = row sums of b, for every row of x.
    want = np.broadcast_to(np.asarray(b, np.float64).sum(axis=1), x.shape)
    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        np.testing.assert_allclose(np.asarray(grad(x), np.float64), want, rtol=1e-6)
    stack = jnp.stack([x, -x])
    got = jax.jit(jax.vmap(lambda x: f(x, jnp.asarray(b, jnp.float32))))(stack)
    np.testing.assert_allclose(np.asarray(got[1], np.float64), -_reference(a, b), rtol=1e-6)


def test_choose_with_operands_traces_its_branch_once_under_traced_inline():
    # The caller's jax.numpy jits off (inline_ops.traced_inline): the choice's
    # own jit keeps its trace, so this platform's branch is still traced once.
    a, b = _operands()
    calls = []
    jax.make_jaxpr(inline_ops.traced_inline(_traced_per_decision(calls)))(a, b)
    assert calls == ["once"]
