# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 - Why DeepSeek-V3 promotes FP8 partial sums to FP32
#
# DeepSeek-V3 (arXiv 2412.19437, sec. 3.3.2) reports that Hopper tensor cores keep
# only about 14 bits while accumulating FP8 products: for K = 4096 the maximum
# relative error of a GEMM "reaches nearly 2%". Their fix: every N_C = 128 elements
# of K, copy the partial sum to FP32 registers on the CUDA cores, multiply in the
# scales of that stretch of K, and add it there.
#
# `fp8jax.accumulate.emulated_gemm` is a bit-exact model of that tensor core
# (Fasi et al. 2021; Khattak and Mikaitis 2026). It works on the FP8 codes, not on
# scaled values: each product's exponent is e_a + e_b (a subnormal code counts at
# the format's minimum normal exponent); blocks of 32 products plus the running
# chain accumulator are aligned to the largest exponent, each term truncated toward
# zero to 13 fraction bits below it, summed exactly, and the block result truncated
# to 13 bits. A chain ends wherever the scales change or a promotion is due; then
# its value times s_a * s_b is added to an FP32 accumulator.
#
# The study helpers live in `fp8jax.numerics.accumulation_study`.
# Set `FP8JAX_NOTEBOOK_SMALL=1` to shrink every size (the test suite runs it so).

# %%
import os
import sys

import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules:
    # Scripts and tests have no display; a Jupyter kernel keeps its inline backend.
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fp8jax.accumulate import emulated_gemm  # noqa: E402
from fp8jax.formats import E4M3  # noqa: E402
from fp8jax.numerics import accumulation_study as study  # noqa: E402
from fp8jax.recipes import Accumulation  # noqa: E402

SMALL = os.environ.get("FP8JAX_NOTEBOOK_SMALL", "0") == "1"
if SMALL:
    M = N = 4
    KS = [128, 512]
    K_BITS = 512
    BITS = [10, 23]
    TIME_SHAPE = (32, 256, 32)
else:
    M = N = 16
    KS = [256, 512, 1024, 2048, 4096, 8192]
    K_BITS = 4096
    BITS = [10, 13, 16, 19, 23]
    TIME_SHAPE = (256, 1024, 256)
DISTS = list(study.DISTRIBUTIONS)
HOPPER = Accumulation()  # block 32, 13 fraction bits, promote every 128
NO_PROMOTION = Accumulation(promote_every=None)
print(f"small={SMALL}  M=N={M}  K in {KS}  distributions {DISTS}")

# %% [markdown]
# ## The model on a hand-made example
#
# One product 256 x 256 = 2^16 (exponent 8 + 8) and 31 products 1 x 1, in one
# block of 32. The block aligns at exponent 16: with 13 fraction bits the quantum
# is 2^3 = 8, and every 1 is truncated to 0 -- *absorbed*. Make the big product
# 32 x 64 = 2^11 and the quantum is 1/4: the ones survive. Scales play no part in
# this: they are applied after the chain, outside the tensor core.

# %%
ones_scale_a = jnp.ones((1, 1, 1), jnp.float32)
ones_scale_b = jnp.ones((1, 1, 1), jnp.float32)
for big_a, big_b in ((256.0, 256.0), (32.0, 64.0)):
    a = jnp.asarray([[[big_a] + [1.0] * 31]]).astype(E4M3)
    b = jnp.asarray([[[big_b]] + [[1.0]] * 31]).astype(E4M3)
    y = float(emulated_gemm(a, ones_scale_a, b, ones_scale_b, group=32, acc=NO_PROMOTION)[0, 0, 0])
    print(
        f"{big_a:.0f} x {big_b:.0f} + 31 x 1: exact {big_a * big_b + 31:.0f}, tensor core {y:.0f}"
    )

# %% [markdown]
# ## Error versus K, per input distribution
#
# For each K we draw x (M x K) and w (K x N), code them in E4M3, and compare
# against the exact float64 product of the *same dequantized operands*, so only the
# accumulation is measured. The columns:
#
# * **no_promotion**: one scale per row of x and column of w, one chain over all of K;
# * **promote**: the same codes, the chain promoted to FP32 every 128;
# * **tiles**: DeepSeek-V3's 1x128 / 128x128 scales -- the scales change every 128,
#   so the chain restarts there anyway;
# * **fp32**: a float32 dot of the dequantized operands, for reference.
#
# Error of one output: |y - y_exact| / |y_exact|; max and median over the outputs.
# The distributions:

# %%
for name, text in study.DISTRIBUTIONS.items():
    print(f"{name:>8}: {text}")
rows = []
for dist in DISTS:
    rows += study.error_vs_k(dist, KS, m=M, n=N)
print(study.format_table(rows))

# %%
fig = study.plot_error_vs_k(rows, title="E4M3 GEMM, 13-bit tensor-core accumulation")
plt.show()

# %% [markdown]
# Positive inputs (uniform) never cancel: without promotion the accumulator grows
# like K, so the quantum of every later block grows too, and every product loses
# on average half a quantum -- the error grows linearly in K, to several percent at
# K = 4096. With promotion the chain never holds more than 128 products and the
# error stays flat at the level of the first 128. Signed inputs cancel: the
# accumulator grows only like sqrt(K) and the truncations partly cancel, so the
# typical (median) error is far smaller; their max is set by the few outputs whose
# exact value nearly cancels to zero. DeepSeek's "nearly 2%" is one point on such
# curves, and which one depends on the inputs.

# %%
uni = {r["K"]: r for r in rows if r["dist"] == "uniform"}
k_top = max(uni)
ratio = uni[k_top]["no_promotion_max"] / uni[k_top]["promote_max"]
print(
    f"uniform, K={k_top}: max rel. error {uni[k_top]['no_promotion_max']:.2%} without promotion, "
    f"{uni[k_top]['promote_max']:.3%} with promotion every 128 ({ratio:.0f}x smaller)"
)
for dist in DISTS:
    r = next(r for r in rows if r["dist"] == dist and r["K"] == k_top)
    print(
        f"{dist:>8}, K={k_top}: median {r['no_promotion_median']:.2e} without promotion, "
        f"{r['promote_median']:.2e} with"
    )
# Sanity: promotion must not make the positive-input worst case worse.
assert uni[k_top]["promote_max"] <= uni[k_top]["no_promotion_max"]

# %% [markdown]
# ## How many accumulator bits would be enough?
#
# The same uniform GEMM at one K, sweeping the number of fraction bits the
# accumulator keeps (23: a truncating FP32 adder). Each extra bit halves the error.

# %%
sweep = study.frac_bits_sweep("uniform", K_BITS, BITS, m=M, n=N)
for fb in BITS:
    print(
        f"frac_bits={fb:2d}: max rel. error {sweep[(fb, None)]:.2e} (no promotion)  "
        f"{sweep[(fb, 128)]:.2e} (promote 128)"
    )
fig2, ax = plt.subplots(figsize=(4.5, 3.5))
ax.semilogy(BITS, [sweep[(b, None)] for b in BITS], "o-", color="tab:red", label="no promotion")
ax.semilogy(BITS, [sweep[(b, 128)] for b in BITS], "o-", color="tab:blue", label="promote 128")
ax.axvline(13, color="k", lw=0.5)
ax.set_xlabel("accumulator fraction bits")
ax.set_ylabel(f"max rel. error, uniform, K={K_BITS}")
ax.legend()
fig2.tight_layout()
plt.show()

# %% [markdown]
# ## Cost of the model
#
# The model walks K block by block (a `lax.scan`); each block is two fused
# elementwise passes over its products (the exponent max, then the truncated sum).

# %%
t = study.time_vs_f32(*TIME_SHAPE)
print(
    f"(M,K,N)={TIME_SHAPE}: emulated {t['emulated_s'] * 1e3:.2f} ms, "
    f"f32 matmul {t['f32_s'] * 1e3:.3f} ms -> {t['slowdown']:.0f}x"
)
