"""The jitted training step: microbatch accumulation, FP8-state overwrite and merge,
clipping that never touches FP8 state, router-bias updates.  A two-layer module built
from fp8jax.nn.Dense stands in for the MoE model so every compile is quick."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fp8jax
from fp8jax import scaling
from fp8jax.nn.dense import Dense
from fp8jax.nn.recording import capture
from fp8jax.nn.variables import RouterBias
from fp8jax.train import step as step_lib
from fp8jax.train.injection import fp8_state_stress, inject_block
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import create_train_state
from fp8jax.train.step import make_train_step, update_bias_state


class TwoLayer(nnx.Module):
    def __init__(self, recipe, *, rngs):
        self.emb = nnx.Param(jax.random.normal(rngs.params(), (256, 32), jnp.float32))
        self.l1 = Dense(32, 64, recipe=recipe, name="l1", dtype=jnp.float32, rngs=rngs)
        self.l2 = Dense(64, 256, recipe=recipe, name="l2", dtype=jnp.float32, rngs=rngs)
        self.router_bias = RouterBias(jnp.zeros((1, 4), jnp.float32))

    def __call__(self, tokens):
        # Telemetry as the MoE model gathers it: the layers sow, capture collects.
        logits, stats = capture(self._forward, tokens)
        # Expert "load": tokens per bucket of the first token id (deterministic).
        load = jnp.sum(jax.nn.one_hot(tokens % 4, 4), axis=(0, 1))[None]
        return logits, {"aux_loss": jnp.zeros((), jnp.float32), "expert_load": load, "fp8": stats}

    def _forward(self, tokens):
        x = self.emb[...][tokens]
        return self.l2(jax.nn.relu(self.l1(x)))


def loss_fn(model, tokens):
    logits, aux = model(tokens)
    lg = logits[:, :-1].astype(jnp.float32)
    ce = jnp.mean(
        jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tokens[:, 1:, None], -1)[..., 0]
    )
    return ce, aux


def _setup(recipe, clip=1.0):
    model = TwoLayer(recipe, rngs=nnx.Rngs(0))
    tx, sched = make_optimizer(peak_lr=1e-2, total_steps=10, warmup_steps=0, clip_norm=clip)
    graphdef, state = create_train_state(model, tx)
    return graphdef, state, tx, sched


def _tokens(b=4, t=16, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (b, t)), jnp.int32)


def test_microbatches_average_param_grads_and_max_merge_fp8_state():
    recipe = fp8jax.recipes.hybrid_delayed()
    graphdef, state, tx, _ = _setup(recipe)
    toks = _tokens()
    upd = lambda s, m: make_train_step(graphdef, tx, loss_fn, microbatches=m, donate=False)(s, toks)

    @jax.jit
    def grads(tok):
        def f(params, fp8):
            model = nnx.merge(graphdef, params, fp8, state.bias, state.rest)
            return loss_fn(model, tok)[0]

        return jax.grad(f, argnums=(0, 1))(state.params, state.fp8)

    # Independent composition: per-half gradients averaged, FP8 states max-merged.
    g_a, f_a = grads(toks[:2])
    g_b, f_b = grads(toks[2:])
    g_mean = jax.tree.map(lambda a, b: (a + b) / 2, g_a, g_b)
    u, _ = jax.jit(tx.update)(g_mean, tx.init(state.params), state.params)
    params_ref = optax.apply_updates(state.params, u)
    new2, m2 = upd(state, 2)
    for a, b in zip(jax.tree.leaves(new2.params), jax.tree.leaves(params_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    for got, a, b in zip(jax.tree.leaves(new2.fp8), jax.tree.leaves(f_a), jax.tree.leaves(f_b)):
        np.testing.assert_array_equal(np.asarray(got), np.maximum(np.asarray(a), np.asarray(b)))
    # The new state is the updated history: this step's amax in front, scale from it.
    st = jax.tree.leaves(new2.fp8, is_leaf=lambda x: isinstance(x, scaling.DelayedState))
    hist = [np.asarray(s.amax_history) for s in st if isinstance(s, scaling.DelayedState)]
    assert hist and all(h[0] > 0 and np.all(h[1:] == 0) for h in hist)
    assert int(new2.step) == 1 and np.isfinite(float(m2["loss"]))


def test_clipping_leaves_fp8_state_alone_and_unused_state_is_kept():
    recipe = fp8jax.recipes.hybrid_delayed()
    graphdef, state, tx, _ = _setup(recipe, clip=1e-6)
    toks = _tokens()
    step = make_train_step(graphdef, tx, loss_fn, donate=False)
    new, m = step(state, toks)

    def f(params, fp8):
        return loss_fn(nnx.merge(graphdef, params, fp8, state.bias, state.rest), toks)[0]

    _, g_fp8 = jax.jit(jax.grad(f, argnums=(0, 1)))(state.params, state.fp8)
    # FP8 state == its gradient exactly, although Param grads were clipped to 1e-6.
    for a, b in zip(jax.tree.leaves(new.fp8), jax.tree.leaves(g_fp8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m["grad_norm"]) > 1e-3
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))
    )
    # Adam normalizes the clipped gradient, so the step is ~lr; the clip must not zero it.
    assert 0 < moved <= 1.1e-2

    # A GEMM that did not run gets a zero cotangent: keep its old state.
    from fp8jax.train.step import _keep_unused

    zeros = jax.tree.map(jnp.zeros_like, new.fp8)
    kept = _keep_unused(zeros, new.fp8)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(new.fp8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # ~20 s of compilation; experiment-only knobs
def test_stress_knobs_reset_and_shrink_the_delayed_state():
    recipe = fp8jax.recipes.hybrid_delayed()
    graphdef, state, tx, _ = _setup(recipe)
    fresh = jax.tree.map(jnp.copy, state.fp8)
    toks = _tokens()
    plain, _ = make_train_step(graphdef, tx, loss_fn, donate=False)(state, toks)
    grow = fp8_state_stress(fresh, inject_block(fp8_amax_growth=4.0))
    grown, _ = make_train_step(graphdef, tx, loss_fn, fp8_update=grow, donate=False)(state, toks)
    for a, b in zip(jax.tree.leaves(grown.fp8), jax.tree.leaves(plain.fp8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b) / np.float32(4.0))
    every = fp8_state_stress(fresh, inject_block(fp8_reset_every=1))
    reset, _ = make_train_step(graphdef, tx, loss_fn, fp8_update=every, donate=False)(state, toks)
    for a, b in zip(jax.tree.leaves(reset.fp8), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _ref_bias(bias, load, rate):
    b = np.asarray(bias, np.float64)
    lo = np.asarray(load, np.float64)
    return b + rate * np.sign(lo.mean(-1, keepdims=True) - lo)


def test_router_bias_update():
    from fp8jax.models import update_router_bias

    load = jnp.asarray([[5.0, 1.0, 3.0, 3.0], [0.0, 0.0, 8.0, 4.0]])
    one = {"b": jnp.zeros((2, 4), jnp.float32)}
    out = update_bias_state(one, load, 0.01, update_router_bias)
    np.testing.assert_allclose(
        np.asarray(out["b"]), _ref_bias(np.zeros((2, 4)), load, 0.01), rtol=1e-6
    )
    with pytest.raises(ValueError, match="do not match"):
        update_bias_state({"b": jnp.zeros((3, 4))}, load, 0.1, update_router_bias)


def test_step_updates_router_bias_from_summed_load():
    from fp8jax.models import update_router_bias

    graphdef, state, tx, _ = _setup(fp8jax.recipes.bf16())
    toks = _tokens(4, 16, seed=3)
    step = make_train_step(
        graphdef,
        tx,
        loss_fn,
        microbatches=2,
        bias_rate=0.1,
        update_bias_fn=update_router_bias,
        donate=False,
    )
    new, _ = step(state, toks)
    load = np.eye(4)[np.asarray(toks) % 4].sum((0, 1))[None]
    np.testing.assert_allclose(
        np.asarray(jax.tree.leaves(new.bias)[0]), _ref_bias(np.zeros((1, 4)), load, 0.1), rtol=1e-6
    )


@pytest.mark.parametrize("jit_off", [False, True])
def test_finite_flag_is_false_exactly_when_loss_or_grad_norm_is_not_finite(jit_off):
    graphdef, state, tx, _ = _setup(fp8jax.recipes.bf16())
    step = make_train_step(graphdef, tx, loss_fn, donate=False)
    with jax.disable_jit(jit_off):
        _, m = step(state, _tokens())
        assert bool(m["finite"]) and np.isfinite(float(m["loss"]))
        # A NaN in the first element of every weight: loss and gradient norm become NaN.
        nan_first = lambda p: p.at[(0,) * p.ndim].set(jnp.nan)  # noqa: E731
        bad = state._replace(params=jax.tree.map(nan_first, state.params))
        _, m = step(bad, jnp.zeros((4, 16), jnp.int32))
        assert not bool(m["finite"])
        assert not (np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"])))


def test_site_telemetry_combines_microbatches_per_statistic():
    aux = {
        "layer0/ffn/w2/x": {
            "amax": jnp.array([1.0, 3.0]),
            "saturated": jnp.array([0.0, 0.5]),
            "flushed": jnp.array([0.25, 0.25]),
        },
        "layer0/ffn/swiglu": {
            "outlier_ratio": jnp.array([4.0, 2.0]),
            "align_max": jnp.array([0.5, 0.5]),
            "align_mean": jnp.array([0.1, 0.3]),
        },
        "layer1/moe/tokens": {"count": jnp.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]])},
    }
    got = {k: float(v) for k, v in step_lib.site_telemetry(aux).items()}
    assert got == pytest.approx(
        {
            "layers/layer0/ffn/w2/x/amax": 3.0,
            "layers/layer0/ffn/w2/x/saturated": 0.25,
            "layers/layer0/ffn/w2/x/flushed": 0.25,
            "layers/layer0/ffn/swiglu/outlier_ratio": 4.0,
            "layers/layer0/ffn/swiglu/align_max": 0.5,
            "layers/layer0/ffn/swiglu/align_mean": 0.2,
            "layers/layer1/moe/tokens/count/0": 4.0,
            "layers/layer1/moe/tokens/count/1": 2.0,
            "layers/layer1/moe/tokens/count/2": 1.0,
        }
    )


def test_block_format_gradient_noise_reaches_the_next_steps_metrics():
    graphdef, state, tx, sched = _setup(fp8jax.recipes.mxfp8())
    step = make_train_step(graphdef, tx, loss_fn, microbatches=2, schedule=sched, donate=False)
    s1, m1 = step(state, _tokens())
    assert np.isnan(float(m1["layers/l2/dy/noise_ratio"]))  # nothing measured before step 1
    pair = np.asarray(s1.fp8["l2"]["grad_noise"].get_value())
    assert pair[0] > pair[1] > 0  # merged over microbatches: the largest norms
    _, m2 = step(s1, _tokens(seed=1))
    np.testing.assert_allclose(float(m2["layers/l2/dy/noise_ratio"]), pair[0] / pair[1], rtol=1e-6)
