"""The provider's coverage report, on model shapes fp8jax did not write (standard Flax only).

* a Linen GPT-2-style model: projections as ``lax.dot_general(x,
  kernel.transpose())`` (Conv1D) and a head tied to the embedding through
  ``lm_head.apply({"params": {"kernel": embedding.T}}, h)`` (root path);
* an NNX MoE-style block whose GEMMs are ``@`` on parameters, two of them of
  one shape (gate and up).

Each is checked two ways: the report counts the GEMMs that ran a recipe,
forward under ``jit`` and under ``jit(grad)``; and loss and gradients equal,
bit for bit, the same computation written with ``fp8jax.dot_general`` (so
Fprop, Dgrad and Wgrad of every counted GEMM ran in FP8, and the head did not).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from jax import lax

import fp8jax
from fp8jax import interop
from fp8jax.interop.coverage import Coverage, CoverageWarning, Seen
from fp8jax.interop.einsum_dims import matmul_dims
from fp8jax.nn.recording import capture

qwix = pytest.importorskip("qwix")

R = fp8jax.recipes.deepseek_v3()
RULES = [
    interop.Rule(module_path=r".*(embed|head|router).*", recipe=None),
    interop.Rule(recipe="deepseek_v3"),
]
DIMS = (((2,), (0,)), ((), ()))


@pytest.mark.parametrize(
    "a,b",
    [
        ((5,), (5, 3)),
        ((2, 4, 5), (5, 3)),
        ((4, 5), (5,)),
        ((4, 5), (2, 5, 3)),
        ((2, 4, 5), (2, 5, 3)),
        ((5,), (2, 5, 3)),
    ],
)
def test_matmul_as_one_dot_general_matches_numpy(a, b):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(a), rng.standard_normal(b)
    dn, perm = matmul_dims(a, b)
    got = np.asarray(lax.dot_general(x, y, dn, precision="highest"))
    got = got if perm is None else np.transpose(got, perm)
    np.testing.assert_allclose(got, np.matmul(x, y), rtol=1e-5, atol=1e-6)
    assert matmul_dims((2, 4, 5), (3, 5, 3)) is None and matmul_dims((), (5,)) is None


# ----------------------------------------------------------------------------
# Linen, GPT-2 style: transposed Conv1D kernels and a tied head at the root path
# ----------------------------------------------------------------------------


class Conv1D(linen.Module):
    """GPT-2's Conv1D: kernel stored (features, in), used as ``kernel.transpose()``."""

    features: int
    dot_general: object = lax.dot_general

    @linen.compact
    def __call__(self, x):
        init = linen.initializers.normal(0.05)
        kernel = self.param("kernel", init, (self.features, x.shape[-1]))
        kernel = jnp.asarray(kernel.transpose(), x.dtype)
        return self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class TiedLM(linen.Module):
    vocab: int = 64
    d: int = 128
    f: int = 256
    dot_general: object = lax.dot_general

    @linen.compact
    def __call__(self, tokens):
        wte = linen.Embed(self.vocab, self.d, name="wte")
        h = wte(tokens)
        up = Conv1D(self.f, self.dot_general, name="c_fc")(h)
        h = h + Conv1D(self.d, self.dot_general, name="c_proj")(jax.nn.gelu(up))
        head = linen.Dense(self.vocab, use_bias=False, name="lm_head")
        shared = self.variables["params"]["wte"]["embedding"].T
        return head.apply({"params": {"kernel": shared}}, h)


TOKENS = jax.random.randint(jax.random.key(0), (2, 5), 0, 64)


def _linen_loss(model):
    return lambda p: jnp.mean(model.apply({"params": p}, TOKENS) ** 2)


def test_tied_head_and_transposed_kernels_in_linen():
    provider = interop.QwixProvider(RULES)
    quantized = qwix.quantize_model(TiedLM(), provider)
    params = TiedLM().init(jax.random.key(1), TOKENS)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CoverageWarning)
        jax.jit(_linen_loss(quantized))(params)
        got = jax.jit(jax.value_and_grad(_linen_loss(quantized)))(params)
    fp8 = [("c_fc", "dot_general0"), ("c_proj", "dot_general0")]
    assert provider.coverage.quantized("forward") == fp8
    assert provider.coverage.quantized("grad") == fp8
    rows = {(r["path"], r["op"]): r for r in provider.coverage.rows()}
    head = rows[("lm_head", "dot_general0")]
    assert head["forward"] == {"recipe": None, "why": "rule: None"} == head["grad"]
    assert "apply at the root" in head["path_note"]
    assert rows[("c_fc", "dot_general0")]["grad"]["why"] == "kernel by traced"
    assert "lm_head/dot_general0" in provider.coverage.table()
    # Bit for bit the model with fp8jax's op in its two projections and a plain head.
    want = jax.jit(jax.value_and_grad(_linen_loss(TiedLM(dot_general=interop.dot_general(R)))))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want(params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And it is not the plain model.
    assert float(got[0]) != float(jax.jit(_linen_loss(TiedLM()))(params))


def test_transposed_kernels_found_under_eager_grad():
    provider = interop.QwixProvider(RULES)
    quantized = qwix.quantize_model(TiedLM(d=128, f=128), provider)
    params = TiedLM(d=128, f=128).init(jax.random.key(2), TOKENS)["params"]
    jax.value_and_grad(_linen_loss(quantized))(params)
    assert len(provider.coverage.quantized("grad")) == 2
    _linen_loss(quantized)(params)
    rows = {(r["path"], r["op"]): r for r in provider.coverage.rows()}
    assert rows[("c_fc", "dot_general0")]["forward"]["why"] == "kernel by value"


# ----------------------------------------------------------------------------
# NNX: ``@`` on parameters, two of one shape (an MoE expert's gate and up)
# ----------------------------------------------------------------------------


class SwiGLUExpert(nnx.Module):
    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        init = lambda *s: nnx.Param(0.05 * jax.random.normal(rngs.params(), s))
        self.ws_gate, self.ws_up, self.ws_down = init(d, f), init(d, f), init(f, d)

    def __call__(self, x):
        return (jax.nn.silu(x @ self.ws_gate[...]) * (x @ self.ws_up[...])) @ self.ws_down[...]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.moe = SwiGLUExpert(128, 256, rngs)

    def __call__(self, x):
        return x + self.moe(x)


def _reference(p, x):
    mm = lambda a, w: fp8jax.dot_general(a, w, DIMS, recipe=R)
    h = jax.nn.silu(mm(x, p["ws_gate"])) * mm(x, p["ws_up"])
    return x + mm(h, p["ws_down"])


X = jax.random.normal(jax.random.key(3), (2, 4, 128))


def _nnx_loss(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def f(params):
        return jnp.mean(nnx.merge(graphdef, params)(X) ** 2)

    return f, params


def test_same_shape_parameters_used_with_matmul_are_told_apart():
    provider = interop.QwixProvider(RULES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CoverageWarning)
        model = qwix.quantize_model(Block(nnx.Rngs(0)), provider, X)
        f, params = _nnx_loss(model)
        jax.jit(f)(params)
        got = jax.jit(jax.value_and_grad(f))(params)
    fp8 = [("moe", f"dot_general{i}") for i in range(3)]
    assert provider.coverage.quantized("forward") == fp8 == provider.coverage.quantized("grad")
    whys = {r["op"]: r["grad"]["why"] for r in provider.coverage.rows()}
    assert whys == {
        f"dot_general{i}": f"{n} by traced" for i, n in enumerate(("ws_gate", "ws_up", "ws_down"))
    }

    # Each of the three sows its telemetry (the down projection too).
    _, stats = capture(model, X)
    assert {f"moe/dot_general{i}/{s}" for i in range(3) for s in "xw"} <= set(stats)

    p = {k: v.get_value() for k, v in params["moe"].items()}
    ref = lambda p: jnp.mean(_reference(p, X) ** 2)
    want = jax.jit(jax.value_and_grad(ref))(p)
    assert float(got[0]) == float(want[0])
    for k in p:
        np.testing.assert_array_equal(
            np.asarray(got[1]["moe"][k].get_value()), np.asarray(want[1][k])
        )


class Scaled(nnx.Module):
    """Gate and up of one shape, each used after a multiplication (no parameter read left)."""

    def __init__(self, rngs: nnx.Rngs):
        self.ws_gate = nnx.Param(jax.random.normal(rngs.params(), (128, 128)))
        self.ws_up = nnx.Param(jax.random.normal(rngs.params(), (128, 128)))

    def __call__(self, x):
        return x @ (self.ws_gate[...] * 0.5) + x @ (self.ws_up[...] * 0.5)


def test_ambiguous_weights_are_reported_and_warned_once():
    provider = interop.QwixProvider([interop.Rule(recipe="deepseek_v3")])
    x = jnp.ones((4, 128))
    with pytest.warns(CoverageWarning, match="ambiguous") as caught:
        # Eagerly (quantize_model's first call) and then under jit: one warning per op.
        model = qwix.quantize_model(Scaled(nnx.Rngs(0)), provider, x)
        graphdef, params = nnx.split(model, nnx.Param)
        jax.jit(lambda p: nnx.merge(graphdef, p)(x))(params)
    assert len([w for w in caught if "dot_general0" in str(w.message)]) == 1
    row = {r["op"]: r for r in provider.coverage.rows()}["dot_general0"]
    assert row["forward"]["recipe"] is None
    assert row["forward"]["why"].startswith(
        "ambiguous: rhs (128, 128) could be any of ws_gate, ws_up"
    )


def test_forward_and_grad_that_differ_are_warned_once():
    cov = Coverage()
    cov.add(
        "forward",
        Seen(
            "mlp", "dot_general0", ((2, 8), (8, 4)), "deepseek_v3", "kernel by traced", named=True
        ),
    )
    with pytest.warns(CoverageWarning) as caught:
        for _ in range(2):
            cov.add(
                "grad",
                Seen(
                    "mlp",
                    "dot_general0",
                    ((2, 8), (8, 4)),
                    None,
                    "no parameter operand",
                    named=True,
                ),
                suspicious=True,
            )
    messages = [str(w.message) for w in caught]
    assert len([m for m in messages if "forward and grad differ" in m]) == 1
    assert len([m for m in messages if "grad GEMM runs unquantized" in m]) == 1
    assert cov.quantized("forward") == [("mlp", "dot_general0")] and cov.quantized("grad") == []
    assert "none: no parameter operand" in cov.table()
