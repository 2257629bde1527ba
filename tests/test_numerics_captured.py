"""Captured GEMM operands: a Dense layer's x, w and dy are exactly what went in and came
back; every site of a tiny MoE model has consistent shapes and expert row counts; a
trained run's last checkpoint is restored and captured; a directory without a run is
refused in one line."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_loop import _fast

import fp8jax
from fp8jax.models import MoETransformer, loss_fn
from fp8jax.models.config import ModelConfig
from fp8jax.nn.dense import Dense
from fp8jax.numerics.captured import tap_gemms, trained_run_operands
from fp8jax.train.defaults import ConfigError
from fp8jax.train.loop import train


@pytest.mark.parametrize("use_jit", [False, True])
def test_dense_site_records_its_input_kernel_and_output_gradient(use_jit):
    layer = Dense(
        (4, 8), 16, recipe=fp8jax.recipes.fp32(), axis=(-2, -1), dtype=jnp.float32, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4, 8)).astype(np.float32)
    g = rng.standard_normal((3, 5, 16)).astype(np.float32)
    graph, params, rest = nnx.split(layer, nnx.Param, ...)

    def f(p, x):
        return jnp.sum(nnx.merge(graph, p, rest)(x) * g)

    grad = jax.grad(f)
    with tap_gemms() as sites:
        jax.block_until_ready((jax.jit(grad) if use_jit else grad)(params, jnp.asarray(x)))
        jax.effects_barrier()
    assert list(sites) == ["dense0"]
    s = sites["dense0"]
    np.testing.assert_array_equal(s.x, x.reshape(15, 32))
    np.testing.assert_array_equal(s.w, np.asarray(layer.kernel[...]).reshape(32, 16))
    np.testing.assert_array_equal(s.dy, g.reshape(15, 16))
    # The hook closes with the block: nothing is recorded afterwards.
    jax.grad(f)(params, jnp.asarray(x))
    assert list(sites) == ["dense0"]


def test_moe_sites_have_consistent_shapes_and_expert_rows():
    mcfg = ModelConfig.tiny()
    model = MoETransformer(mcfg, fp8jax.recipes.bf16(), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return loss_fn(nnx.merge(graph, p, rest), tokens)[0]

    with tap_gemms() as sites:
        jax.block_until_ready(jax.jit(jax.grad(loss))(params))
        jax.effects_barrier()
    experts = [s for s in sites.values() if s.scope == "expert"]
    assert experts and any(s.scope == "dense" for s in sites.values())
    for s in sites.values():
        assert s.x.shape[1] == s.w.shape[-2]
        assert s.dy.shape == (s.x.shape[0], s.w.shape[-1])
        assert np.isfinite(s.dy).all() and np.abs(s.dy).max() > 0
    for s in experts:
        assert s.w.shape[0] == mcfg.n_routed_experts
        assert s.group_sizes.sum() == 2 * 16 * mcfg.top_k
        e = s.busiest_expert()
        x, w, dy = s.expert(e)
        assert x.shape[0] == dy.shape[0] == s.group_sizes.max()
        np.testing.assert_array_equal(w, s.w[e])
        # A site's representative GEMM: its busiest expert.
        for got, want in zip(s.operands(), (x, w, dy)):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="dense site"):
        next(s for s in sites.values() if s.scope == "dense").expert(0)


@pytest.mark.slow  # a whole (short) training run first: about a minute on 2 CPU cores
def test_trained_run_is_restored_and_captured(tmp_path):
    # The training loop tests' run (its compiled step is shared within a process).
    c = _fast()
    train(c, tmp_path / "run", stream=io.StringIO())
    sites, cfg = trained_run_operands(tmp_path / "run", batch_size=3)
    assert cfg.steps == c.steps
    assert sites["dense0"].x.shape == (3 * 32, ModelConfig.tiny().d_model)
    with pytest.raises(ConfigError, match="config.json"):
        trained_run_operands(tmp_path / "nothing")
