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
# # 01 -- FP8 formats and rounding
#
# The two FP8 formats of FP8 training on Hopper GPUs:
#
# * **E4M3** (`float8_e4m3fn`): 4 exponent bits, 3 mantissa bits, max 448,
#   no infinity (the "fn" = finite, NaN only).  DeepSeek-V3 uses it for every
#   tensor ("unified E4M3").
# * **E5M2** (`float8_e5m2`): 5 exponent bits, 2 mantissa bits, max 57344,
#   IEEE-like with +-inf.  The hybrid recipe (Transformer Engine, Flax) uses it
#   for gradients, trading precision for range.
#
# This notebook enumerates all 256 codes of each format, measures the relative
# rounding error against magnitude, and shows what overflow (saturation vs
# NaN/inf) and underflow (flush to zero) do.
#
# Runs in seconds; `FP8JAX_NOTEBOOK_SMALL=1` (the tests) makes it smaller still.

# %%
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import ml_dtypes
import numpy as np

import fp8jax
from fp8jax.formats import fmt_max, fmt_min_normal, fmt_tiny

SMALL = os.environ.get("FP8JAX_NOTEBOOK_SMALL") == "1"
N_SWEEP = 2_000 if SMALL else 200_000
FORMATS = {"E4M3": fp8jax.E4M3, "E5M2": fp8jax.E5M2}

# %% [markdown]
# ## All 256 codes
#
# Reinterpreting the bytes 0..255 as each format gives every representable
# value.  (FP8 -> float32 is exact, so the table below is exact.)


# %%
def enumerate_codes(fmt) -> np.ndarray:
    """All 256 values of an 8-bit format, indexed by code, as float64."""
    return np.arange(256, dtype=np.uint8).view(fmt).astype(np.float64)


rows = []
codes = {}
for name, fmt in FORMATS.items():
    v = enumerate_codes(fmt)
    codes[name] = v
    finite = v[np.isfinite(v)]
    pos = np.unique(finite[finite > 0])
    min_normal = fmt_min_normal(fmt)
    rows.append(
        {
            "format": name,
            "finite codes": int(np.isfinite(v).sum()),
            "NaN codes": int(np.isnan(v).sum()),
            "inf codes": int(np.isinf(v).sum()),
            "zeros (+0, -0)": int((v == 0).sum()),
            "positive subnormals": int((pos < min_normal).sum()),
            "positive normals": int((pos >= min_normal).sum()),
            "max": pos.max(),
            "min normal": min_normal,
            "min subnormal": pos.min(),
            "dynamic range (max/min sub)": pos.max() / pos.min(),
        }
    )
for key in rows[0]:
    print(f"{key:>28s}: " + "  ".join(f"{r[key]!s:>12}" for r in rows))

# The library's constants agree with the enumeration.
for name, fmt in FORMATS.items():
    pos = codes[name][np.isfinite(codes[name]) & (codes[name] > 0)]
    assert pos.max() == fmt_max(fmt) and pos.min() == fmt_tiny(fmt)
assert fmt_max(fp8jax.E4M3) == 448.0 and fmt_max(fp8jax.E5M2) == 57344.0

# %% [markdown]
# E4M3 spends only 2 of its 256 codes on NaN (`0x7F`, `0xFF`) and none on
# infinity: that buys one more binade (max 448 instead of 240).  E5M2 keeps
# IEEE's special values (2 infinities, 6 NaNs).
#
# Spacing: within a binade [2^e, 2^(e+1)) a format with m mantissa bits has
# 2^m equally spaced values, so the gap is 2^(e-m): 1/8 of the binade for
# E4M3, 1/4 for E5M2.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
for name in FORMATS:
    pos = np.unique(codes[name][np.isfinite(codes[name]) & (codes[name] > 0)])
    axes[0].semilogy(pos, ".", ms=3, label=f"{name} ({pos.size} positive values)")
    gaps = np.diff(pos) / pos[:-1]
    axes[1].loglog(pos[:-1], gaps, ".", ms=3, label=name)
axes[0].set(xlabel="index among positive values", ylabel="value", title="positive FP8 values")
axes[1].set(xlabel="value x", ylabel="(next value - x) / x", title="relative gap to the next value")
for ax in axes:
    ax.legend()
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Relative rounding error against magnitude
#
# Round a log-uniform sweep of magnitudes with the library's saturating cast
# (round to nearest even, clip to +-max) and measure |q(x) - x| / |x|:
#
# * **normal range**: at most 2^-(m+1) (unit roundoff): 1/16 = 6.25% for
#   E4M3, 1/8 = 12.5% for E5M2 (bf16: 2^-8 = 0.39%);
# * **subnormal range**: the absolute gap is fixed (the smallest subnormal),
#   so the relative error grows as x shrinks, up to 100% at flush to zero;
# * **above max**: saturation, error (x - max)/x -> 100%.

# %%
x = np.logspace(-6, 6, N_SWEEP)
rel = {}
for name, fmt in FORMATS.items():
    q = np.asarray(fp8jax.saturating_cast(jnp.asarray(x, jnp.float32), fmt), np.float64)
    rel[name] = np.abs(q - x) / x
rel["BF16"] = np.abs(x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64) - x) / x

fig, ax = plt.subplots(figsize=(11, 4.5))
for name, r in rel.items():
    ax.loglog(x, np.maximum(r, 1e-7), lw=0.6, label=name)
for name, fmt in FORMATS.items():
    u = 2.0 ** -(ml_dtypes.finfo(fmt).nmant + 1)
    ax.axhline(u, ls=":", lw=0.8, color="gray")
    ax.text(
        1.5e-6, u * 1.15, f"{name} unit roundoff 2^-{ml_dtypes.finfo(fmt).nmant + 1}", fontsize=7
    )
    for v in (fmt_min_normal(fmt), fmt_max(fmt)):
        ax.axvline(v, ls="--", lw=0.6, color="C0" if name == "E4M3" else "C1")
ax.set(
    xlabel="|x|",
    ylabel="relative rounding error",
    ylim=(1e-5, 2),
    title="rounding error of the saturating cast (dashed: min normal and max of each format)",
)
ax.legend()
ax.grid(alpha=0.3)
plt.show()

for name, fmt in FORMATS.items():
    normal = (x >= fmt_min_normal(fmt)) & (x <= fmt_max(fmt))
    u = 2.0 ** -(ml_dtypes.finfo(fmt).nmant + 1)
    print(
        f"{name}: max relative error in the normal range {rel[name][normal].max():.4f} "
        f"(bound {u}), mean {rel[name][normal].mean():.4f}"
    )
    assert rel[name][normal].max() <= u * (1 + 1e-12)

# %% [markdown]
# ## Overflow: saturation vs a plain cast
#
# A plain `astype(float8_e4m3fn)` does **not** saturate.  Round to nearest
# even still maps values up to 464 (the midpoint between 448 and the next,
# non-existent, value 480) to 448, but anything above becomes **NaN** -- E4M3
# has no infinity.  E5M2 overflows to **inf**.  One such value in a GEMM
# operand poisons its whole output row/column.  `fp8jax.saturating_cast`
# clips to +-max first: the value is off by (x - max)/x but finite.

# %%
probe = jnp.asarray([100.0, 448.0, 460.0, 464.0, 465.0, 500.0, 1e4, 6e4, 1e6, np.inf, np.nan])
print(f"{'x':>10s} {'E4M3 astype':>12s} {'E4M3 sat':>10s} {'E5M2 astype':>12s} {'E5M2 sat':>10s}")
plain = {n: np.asarray(probe.astype(f), np.float64) for n, f in FORMATS.items()}
sat = {n: np.asarray(fp8jax.saturating_cast(probe, f), np.float64) for n, f in FORMATS.items()}
for i, v in enumerate(np.asarray(probe)):
    print(
        f"{v:>10.4g} {plain['E4M3'][i]:>12.4g} {sat['E4M3'][i]:>10.4g} "
        f"{plain['E5M2'][i]:>12.4g} {sat['E5M2'][i]:>10.4g}"
    )
assert np.isnan(plain["E4M3"][5]) and sat["E4M3"][5] == 448.0  # 500: NaN vs saturated
assert np.isinf(plain["E5M2"][8]) and sat["E5M2"][8] == 57344.0  # 1e6: inf vs saturated

# %% [markdown]
# In a GEMM a NaN does not stay local: every output that sums over it is NaN.

# %%
a = jnp.full((4, 8), 1.0).at[0, 3].set(500.0)
b = jnp.ones((8, 4))
dot_plain = jnp.dot(a.astype(fp8jax.E4M3).astype(jnp.float32), b)
dot_sat = jnp.dot(fp8jax.saturating_cast(a, fp8jax.E4M3).astype(jnp.float32), b)
print("plain cast, then dot:\n", dot_plain)
print("saturating cast, then dot:\n", dot_sat)
assert bool(jnp.isnan(dot_plain[0]).all()) and bool(jnp.isfinite(dot_sat).all())

# %% [markdown]
# ## Underflow: flush to zero
#
# Below half the smallest subnormal (E4M3: 2^-10 ~ 9.8e-4; E5M2: 2^-17 ~
# 7.6e-6) a value rounds to 0.  Just above it, a subnormal keeps only one
# significant bit.  How much of a Gaussian tensor N(0, sigma^2) is lost as
# sigma shrinks -- i.e. what happens if a tensor is *not* scaled into range:

# %%
rng = np.random.default_rng(0)
z = rng.standard_normal(20_000 if SMALL else 1_000_000).astype(np.float32)
sigmas = np.logspace(-6, 1, 29)
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
for name, fmt in FORMATS.items():
    flushed, err = [], []
    for s in sigmas:
        xs = z * np.float32(s)
        q = np.asarray(fp8jax.saturating_cast(jnp.asarray(xs), fmt), np.float32)
        flushed.append(np.mean((q == 0) & (xs != 0)))
        err.append(np.linalg.norm(q - xs) / np.linalg.norm(xs))
    axes[0].semilogx(sigmas, flushed, "o-", ms=3, label=name)
    axes[1].loglog(sigmas, err, "o-", ms=3, label=name)
    axes[0].axvline(fmt_tiny(fmt), ls=":", color="C0" if name == "E4M3" else "C1")
axes[0].set(xlabel="sigma", ylabel="fraction flushed to 0", title="underflow of N(0, sigma^2)")
axes[1].set(xlabel="sigma", ylabel="||q(x) - x|| / ||x||", title="tensor relative error")
for ax in axes:
    ax.legend()
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# A unit Gaussian sits comfortably inside both formats' normal ranges; at
# sigma ~ 1e-3 half of an E4M3 tensor is gone, while E5M2 -- with 2^7 times
# more range below -- still holds it (at a quarter of the precision).  This is
# why FP8 needs **scaling**: `fp8jax.quantize` maps each tensor (or tile) onto
# the format's range with scale = amax / max, so neither overflow nor
# underflow depends on the tensor's absolute magnitude.  How fine that scale
# must be for LLM activations is the subject of notebook 02.

# %%
xs = jnp.asarray(z[:4096] * 1e-4)
q = fp8jax.quantize(xs[None, :], fp8jax.E4M3, granularity="tensor")
err_scaled = float(jnp.linalg.norm(fp8jax.dequantize(q)[0] - xs) / jnp.linalg.norm(xs))
err_raw = float(
    jnp.linalg.norm(fp8jax.saturating_cast(xs, fp8jax.E4M3).astype(jnp.float32) - xs)
    / jnp.linalg.norm(xs)
)
print(f"sigma 1e-4: unscaled E4M3 error {err_raw:.3f}, with a per-tensor scale {err_scaled:.4f}")
assert err_scaled < 0.05 < err_raw
