"""Smooth-SwiGLU and the SwiGLU monitors of the feed-forward blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fp8jax import recipes, registry
from fp8jax.models import ModelConfig, MoETransformer
from fp8jax.models.moe import SwiGLU, smooth_swiglu_scales
from fp8jax.nn.recording import capture

CFG = ModelConfig.tiny(max_seq_len=16, d_model=32, d_ff=64, d_expert=32, n_routed_experts=4)


def _outlier_h(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((48, 40)).astype(np.float32)
    h[:, 7] *= 3.0e4  # one outlier channel
    h[:, 9] = 0.0  # and one that is all zero
    return h


@pytest.mark.parametrize("jit", [False, True])
def test_smooth_scales_put_every_channel_in_one_octave_and_fold_exactly(jit):
    h = _outlier_h()
    f = jax.jit(smooth_swiglu_scales) if jit else smooth_swiglu_scales
    a = np.asarray(f(jnp.asarray(h)), np.float64)
    amax = np.abs(h.astype(np.float64)).max(axis=0)
    want = np.where(amax > 0, np.exp2(np.floor(np.log2(np.where(amax > 0, amax, 1.0)))), 1.0)
    np.testing.assert_array_equal(a, want)
    scaled = np.abs(h / a).max(axis=0)
    assert np.all((scaled[amax > 0] >= 1) & (scaled[amax > 0] < 2))
    # Folded into the down-projection: the product is the same in float64, bit for bit.
    w = np.random.default_rng(1).standard_normal((40, 24))
    np.testing.assert_array_equal((h / a) @ (a[:, None] * w), h.astype(np.float64) @ w)


def test_smooth_scales_per_expert_rows():
    h = _outlier_h(2)[:30]
    seg = np.repeat(np.array([0, 2]), [10, 20]).astype(np.int32)
    a = np.asarray(smooth_swiglu_scales(jnp.asarray(h), jnp.asarray(seg), 3))
    assert a.shape == (3, 40)
    np.testing.assert_array_equal(a[1], 1.0)  # expert 1 has no rows
    for e, rows in ((0, slice(0, 10)), (2, slice(10, 30))):
        amax = np.abs(h[rows]).max(axis=0)
        want = np.where(amax > 0, np.exp2(np.floor(np.log2(np.where(amax > 0, amax, 1.0)))), 1.0)
        np.testing.assert_array_equal(a[e], want)


def _aligned_swiglu(cfg, recipe, gain=40.0):
    """A SwiGLU whose channel 5 has equal gate and up columns scaled by ``gain``."""
    layer = SwiGLU(cfg, recipe, cfg.d_ff, name="ffn", rngs=nnx.Rngs(0))
    k = np.array(layer.w13.kernel[...])
    k[:, 0, 5] = k[:, 1, 5] = gain * k[:, 0, 5]
    layer.w13.kernel.set_value(jnp.asarray(k))
    return layer


@pytest.mark.parametrize(
    "name", ["bf16", "current_tensor", pytest.param("deepseek_v3", marks=pytest.mark.slow)]
)
def test_smooth_swiglu_same_function_and_bounded_quantized_input(name):
    recipe = registry.get(name)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 16, CFG.d_model)), CFG.dtype)
    out, stats = {}, {}
    for smooth in (False, True):
        gdef, state = nnx.split(_aligned_swiglu(CFG.replace(smooth_swiglu=smooth), recipe))

        def run(x, gdef=gdef, state=state):
            (y, st), vjp = jax.vjp(lambda x: capture(nnx.merge(gdef, state), x), x)
            (dx,) = vjp((y * 2, jax.tree.map(jnp.zeros_like, st)))
            return y, st, dx

        y, st, dx = jax.jit(run)(x)
        out[smooth], stats[smooth] = (np.asarray(y, np.float32), np.asarray(dx, np.float32)), st
    # The monitor sees the outlier channel either way: gate * up is quadratic in it.
    assert float(stats[False]["ffn/swiglu"]["outlier_ratio"]) > 1e3
    assert float(stats[False]["ffn/swiglu"]["align_max"]) > 0.999
    # The quantized down-projection's input: one outlier channel without, amax < 2 with.
    assert float(stats[False]["ffn/w2/x"]["amax"]) > 1e3
    assert float(stats[True]["ffn/w2/x"]["amax"]) < 2.0
    if name == "bf16":
        # Powers of two fold exactly: the same outputs and gradients bit for bit.
        np.testing.assert_array_equal(out[True][0], out[False][0])
        np.testing.assert_array_equal(out[True][1], out[False][1])
    else:
        y0, y1 = out[False][0], out[True][0]
        assert np.linalg.norm(y1 - y0) < 0.1 * np.linalg.norm(y0)


def test_smooth_swiglu_model_unchanged_with_bf16_and_monitors_sown():
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 16)), jnp.int32)
    logits = {}
    for smooth in (False, True):
        model = MoETransformer(CFG.replace(smooth_swiglu=smooth), recipes.bf16(), rngs=nnx.Rngs(0))
        gdef, state = nnx.split(model)
        logits[smooth], aux = jax.jit(lambda t, gdef=gdef, state=state: nnx.merge(gdef, state)(t))(
            tokens
        )
    np.testing.assert_array_equal(np.asarray(logits[True]), np.asarray(logits[False]))
    for key in ("layer0/ffn/swiglu", "layer1/moe/shared/swiglu", "layer1/moe/experts/swiglu"):
        m = aux["fp8"][key]
        assert set(m) == {"outlier_ratio", "align_max", "align_mean"}
        assert np.isfinite(float(m["outlier_ratio"])) and float(m["outlier_ratio"]) >= 1.0
        assert 0.0 <= float(m["align_mean"]) <= float(m["align_max"]) <= 1.0
