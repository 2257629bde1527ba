# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 -- Below 8 bits: MXFP8 and NVFP4 on real tensors, and the Hadamard transform
#
# Blackwell GPUs multiply two block-scaled formats natively:
#
# * **MXFP8** (OCP MX v1.0): E4M3 elements, one power-of-two E8M0 scale per
#   32 elements along the contraction axis;
# * **NVFP4**: E2M1 elements (values 0, 0.5, 1, 1.5, 2, 3, 4, 6), one E4M3
#   scale per 16 elements and a float32 scale per tensor.  NVIDIA's training
#   recipe adds 16x16 blocks for weights, a 16-point random Hadamard
#   transform (RHT) on the two Wgrad operands and stochastic rounding (SR)
#   for gradients.
#
# This notebook takes one activation and one gradient tensor from the tiny
# MoE model after a few training steps and measures what each format does to
# them, next to DeepSeek-V3's 1x128 E4M3 tiles; then it shows what the RHT
# does to a 16-element block holding an outlier.  Everything runs as the
# exact emulation of `fp8jax.microscaling` (bit-exact against a numpy
# reference written from the specifications).
# `FP8JAX_NOTEBOOK_SMALL=1` (the tests) trains 3 steps on synthetic data.

# %%
import io
import os
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import fp8jax
from fp8jax import blockscaled, hadamard, microscaling
from fp8jax.models import cross_entropy
from fp8jax.train.checkpoint import Checkpointer
from fp8jax.train.defaults import config_file
from fp8jax.train.loop import setup, train, train_loss_key

# fp8jax.train's comparison module selects Agg when imported; in a notebook
# kernel switch back to the inline backend so that plt.show() stores the figures.
if "ipykernel" in sys.modules:
    from IPython import get_ipython

    get_ipython().run_line_magic("matplotlib", "inline")

SMALL = os.environ.get("FP8JAX_NOTEBOOK_SMALL") == "1"
REPO = Path(fp8jax.__file__).resolve().parents[1]


cfg = config_file(REPO / "configs" / "tiny.py")
cfg.tensorboard = False
cfg.recipe = "bf16"  # the tensors a high-precision run produces
if SMALL:
    cfg.steps, cfg.batch_size, cfg.seq_len = 3, 2, 32
    cfg.warmup_steps, cfg.log_every, cfg.eval_every = 1, 1, 0
    cfg.eval_batches, cfg.eval_batch_size = 1, 2
    cfg.data.source = "synthetic"
else:
    cfg.steps, cfg.batch_size, cfg.seq_len = 60, 8, 64
    cfg.data.max_bytes = 4_000_000
workdir = Path(tempfile.mkdtemp(prefix="fp8jax_nb05_"))
summary = train(cfg, workdir, stream=io.StringIO())
key = train_loss_key(summary)
print(f"trained {cfg.steps} steps: {key} {summary[key]:.3f}")

# %% [markdown]
# ## One activation and one gradient
#
# The activation is the input of the first block's FFN (after its RMSNorm):
# the x operand of the FFN's Fprop and Wgrad GEMMs.  The gradient is
# dL/dy at that FFN's output: the dy operand of its down projection's Dgrad
# and Wgrad.  Both are [tokens, d_model]; the forward below replays the
# model's own modules (`MoETransformer.__call__`) to reach them.

# %%
# The run's model, state template and corpus (setup builds them without training),
# then the trained state from the run's last checkpoint.
run = setup(cfg, workdir)
ckpt = Checkpointer(workdir)
state = ckpt.restore(run.state)
ckpt.close()
model = nnx.merge(run.graphdef, state.params, state.fp8, state.bias, state.rest)
corpus = run.corpus
rng = np.random.default_rng(0)
starts = rng.integers(0, len(corpus.train) - cfg.seq_len - 1, cfg.batch_size)
tokens = jnp.asarray(np.stack([corpus.train[s : s + cfg.seq_len] for s in starts]), jnp.int32)

blk0 = model.blocks[0]
mcfg = model.cfg
x0 = model.embed[...][tokens].astype(mcfg.dtype)
# Residual adds in float32, one rounding back, as in Block.__call__.
x1 = (x0.astype(jnp.float32) + blk0.attn(blk0.attn_norm(x0)).astype(jnp.float32)).astype(x0.dtype)
h = blk0.ffn_norm(x1)
y = blk0.ffn(h)


def loss_from_ffn_output(model, y_out):
    """The loss as a function of the first block's FFN output (rest of the model replayed)."""
    x = (x1.astype(jnp.float32) + y_out.astype(jnp.float32)).astype(x1.dtype)
    bias = model.router_bias.get_value()
    for i, blk in enumerate(model.blocks[1:], start=1):
        j = i - mcfg.n_dense_layers
        x, _ = blk(x, bias[j] if j >= 0 else None)
    logits = jnp.dot(
        model.final_norm(x).astype(jnp.float32),
        model.head[...].astype(jnp.float32),
        precision=jax.lax.DotAlgorithmPreset.F32_F32_F32,
    )
    return cross_entropy(logits, tokens)


# nnx.grad: the model is an argument (its modules may not be mutated under a JAX trace).
dy = nnx.grad(loss_from_ffn_output, argnums=1)(model, y.astype(jnp.float32))
act = np.asarray(h, np.float32).reshape(-1, mcfg.d_model)
grad = np.asarray(dy, np.float32).reshape(-1, mcfg.d_model)
print(
    f"activation {act.shape}: |x| max {np.abs(act).max():.3g}, rms {np.sqrt((act**2).mean()):.3g}"
)
print(
    f"gradient   {grad.shape}: |g| max {np.abs(grad).max():.3g}, rms {np.sqrt((grad**2).mean()):.3g}"
)

# %% [markdown]
# ## Error of each format
#
# Each tensor is quantized along the axis it is contracted over in Fprop /
# Dgrad (features, the last axis) and dequantized; the table gives the
# relative error over the whole tensor (norm of the error / norm of the
# tensor) and the median over tokens of each token's relative error.
# `NVFP4 + SR` uses stochastic rounding: each value's rounding is unbiased,
# at the price of a larger error per draw.


# %%
def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def token_median(a, b):
    num = np.linalg.norm(a - b, axis=-1)
    den = np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
    return float(np.median(num / den))


FORMATS = {
    "E4M3 1x128 (deepseek_v3)": lambda t, ax, key: fp8jax.dequantize(
        fp8jax.quantize(t, fp8jax.E4M3, "tile", axis=ax)
    ),
    "MXFP8 1x32": lambda t, ax, key: microscaling.fake_quantize(t, "mxfp8", ax),
    "NVFP4 1x16": lambda t, ax, key: microscaling.fake_quantize(t, "nvfp4", ax),
    "NVFP4 1x16 + SR": lambda t, ax, key: microscaling.fake_quantize(t, "nvfp4", ax, key=key),
}
errors = {}
for tname, t in (("activation", act), ("gradient", grad)):
    for fname, f in FORMATS.items():
        deq = np.asarray(f(jnp.asarray(t), -1, jax.random.key(0)), np.float32)
        errors[tname, fname] = (rel(deq, t), token_median(deq, t))
print(f"{'tensor':>10s} {'format':>26s} {'rel err':>9s} {'token median':>12s}")
for (tname, fname), (e, m) in errors.items():
    print(f"{tname:>10s} {fname:>26s} {e:9.2e} {m:12.2e}")

# Four mantissa bits fewer cost about 2^3 in error: MXFP8 and the E4M3 tiles
# are close to each other, NVFP4 an order of magnitude above.
for tname in ("activation", "gradient"):
    assert errors[tname, "MXFP8 1x32"][0] < 0.05
    assert errors[tname, "NVFP4 1x16"][0] > 3 * errors[tname, "MXFP8 1x32"][0]
    assert errors[tname, "NVFP4 1x16 + SR"][0] > errors[tname, "NVFP4 1x16"][0]

# %% [markdown]
# ## Wgrad: dW = x^T dy over tokens, with and without the Hadamard transform
#
# For Wgrad the contraction axis is the token axis, so both operands are
# quantized in 16x1 blocks along tokens.  With the RHT both are first
# transformed along tokens with the same random signs (the transform cancels
# in the product); the error is that of the product against float64.

# %%
signs = hadamard.random_signs(0)


def wgrad(a, b, kind, use_rht, key=None):
    a, b = jnp.asarray(a), jnp.asarray(b)
    if use_rht:
        a, b = blockscaled.hadamard_pair(a, 0, b, 0, seed=0)
    qa = microscaling.fake_quantize(a, kind, 0)
    qb = microscaling.fake_quantize(b, kind, 0, key=key)
    return np.asarray(qa, np.float64).T @ np.asarray(qb, np.float64)


dw_exact = act.astype(np.float64).T @ grad.astype(np.float64)
wgrad_err = {
    "MXFP8": rel(wgrad(act, grad, "mxfp8", False), dw_exact),
    "NVFP4": rel(wgrad(act, grad, "nvfp4", False), dw_exact),
    "NVFP4 + RHT": rel(wgrad(act, grad, "nvfp4", True), dw_exact),
    "NVFP4 + RHT + SR(dy)": rel(wgrad(act, grad, "nvfp4", True, jax.random.key(1)), dw_exact),
}
for name, e in wgrad_err.items():
    print(f"Wgrad {name:>22s}: relative error {e:.3e}")
assert wgrad_err["MXFP8"] < wgrad_err["NVFP4"]

# %% [markdown]
# ## A block with an outlier
#
# Within a 16-element NVFP4 block the largest value maps to 6; a value 50x
# larger than the others leaves them below 6 / 50 = 0.12 of the E2M1 range,
# under half its smallest step (0.5): they all quantize to zero.  The RHT
# spreads the outlier over all 16 elements (each gets +-outlier / 4 plus a
# mix of the others), so the transformed block has no outlier left (its
# max / median drops to about 1).  The error is measured after undoing the
# transform (the inverse is exact up to float32 rounding).

# %%
block = act[0, :16].astype(np.float32).copy()
block[5] = 50 * np.abs(block).max()  # the outlier
qb_plain = np.asarray(microscaling.fake_quantize(jnp.asarray(block), "nvfp4"), np.float32)
t = hadamard.rht(jnp.asarray(block), signs)
qt = microscaling.fake_quantize(t, "nvfp4")
qb_rht = np.asarray(hadamard.inverse_rht(qt, signs), np.float32)
others = np.arange(16) != 5
crest_before = np.abs(block).max() / np.median(np.abs(block))
crest_after = float(np.abs(t).max() / np.median(np.abs(t)))
print(f"outlier block: |max| / median |x| = {crest_before:.0f}; after the RHT {crest_after:.2f}")
print(
    f"block error: plain {rel(qb_plain, block):.3f}, with RHT {rel(qb_rht, block):.3f}; "
    f"on the 15 ordinary values: plain {rel(qb_plain[others], block[others]):.3f}, "
    f"with RHT {rel(qb_rht[others], block[others]):.3f}"
)
assert np.all(qb_plain[others] == 0)  # crushed to zero without the transform
assert crest_after < 2 < crest_before / 10
np.testing.assert_allclose(
    np.asarray(hadamard.inverse_rht(t, signs)), block, rtol=1e-6, atol=1e-6 * np.abs(block).max()
)

fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
idx = np.arange(16)
axes[0].bar(idx - 0.2, block, 0.4, label="block")
axes[0].bar(idx + 0.2, qb_plain, 0.4, label="NVFP4")
axes[0].set(title="plain NVFP4: the outlier takes the range", xlabel="element")
axes[1].bar(idx, np.asarray(t), 0.6, color="C2")
axes[1].set(title="after the RHT: the outlier is spread", xlabel="element")
axes[2].bar(idx - 0.2, block * others, 0.4, label="block (outlier hidden)")
axes[2].bar(idx + 0.2, qb_rht * others, 0.4, label="NVFP4 with RHT, inverted")
axes[2].set(title="the 15 ordinary values", xlabel="element")
for ax in axes:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Does the spreading lower the error?  Outlier ratio sweep
#
# Blocks of the activation tensor (16 consecutive features of a token), one
# element raised to r times the block's max: relative error of the whole
# block and of its 15 ordinary values, plain NVFP4 versus RHT + NVFP4 +
# inverse RHT.

# %%
blocks = act.reshape(-1, 16)  # d_model is a multiple of 16
sweep = {}
for r in (1, 3, 10, 30, 100, 1000):
    b = blocks.copy()
    b[:, 5] = r * np.abs(b).max(axis=1)
    qp = np.asarray(microscaling.fake_quantize(jnp.asarray(b), "nvfp4"))
    qr = microscaling.fake_quantize(hadamard.rht(jnp.asarray(b), signs), "nvfp4")
    qr = np.asarray(hadamard.inverse_rht(qr, signs))
    sweep[r] = (
        rel(qp, b),
        rel(qr, b),
        rel(qp[:, others], b[:, others]),
        rel(qr[:, others], b[:, others]),
    )
print(f"{'r':>6s} {'block plain':>11s} {'block RHT':>9s} {'others plain':>12s} {'others RHT':>10s}")
for r, (bp, br, op, orr) in sweep.items():
    print(f"{r:6d} {bp:11.3f} {br:9.3f} {op:12.3f} {orr:10.3f}")
# Large outliers crush the ordinary values to zero without the transform.
assert sweep[1000][2] > 0.99

# %% [markdown]
# Reading the numbers (the full run): MXFP8 and 1x128 E4M3 tiles lose a few
# percent of a tensor's norm, NVFP4 roughly 3-4x more; stochastic rounding
# adds error per draw (it removes bias, which matters when many small
# gradient contributions accumulate over steps, not within one GEMM).
#
# The RHT does what it is meant to do to a block's shape (no outlier is left
# after it), but in this emulation it does not lower the error of a single
# block's reconstruction, nor of this small model's Wgrad product: once the
# outlier is spread, every element carries a share of its quantization error,
# and that error, at E2M1's relative precision, is as large as what plain
# NVFP4 loses by zeroing the small values.  Its benefit in NVIDIA's runs is a
# training-level effect on large models; whether it shows at this scale is
# the question of `configs/compare/below8.py`.
