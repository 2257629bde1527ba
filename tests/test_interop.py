"""fp8jax.interop without Qwix: rules, einsum specs, and the drop-in dot_general / einsum /
ragged_dot in standard Flax layers, bit for bit against fp8jax's own GEMMs."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import fp8jax
from fp8jax import interop
from fp8jax.interop import ops
from fp8jax.interop.einsum_dims import einsum_dims, explicit_spec

R = fp8jax.recipes.deepseek_v3()


def test_import_fp8jax_does_not_import_qwix():
    code = "import sys, fp8jax, fp8jax.interop; assert 'qwix' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_rules_resolve_and_refuse_bad_input():
    r = interop.Rule(module_path=".*mlp.*", recipe="deepseek_v3", op_names=["einsum"])
    assert r.recipe == R and r.op_names == ("einsum",)
    assert r.matches("layers/0/mlp/up", "einsum") and not r.matches(
        "layers/0/mlp/up", "dot_general"
    )
    assert interop.Rule(recipe=None).recipe is None
    with pytest.raises(ValueError, match="unknown recipe"):
        interop.Rule(recipe="fp9")
    with pytest.raises(ValueError, match="op_names"):
        interop.Rule(op_names=("conv",))
    with pytest.raises(ValueError, match="regex"):
        interop.Rule(module_path="(")
    with pytest.raises(ValueError, match="delayed"):
        interop.dot_general("hybrid_delayed")
    assert interop.dot_general(None) is jax.lax.dot_general
    # The factories' names say what they make; the hook names stay as aliases.
    assert interop.dot_general is interop.make_dot_general
    assert (interop.einsum, interop.ragged_dot) == (interop.make_einsum, interop.make_ragged_dot)


SPECS = [
    ("btd,df->btf", (2, 3, 4), (4, 5)),
    ("...d,df->...f", (2, 3, 4), (4, 5)),
    ("bd,df", (3, 4), (4, 5)),
    ("bthk,hkd->btd", (2, 3, 2, 4), (2, 4, 5)),
    ("df,btd->btf", (4, 5), (2, 3, 4)),
    ("bhtd,bhsd->bhts", (2, 2, 3, 4), (2, 2, 5, 4)),
]


@pytest.mark.parametrize("spec,ls,rs", SPECS)
def test_einsum_as_one_dot_general_matches_numpy(spec, ls, rs):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(ls), rng.standard_normal(rs)
    dn, perm = einsum_dims(spec, len(ls), len(rs))
    got = np.transpose(jax.lax.dot_general(a, b, dn, precision="highest"), perm)
    np.testing.assert_allclose(got, np.einsum(spec, a, b), rtol=1e-5, atol=1e-6)
    assert explicit_spec("...d,df->...f", 3, 2).count("...") == 0


def _vjp3(fn, x, w, dy, jit):
    def run(x, w):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(dy))

    return [np.asarray(a) for a in (jax.jit(run) if jit else run)(x, w)]


def _xw(seed, x_shape, w_shape):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, x_shape) * jnp.exp(jax.random.uniform(k2, x_shape[-1:], minval=-3))
    return x, jax.random.normal(k3, w_shape) / 12


def _with_kernel(module: nnx.Module):
    """f(x, w): the layer called with kernel w (a pure function JAX can differentiate)."""
    graphdef, params = nnx.split(module)

    def f(x, w):
        return nnx.merge(graphdef, jax.tree.map(lambda _: w, params))(x)

    return f


@pytest.mark.parametrize("jit", [True, False])
def test_dropin_in_nnx_linear_and_einsum_equals_fp8jax_bit_for_bit(jit):
    x, w = _xw(0, (2, 5, 160), (160, 136))
    dy = jax.random.normal(jax.random.key(1), (2, 5, 136))
    dims = (((2,), (0,)), ((), ()))
    lin = nnx.Linear(160, 136, use_bias=False, dot_general=interop.dot_general(R), rngs=nnx.Rngs(0))

    layer = _with_kernel(lin)

    ours = lambda x, w: fp8jax.dot_general(x, w, dims, recipe=R)
    for a, b in zip(_vjp3(layer, x, w, dy, jit), _vjp3(ours, x, w, dy, jit)):
        np.testing.assert_array_equal(a, b)
    # nnx.Einsum with the weight as the left operand of the spec: w is still the weight.
    ein = nnx.Einsum("dn,btd->btn", (160, 136), einsum_op=interop.einsum(R), rngs=nnx.Rngs(0))
    ein.einsum_str = "btd,dn->btn"

    for a, b in zip(_vjp3(_with_kernel(ein), x, w, dy, jit), _vjp3(ours, x, w, dy, jit)):
        np.testing.assert_array_equal(a, b)


def test_dropin_in_linen_dense_general_equals_fp8jax_bit_for_bit():
    x, w = _xw(2, (3, 4, 144), (144, 2, 64))
    dy = jax.random.normal(jax.random.key(3), (3, 4, 2, 64))
    dense = linen.DenseGeneral((2, 64), use_bias=False, dot_general=interop.dot_general("rowwise"))
    layer = lambda x, w: dense.apply({"params": {"kernel": w}}, x)
    dims = (((2,), (0,)), ((), ()))
    rw = fp8jax.recipes.rowwise()
    ours = lambda x, w: fp8jax.dot_general(x, w, dims, recipe=rw)
    for a, b in zip(_vjp3(layer, x, w, dy, True), _vjp3(ours, x, w, dy, True)):
        np.testing.assert_array_equal(a, b)


def test_weight_on_the_left_runs_as_the_weight():
    """A dot_general whose lhs is the weight quantizes it as a weight (blocks), then transposes."""
    x, w = _xw(4, (6, 160), (160, 136))
    dy = jax.random.normal(jax.random.key(5), (136, 6))
    dims = (((0,), (1,)), ((), ()))  # w^T x^T: (136, 6)
    left = lambda x, w: ops.dot_general(w, x, dims, R, weight="lhs")[0]
    ref = lambda x, w: fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=R).T
    for a, b in zip(_vjp3(left, x, w, dy, True), _vjp3(ref, x, w, dy, True)):
        np.testing.assert_array_equal(a, b)


def test_dropin_ragged_dot_is_fp8jax_ragged_dot():
    x, w = _xw(6, (40, 130), (3, 130, 24))
    gs = jnp.array([10, 0, 25], jnp.int32)
    got = interop.ragged_dot(R)(x, w, gs, preferred_element_type=jnp.float32)
    want = fp8jax.ragged_dot(x, w, gs, recipe=R, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(NotImplementedError, match="group_offset"):
        interop.ragged_dot(R)(x, w, gs, group_offset=jnp.array([0]))
