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
# of K, copy the partial sum to FP32 registers on the CUDA cores and add it there.
#
# This notebook reproduces that observation with `fp8jax.accumulate`, an exact
# emulator of the tensor-core accumulation model of Fasi et al. (2021) and Khattak
# & Mikaitis (2026): groups of 32 products plus the running accumulator are
# aligned to their largest exponent, each term truncated toward zero to 13
# fraction bits, summed exactly, and the group result truncated to 13 bits.
#
# Set `FP8JAX_NOTEBOOK_SMALL=1` to shrink every size (the test suite runs it so).

# %%
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules:
    # Scripts and tests have no display; a Jupyter kernel keeps its inline backend.
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from fp8jax import accumulate  # noqa: E402
from fp8jax.recipes import Accumulation  # noqa: E402

SMALL = os.environ.get("FP8JAX_NOTEBOOK_SMALL", "0") == "1"
if SMALL:
    M = N = 4
    KS = [128, 512]
    DISTS = ["uniform"]
    K_BITS = 512
    BITS = [10, 23]
else:
    M = N = 16
    KS = [256, 512, 1024, 2048, 4096, 8192]
    DISTS = list(accumulate.DISTRIBUTIONS)
    K_BITS = 4096
    BITS = [10, 13, 16, 19, 23]
HOPPER = Accumulation()  # block 32, 13 fraction bits, promote every 128
NO_PROMOTION = Accumulation(promote_every=None)
# One jitted emulator; the Accumulation (a frozen dataclass) is a static argument.
emulate = jax.jit(accumulate.emulated_matmul, static_argnames="acc")
print(f"small={SMALL}  M=N={M}  K in {KS}  distributions {DISTS}")

# %% [markdown]
# ## The model on a hand-made example
#
# Sixteen products: one of 1024, then fifteen of 1. With 13 fraction bits and the
# accumulator at 1024 (exponent 10), the quantum is 2^(10-13) = 1/8, so the ones
# survive. Make the big term 2^14 and the quantum becomes 2, and every 1 is
# truncated to 0 -- *absorbed*. Promotion every 4 groups would not save these
# (they share a group with the big term), but it stops the *accumulator* from
# growing across the whole of K, which is what hurts long dot products.

# %%
acc_small_block = Accumulation(block=4, frac_bits=13, promote_every=None)
for big in (2.0**10, 2.0**14):
    a = jnp.array([[big] + [1.0] * 15], jnp.float32)
    b = jnp.ones((16, 1), jnp.float32)
    y = float(emulate(a, b, acc=acc_small_block)[0, 0])
    ref = float(accumulate.emulated_dot_reference_numpy(a, b, acc_small_block)[0, 0])
    print(
        f"big={big:>7.0f}: exact {big + 15:>7.0f}  emulated {y:>7.0f}  numpy reference {ref:>7.0f}"
    )

# %% [markdown]
# ## Error versus K
#
# For each K we draw x (M x K) and w (K x N), quantize them the DeepSeek-V3 way
# (E4M3; 1x128 tiles for x, 128x128 blocks for w), and compare three GEMMs of the
# *same dequantized operands* against float64: the 13-bit accumulator without
# promotion, with promotion every 128, and a plain FP32 dot. The error is
# |y - xw| / (|x| |w|) per output element (for positive inputs this is the usual
# relative error; for signed inputs it does not blow up when the sum cancels).
#
# * **uniform**: x, w ~ U[0, 1): all products positive, errors never cancel.
# * **gaussian**: x, w ~ N(0, 1).
# * **llm**: activations N(0, 1) with 1/64 of the channels 50x larger, weights N(0, 0.02^2).

# %%
rows = []
for dist in DISTS:
    rows += accumulate.error_vs_k(dist, KS, m=M, n=N)
print(accumulate.format_table(rows))

# %%
fig = accumulate.plot_error_vs_k(rows, title="E4M3 GEMM, 13-bit tensor-core accumulation")
plt.show()

# %% [markdown]
# The uniform (all-positive) case grows linearly in K without promotion: the
# accumulator grows like K, so the quantum 2^(e-13) of every later group grows
# too, and every product loses on average half a quantum. With promotion the
# accumulator never holds more than 128 products, and the error stays flat at
# the level of the first 128. Signed inputs cancel: the accumulator grows only
# like sqrt(K) and the truncation errors partly cancel, so the error is far
# smaller -- DeepSeek's "nearly 2%" is a worst case of this kind.

# %%
uni = {r["K"]: r for r in rows if r["dist"] == "uniform"}
k_top = max(uni)
ratio = uni[k_top]["no_promotion_max"] / uni[k_top]["promote_max"]
print(
    f"uniform, K={k_top}: max rel. error {uni[k_top]['no_promotion_max']:.2%} without promotion, "
    f"{uni[k_top]['promote_max']:.3%} with promotion every 128 ({ratio:.0f}x smaller)"
)
# Sanity: promotion must not make the worst case worse once K spans several intervals.
assert uni[k_top]["promote_max"] <= uni[k_top]["no_promotion_max"]

# %% [markdown]
# ## How many accumulator bits would be enough?
#
# Same uniform GEMM at one K, sweeping the number of fraction bits kept by the
# accumulator (23 = a truncating FP32 adder). Each extra bit halves the error;
# at K = 4096, promotion every 128 buys about as much as five extra bits.

# %%
x, w = accumulate.sample_operands("uniform", jax.random.key(7), M, K_BITS, N)
xq, wq = accumulate.deepseek_dequantized(x, w)
bits = BITS
sweep = {}
for fb in bits:
    for prom in (None, 128):
        acc = dataclasses.replace(HOPPER, frac_bits=fb, promote_every=prom)
        sweep[(fb, prom)] = float(accumulate.relative_error(emulate(xq, wq, acc=acc), xq, wq).max())
    print(
        f"frac_bits={fb:2d}: max rel err {sweep[(fb, None)]:.2e} (no promotion)  {sweep[(fb, 128)]:.2e} (promote 128)"
    )

fig2, ax = plt.subplots(figsize=(4.5, 3.5))
ax.semilogy(bits, [sweep[(b, None)] for b in bits], "o-", color="tab:red", label="no promotion")
ax.semilogy(
    bits, [sweep[(b, 128)] for b in bits], "o-", color="tab:blue", label="promote every 128"
)
ax.axvline(13, color="k", lw=0.5)
ax.set_xlabel("accumulator fraction bits")
ax.set_ylabel(f"max rel. error, uniform, K={K_BITS}")
ax.legend()
fig2.tight_layout()
plt.show()

# %% [markdown]
# ## Cost of the emulator
#
# The emulator walks K sequentially (a `lax.scan` over groups of 32) and carries
# every product as an exact pair of float32s, so it is far slower than a matmul.
# It is an analysis tool; training uses the real hardware.

# %%
t = accumulate.time_vs_f32(M * 2, K_BITS, N * 2, repeats=2)
print(
    f"(M,K,N)=({M * 2},{K_BITS},{N * 2}): emulated {t['emulated_s'] * 1e3:.1f} ms, "
    f"f32 matmul {t['f32_s'] * 1e3:.3f} ms -> {t['slowdown']:.0f}x slower"
)
