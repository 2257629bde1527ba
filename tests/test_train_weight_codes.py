"""GEMM weights quantized once per step: the GEMMs' codes, straight-through gradients, and a
microbatched step that quantizes them before its loop with the same bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import fp8jax
from fp8jax.models import ModelConfig, MoETransformer, loss_fn
from fp8jax.parallel import fsdp
from fp8jax.parallel.fsdp import kernel_layouts
from fp8jax.train import weight_codes
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import create_train_state
from fp8jax.train.step import make_train_step

E4M3 = ml_dtypes.float8_e4m3fn


def _model(recipe: str):
    cfg = ModelConfig.tiny(n_layers=2, d_model=64, vocab_size=256, max_seq_len=16)
    return MoETransformer(cfg, fp8jax.registry.get(recipe), rngs=nnx.Rngs(0))


def _block_codes_f64(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes as float64, scales) of a 2-d ``w`` in 128x128 blocks: amax / 448 per
    block (float32 division), codes the saturating E4M3 rounding of w / scale."""
    k, n = w.shape
    bk, bn = -(-k // 128), -(-n // 128)
    scales = np.ones((bk, bn), np.float32)
    codes = np.zeros((k, n), np.float64)
    for i in range(bk):
        for j in range(bn):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].astype(np.float64)
            amax = np.max(np.abs(blk))
            s = np.float32(np.float32(amax) / np.float32(448.0)) if amax > 0 else np.float32(1)
            scales[i, j] = s
            q = np.clip(blk / np.float64(s), -448, 448).astype(E4M3).astype(np.float64)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = q
    return codes, scales


def test_quantize_weights_names_every_block_weight_in_its_gemm_layout():
    model = _model("deepseek_v3")
    params = nnx.state(model, nnx.Param)
    layouts = kernel_layouts(model)
    codes = weight_codes.quantize_weights(params, layouts)
    # Every Dense kernel and routed expert weight the recipe quantizes in blocks.
    assert set(codes) == {k for k, lay in layouts.items() if lay.spec.granularity == "block"}
    assert any(lay.routed for k, lay in layouts.items() if k in codes)
    flat = {fsdp.param_keys(p): w for p, w in jax.tree_util.tree_leaves_with_path(params)}
    for keys, q in codes.items():
        w = np.asarray(flat[keys])
        lay = layouts[keys]
        assert q.shape == lay.gemm_shape(w.shape) and q.granularity == "block"
        if not lay.routed:
            want_codes, want_scales = _block_codes_f64(w.reshape(q.shape))
            np.testing.assert_array_equal(np.asarray(q.data).astype(np.float64), want_codes)
            np.testing.assert_array_equal(np.asarray(q.scale), want_scales)


def test_quantize_weights_leaves_delayed_and_unquantized_weights_alone():
    for recipe in ("hybrid_delayed", "bf16"):
        model = _model(recipe)
        params = nnx.state(model, nnx.Param)
        assert weight_codes.quantize_weights(params, kernel_layouts(model)) == {}


@pytest.mark.parametrize("jit", [False, True])
def test_with_codes_gradient_is_the_gemms_gradient_of_the_weight(jit):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 192)) * 0.05, jnp.float32)
    c = jnp.asarray(rng.standard_normal((64, 192)), jnp.float32)
    recipe = fp8jax.registry.get("deepseek_v3")
    layouts = {("w",): fsdp.KernelLayout(1, recipe.fprop.rhs)}
    dims = (((1,), (0,)), ((), ()))

    def loss(params, cached):
        wq = weight_codes.with_codes(params, cached)["w"]
        return jnp.sum(fp8jax.dot_general(x, wq, dims, recipe=recipe) * c)

    def plain(params):
        return jnp.sum(fp8jax.dot_general(x, params["w"], dims, recipe=recipe) * c)

    cached = weight_codes.quantize_weights({"w": w}, layouts)
    grad, ref = jax.grad(loss), jax.grad(plain)
    if jit:
        grad, ref = jax.jit(grad), jax.jit(ref)
    g, r = grad({"w": w}, cached)["w"], ref({"w": w})["w"]
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def _top_level_quantizations(jaxpr) -> int:
    return sum(
        1
        for e in jaxpr.eqns
        if e.primitive.name in ("pjit", "jit") and e.params.get("name") == "_quantize_online"
    )


def test_microbatched_step_quantizes_weights_once_with_the_same_bits():
    model = _model("deepseek_v3")
    n_block = sum(lay.spec.granularity == "block" for lay in kernel_layouts(model).values())
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=10, warmup_steps=0)
    graphdef, state = create_train_state(model, tx)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 16)), jnp.int32)
    out, outer = {}, {}
    for once in (True, False):
        step = make_train_step(
            graphdef, tx, loss_fn, microbatches=2, donate=False, weights_once=once
        )
        jaxpr = jax.make_jaxpr(step)(state, toks).jaxpr.eqns[0].params["jaxpr"].jaxpr
        outer[once] = _top_level_quantizations(jaxpr)
        out[once] = step(state, toks)
    # Before the microbatch loop: one quantization per block weight, or none.
    assert outer == {True: n_block, False: 0}
    (new_a, m_a), (new_b, m_b) = out[True], out[False]
    for a, b in zip(jax.tree.leaves(new_a.params), jax.tree.leaves(new_b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Every metric, telemetry included: the weights' own values reach it.
    assert set(m_a) == set(m_b)
    for k in m_a:
        np.testing.assert_array_equal(np.asarray(m_a[k]), np.asarray(m_b[k]), err_msg=k)
