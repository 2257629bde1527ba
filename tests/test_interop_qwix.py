"""fp8jax.interop.QwixProvider on models fp8jax did not define (standard Flax layers only).

The reference for each quantized model is the same model built with the
drop-in hooks (fp8jax.interop.dot_general / einsum / ragged_dot, themselves
checked against fp8jax.dot_general in test_interop.py): equal loss and
gradients bit for bit means every routed layer gave fp8jax's forward, dx and
dW.
"""

from __future__ import annotations

import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax import interop
from fp8jax.interop.examples.deepseek_moe import DeepSeekMoE, MoEConfig
from fp8jax.interop.examples.linen_mlp import LinenMLP
from fp8jax.interop.examples.llama import Llama, LlamaConfig, next_token_loss
from fp8jax.nn.recording import capture
from fp8jax.nn.variables import FP8State
from fp8jax.train.defaults import config_file

qwix = pytest.importorskip("qwix")

R = fp8jax.recipes.deepseek_v3()
HIGH = r".*(embed|head|router).*"
RULES = [interop.Rule(module_path=HIGH, recipe=None), interop.Rule(recipe="deepseek_v3")]
TOKENS = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)


def _loss_and_grads(model, jit):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params):
        return next_token_loss(nnx.merge(graphdef, params, rest), TOKENS)

    fn = jax.value_and_grad(f)
    loss, grads = (jax.jit(fn) if jit else fn)(params)
    return float(loss), jax.tree.leaves(grads)


def _same(a, b):
    (la, ga), (lb, gb) = a, b
    assert la == lb and len(ga) == len(gb)
    for x, y in zip(ga, gb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class One(nnx.Module):
    """One nnx.Linear at path "proj"."""

    def __init__(self):
        self.proj = nnx.Linear(160, 136, use_bias=False, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.proj(x)


@pytest.mark.parametrize("jit", [True, False])
def test_one_layer_through_qwix_is_fp8jax_dot_general_bit_for_bit(jit):
    x = jax.random.normal(jax.random.key(5), (2, 7, 160))
    dy = jax.random.normal(jax.random.key(6), (2, 7, 136))
    model = qwix.quantize_model(One(), interop.QwixProvider(RULES), x)
    graphdef, params = nnx.split(model)

    def layer(x, w):
        return nnx.merge(graphdef, jax.tree.map(lambda _: w, params))(x)

    ours = lambda x, w: fp8jax.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=R)

    def run(fn):
        def f(x, w):
            y, vjp = jax.vjp(fn, x, w)
            return (y, *vjp(dy))

        return (jax.jit(f) if jit else f)(x, model.proj.kernel.get_value())

    for a, b in zip(run(layer), run(ours)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_jitted_train_step_through_qwix_traces_once_and_leaves_no_telemetry_behind():
    x = jax.random.normal(jax.random.key(7), (2, 7, 160))
    model = qwix.quantize_model(One(), interop.QwixProvider(RULES), x)
    opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    traces = []

    @nnx.jit
    def step(model, opt, x):
        traces.append(1)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    for _ in range(3):
        step(model, opt, x)
    assert len(traces) == 1
    assert not nnx.state(model, nnx.Intermediate)
    # Inside capture the telemetry is there.
    _, stats = capture(model, x)
    assert {"proj/dot_general0/x", "proj/dot_general0/w"} <= set(stats)


# Minutes on 2 CPU cores (Qwix's eager first call of the FP8 model): -m slow.
@pytest.mark.slow
def test_llama_through_qwix_equals_fp8jax_layers_bit_for_bit():
    cfg = LlamaConfig()
    plain = Llama(cfg, rngs=nnx.Rngs(0))
    quantized = qwix.quantize_model(plain, interop.QwixProvider(RULES), TOKENS[:, :-1])
    dropin = Llama(cfg, rngs=nnx.Rngs(0), dot_general=interop.dot_general(R))
    _same(_loss_and_grads(quantized, True), _loss_and_grads(dropin, True))
    # And it did change the numbers: the projections are FP8.
    assert _loss_and_grads(plain, True)[0] != _loss_and_grads(quantized, True)[0]


def test_moe_through_qwix_equals_fp8jax_layers_bit_for_bit():
    cfg = MoEConfig()
    plain = DeepSeekMoE(cfg, rngs=nnx.Rngs(1))
    provider = interop.QwixProvider(RULES)
    quantized = qwix.quantize_model(plain, provider, TOKENS[:, :-1])
    dropin = DeepSeekMoE(
        cfg,
        rngs=nnx.Rngs(1),
        dot_general=interop.dot_general(R),
        einsum_op=interop.einsum(R),
        ragged_dot=interop.ragged_dot(R),
    )
    _same(_loss_and_grads(quantized, True), _loss_and_grads(dropin, True))
    # Telemetry through the door: every routed op under its module path.
    _, stats = capture(quantized, TOKENS[:, :-1])
    for i in range(cfg.n_layers):
        p = f"layers/{i}"
        for name in ("attn/qkv/einsum0", "attn/o/einsum0", "moe/shared/up/dot_general0"):
            assert f"{p}/{name}/x" in stats and f"{p}/{name}/w" in stats
        assert f"{p}/moe/ragged_dot0/x" in stats and f"{p}/moe/ragged_dot1/w" in stats
        assert not any(k.startswith(f"{p}/moe/router") for k in stats)
    assert all(float(v["amax"]) > 0 for v in stats.values())
    assert not any("head" in k or "embed" in k for k in stats)


def test_rule_with_recipe_none_leaves_the_model_bit_identical():
    plain = DeepSeekMoE(MoEConfig(), rngs=nnx.Rngs(2))
    rules = [interop.Rule(recipe=None)]
    quantized = qwix.quantize_model(plain, interop.QwixProvider(rules), TOKENS[:, :-1])
    _same(_loss_and_grads(quantized, True), _loss_and_grads(plain, True))


def _train(model, steps=6):
    opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, TOKENS)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]


# Minutes on 2 CPU cores (Qwix's eager first call of the FP8 model): -m slow.
@pytest.mark.slow
def test_training_through_qwix_tracks_bf16():
    cfg = LlamaConfig(n_layers=1)
    plain = Llama(cfg, rngs=nnx.Rngs(3))
    ex = TOKENS[:, :-1]
    fp8 = _train(qwix.quantize_model(plain, interop.QwixProvider(RULES), ex))
    bf16_rules = [interop.Rule(module_path=HIGH, recipe=None), interop.Rule(recipe="bf16")]
    bf16 = _train(qwix.quantize_model(plain, interop.QwixProvider(bf16_rules), ex))
    assert fp8[-1] < fp8[0] - 0.1 and bf16[-1] < bf16[0] - 0.1
    # One batch is learned almost to zero loss: compare on the scale of the
    # starting loss (a relative gap at loss 0.05 says nothing).
    assert np.max(np.abs(np.subtract(fp8, bf16))) < 0.01 * bf16[0]


def test_delayed_state_lives_in_the_model_and_is_overwritten_by_its_gradient():
    x = jax.random.normal(jax.random.key(4), (4, 160))
    rules = [interop.Rule(recipe="hybrid_delayed")]
    model = qwix.quantize_model(One(), interop.QwixProvider(rules), x)
    state = model.proj.dot_general0_fp8_state
    assert isinstance(state, FP8State) and float(state.get_value().x.scale) == 1.0

    loss = lambda m, x: jnp.sum(m(x) ** 2)
    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, FP8State)))(model, x)
    nnx.update(model, grads.filter(FP8State))  # the one line of a train step
    new = model.proj.dot_general0_fp8_state.get_value()
    np.testing.assert_allclose(float(new.x.amax_history[0]), float(jnp.abs(x).max()), rtol=1e-6)
    assert float(new.x.scale) != 1.0


def test_linen_model_through_qwix():
    model = LinenMLP()
    tokens = TOKENS % 64
    only_dots = [
        interop.Rule(module_path=HIGH, recipe=None),
        interop.Rule(recipe=R, op_names=("dot_general",)),
    ]
    quantized = qwix.quantize_model(model, interop.QwixProvider(only_dots))
    variables = quantized.init(jax.random.key(0), tokens)
    dropin = LinenMLP(dot_general=interop.dot_general(R))

    def loss(m, params):
        return jnp.mean(m.apply({"params": params}, tokens) ** 2)

    got = jax.jit(jax.value_and_grad(lambda p: loss(quantized, p)))(variables["params"])
    want = jax.jit(jax.value_and_grad(lambda p: loss(dropin, p)))(variables["params"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # With einsum routed too, the Einsum layer reports its telemetry.
    everything = qwix.quantize_model(model, interop.QwixProvider(RULES))
    _, sown = everything.apply(variables, tokens, mutable=["intermediates"])
    keys = {k for d in sown["intermediates"].values() for e in d["fp8_telemetry"] for k in e}
    assert {"mix/einsum0/w", "proj/dot_general0/x", "up/dot_general0/w"} <= keys


# Minutes on 2 CPU cores (Qwix's eager first call of the FP8 model): -m slow.
@pytest.mark.slow
def test_comparison_entry_point_runs_at_a_tiny_setting():
    from fp8jax.lab.qwix_comparison import markdown, run

    path = Path(__file__).resolve().parents[1] / "configs/compare/interop_llama.py"
    c = config_file(path)
    c.seeds, c.steps, c.batch_size, c.seq_len, c.eval_batches = [0], 2, 2, 16, 1
    c.model = dict(vocab=256, d_model=128, n_heads=2, d_ff=128, n_layers=1)
    c.data.source = "synthetic"
    out = run(c, allow_mixed_code=True, stream=io.StringIO())
    table = out["labels"]
    assert set(table) == {"bf16", "deepseek_v3"} and np.isfinite(table["bf16"]["val_loss"][0])
    assert np.isfinite(table["deepseek_v3"]["gap"]["mean"])
    # The baseline is the standard op; the FP8 label's GEMMs ran fp8jax's path.
    assert set(table["bf16"]["gemm_paths"].values()) == {"lax.dot_general bfloat16"}
    assert "lax.dot_general" not in " ".join(table["deepseek_v3"]["gemm_paths"].values())
    text = markdown(out)
    assert "| deepseek_v3 |" in text and out["provenance"]["git"]["commit"][:10] in text


class _MatmulOnParam(nnx.Module):
    """An NNX model whose GEMM is ``@`` on a parameter (jnp.matmul, itself jitted)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (256, 128), jnp.float32))

    def __call__(self, x):
        return x @ self.w[...]


@pytest.mark.parametrize("quantized_first", [True, False])
def test_matmul_trace_cache_does_not_leak_between_models(quantized_first):
    x = jax.random.normal(jax.random.key(1), (8, 256), jnp.float32)
    plain = _MatmulOnParam(nnx.Rngs(0))
    want_plain = np.asarray(x) @ np.asarray(plain.w[...])
    provider = interop.QwixProvider([interop.Rule(module_path=".*", recipe=R)])
    quant = qwix.quantize_model(_MatmulOnParam(nnx.Rngs(0)), provider, x)
    want_fp8 = fp8jax.dot_general(x, plain.w[...], (((1,), (0,)), ((), ())), recipe=R)
    calls = [(quant, want_fp8), (plain, want_plain)]
    for model, want in calls if quantized_first else calls[::-1]:
        np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(want))
    # And back again, both ways.
    np.testing.assert_array_equal(np.asarray(plain(x)), np.asarray(plain(x)))
    np.testing.assert_array_equal(np.asarray(quant(x)), np.asarray(want_fp8))
