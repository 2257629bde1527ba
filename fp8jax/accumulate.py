"""Emulated limited-precision (tensor-core) accumulation of FP8 GEMMs.

Why: Hopper tensor cores do not accumulate FP8 products in IEEE FP32.  Fasi
et al. (2021, "Numerical behavior of NVIDIA tensor cores") and Khattak &
Mikaitis (2026, "Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004)
model the FP8 path as follows, and DeepSeek-V3 (arXiv 2412.19437, sec. 3.3)
measures its consequence (max relative error near 2% for K = 4096) and fixes
it by promoting partial sums to FP32 every N_C = 128 elements of K.

The model (``fp8jax.recipes.Accumulation(block, frac_bits, promote_every)``),
for one output element y = sum_k a_k b_k:

1. Walk K in groups of ``block`` products (K is zero-padded to a multiple).
2. The group's exact products p_1..p_block and the running accumulator c form
   ``block + 1`` terms.  e_max = floor(log2 max |term|); quantum
   q = 2^(e_max - frac_bits).  Every term is truncated toward zero to a
   multiple of q (alignment to the largest exponent, ``frac_bits`` fraction
   bits kept, shifted-out bits dropped).
3. The truncated terms are summed exactly: S = q * sum_i n_i, n_i integers.
4. S is truncated toward zero to ``frac_bits`` fraction bits of its *own*
   exponent (``frac_bits + 1`` significant bits); that is the new c.
5. If ``promote_every`` is set, after every ``promote_every`` elements of K
   (a multiple of ``block``) c is added into an FP32 accumulator with an
   ordinary round-to-nearest float32 add, and c is reset to 0.  The result is
   the FP32 accumulator plus the last c (just c without promotion).

The operands here are *dequantized* FP8 tensors (data * scale), so a product
is the scaled product.  On the hardware the tensor core sums unscaled FP8
products and the scales are applied at promotion; for power-of-two scales the
two are identical (alignment and truncation are invariant under a common
power-of-two factor); for other scales they differ only in where the
truncation boundaries fall, not in the size of the error.

Exactness of the JAX implementation (``emulated_matmul``), all in float32 /
int32 and therefore jit-able without x64:

* Products are exact: float32 x float32 needs 48 bits, so each product is
  carried as an unevaluated pair p + e with p = fl(a b) and e the exact
  rounding error (Dekker's two-product with a bit-mask split of each factor
  into two 12-bit halves: all four partial products are exact in float32, and
  so is XLA's fusing of them into FMAs).  trunc((p + e) / q) differs from
  trunc(p / q) only when p is a multiple of q and e points toward zero (then
  it is one less in magnitude), and floor(log2|p + e|) differs from that of
  p only when |p| is a power of two and e points toward zero; both cases are
  corrected explicitly.
* Scaling by q is a multiplication by powers of two (exact for results in the
  normal float32 range).  After truncation every term is an integer n_i with
  |n_i| < 2^(frac_bits + 1) <= 2^24, so it converts to int32 exactly.
* The sum is an int32 sum: exact while (block + 1) * 2^(frac_bits + 1) <=
  2^31, which ``validate`` enforces (block <= 127 at frac_bits = 23; block <=
  131071 at the Hopper value 13).  A float32 sum of the integers would only be
  exact up to 2^24 (block + 1 <= 512 at frac_bits 13, but never at 23), hence
  int32.
* The final truncation keeps the top ``frac_bits + 1`` bits of |S| with an
  integer shift (bit length from ``lax.clz``); that integer has at most 24
  significant bits, so it and c are exact float32 numbers.  Hence
  ``frac_bits <= 23``: the accumulator must itself be a float32.

Limits: finite inputs (a non-finite value anywhere in a row/column gives the
non-finite result of a plain float32 matmul for that element); values whose
products or partial sums fall in the float32 subnormal range (< 2^-126) or
overflow are outside the model (XLA on CPU may flush subnormals to zero).

Cost: a ``lax.scan`` over K / block groups, each materialising a
(B, M, N, block) product tensor and ~40 elementwise ops on it; measured
slowdowns against a plain float32 matmul are printed by
``experiments/accumulation.py`` (hundreds to thousands of times: this is an
analysis tool, not a training path).

``emulated_dot_reference_numpy`` is an independent, slow implementation in
float64 / Python integers used by the tests.  The study helpers at the end
(``sample_operands``, ``deepseek_dequantized``, ``error_vs_k``) are what the
experiment script and notebook 03 run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.formats import E4M3
from fp8jax.quant import dequantize, quantize
from fp8jax.recipes import Accumulation

__all__ = [
    "Accumulation",
    "validate",
    "emulated_matmul",
    "emulated_dot_reference_numpy",
    "relative_error",
    "sample_operands",
    "deepseek_dequantized",
    "error_vs_k",
    "time_vs_f32",
    "DISTRIBUTIONS",
]

# The largest frac_bits for which the accumulator is itself a float32 value.
MAX_FRAC_BITS = 23
# Exponent used for zero terms: below every float32 exponent, so it never wins the max.
_ZERO_EXP = -(2**20)


def validate(acc: Accumulation) -> None:
    """Raise ValueError unless the emulator can run ``acc`` exactly (see module doc)."""
    if not isinstance(acc, Accumulation):
        raise TypeError(f"acc must be fp8jax.recipes.Accumulation, got {type(acc).__name__}")
    if acc.block < 1:
        raise ValueError(f"Accumulation.block must be >= 1, got {acc.block}")
    if not 0 <= acc.frac_bits <= MAX_FRAC_BITS:
        raise ValueError(
            f"Accumulation.frac_bits must be in [0, {MAX_FRAC_BITS}] (the accumulator is stored "
            f"as a float32), got {acc.frac_bits}"
        )
    if (acc.block + 1) * 2 ** (acc.frac_bits + 1) > 2**31:
        raise ValueError(
            f"block={acc.block} with frac_bits={acc.frac_bits} can overflow the exact int32 group "
            f"sum: need (block + 1) * 2**(frac_bits + 1) <= 2**31"
        )
    if acc.promote_every is not None and (
        acc.promote_every <= 0 or acc.promote_every % acc.block != 0
    ):
        raise ValueError(
            f"Accumulation.promote_every must be a positive multiple of block={acc.block} "
            f"or None, got {acc.promote_every}"
        )


# --------------------------------------------------------------------------- #
# JAX implementation
# --------------------------------------------------------------------------- #


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as float32 for integer k in [-126, 127], built from its exponent bits."""
    k = jnp.clip(k, -126, 127).astype(jnp.int32)
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _scale_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """x * 2^k, exact whenever the result is a normal float32 (|k| <= 252).

    Two factors so that neither 2^k1 nor 2^k2 overflows; the intermediate
    lies between x and the result, so it is normal when both are.
    """
    k1 = k // 2
    return x * _pow2(k1) * _pow2(k - k1)


def _split12(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x = hi + lo exactly, hi = top 12 significant bits, lo = the other 12."""
    # Clearing the 12 low mantissa bits is exact and immune to FMA contraction
    # (unlike Veltkamp's arithmetic split).
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    hi = lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFF000), jnp.float32)
    return hi, x - hi


def _two_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(p, e) with p = fl(a b) and p + e = a b exactly (Dekker, no FMA needed)."""
    p = a * b
    a_hi, a_lo = _split12(a)
    b_hi, b_lo = _split12(b)
    e = ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo
    return p, e


def _toward_zero(p: jax.Array, e: jax.Array) -> jax.Array:
    """True where the exact value p + e lies strictly between 0 and p."""
    return (e != 0) & (jnp.sign(e) != jnp.sign(p))


def _exact_exponent(p: jax.Array, e: jax.Array) -> jax.Array:
    """floor(log2 |p + e|) (int32); _ZERO_EXP for zeros."""
    mant, ex = jnp.frexp(p)
    # frexp: |p| = |mant| 2^ex with |mant| in [0.5, 1), so floor(log2|p|) = ex - 1.
    # If |p| is a power of two and the exact value is slightly smaller, one less.
    below = (jnp.abs(mant) == 0.5) & _toward_zero(p, e)
    exp = ex.astype(jnp.int32) - 1 - below.astype(jnp.int32)
    return jnp.where(p == 0, _ZERO_EXP, exp)


def _truncated_multiples(p: jax.Array, e: jax.Array, shift: jax.Array) -> jax.Array:
    """trunc((p + e) * 2^shift) as int32, for |result| < 2^24."""
    scaled = _scale_pow2(p, shift)
    n = jnp.trunc(scaled)
    # (p + e) * 2^shift is just below an integer in magnitude: one step toward zero.
    fix = (scaled == n) & _toward_zero(p, e)
    n = n - jnp.where(fix, jnp.sign(p), 0.0)
    # |n| < 2^(frac_bits + 1) <= 2^24: the float -> int32 conversion is exact.
    return n.astype(jnp.int32)


def _group_step(c: jax.Array, p: jax.Array, e: jax.Array, frac_bits: int) -> jax.Array:
    """One group: c (...), products p + e (..., block) -> the new accumulator c (...)."""
    zero = jnp.zeros_like(c)
    terms_p = jnp.concatenate([c[..., None], p], axis=-1)
    # The accumulator is an exact float32: its error term is zero.
    terms_e = jnp.concatenate([zero[..., None], e], axis=-1)
    e_max = jnp.max(_exact_exponent(terms_p, terms_e), axis=-1)
    all_zero = e_max == _ZERO_EXP
    # Any exponent works when every term is zero; 0 keeps the shifts in range.
    e_max = jnp.where(all_zero, 0, e_max)
    n = _truncated_multiples(terms_p, terms_e, (frac_bits - e_max)[..., None])
    # Exact: validate() guarantees (block + 1) * 2^(frac_bits + 1) <= 2^31.
    s = jnp.sum(n, axis=-1, dtype=jnp.int32)
    mag = jnp.abs(s)
    bit_len = 32 - lax.clz(mag)
    drop = jnp.maximum(bit_len - (frac_bits + 1), 0)
    kept = (mag >> drop) << drop
    # kept has at most frac_bits + 1 <= 24 significant bits: exact in float32.
    kept_f = jnp.where(s < 0, -1.0, 1.0) * kept.astype(jnp.float32)
    return _scale_pow2(kept_f, e_max - frac_bits)


def emulated_matmul(a: jax.Array, b: jax.Array, acc: Accumulation) -> jax.Array:
    """a @ b with the tensor-core accumulation model ``acc`` (see module doc).

    Args:
      a: (B, M, K) or (M, K) float32 -- dequantized FP8 operand.
      b: (B, K, N) or (K, N) float32 -- dequantized FP8 operand.
      acc: the accumulation model (``fp8jax.recipes.Accumulation``), static.

    Returns:
      float32 (B, M, N) (or (M, N) for 2-d inputs).  Works under ``jax.jit``
      with ``acc`` static (it is a frozen, hashable dataclass).
    """
    validate(acc)
    if a.ndim != b.ndim or a.ndim not in (2, 3):
        raise ValueError(f"expected a (B,M,K), b (B,K,N) or 2-d; got {a.shape} and {b.shape}")
    squeeze = a.ndim == 2
    if squeeze:
        a, b = a[None], b[None]
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"shape mismatch: a {a.shape} @ b {b.shape}")
    for name, x in (("a", a), ("b", b)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
    # The contract is float32 operands; bf16/f16/fp8 values are exact in float32.
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    batch, m, k = a.shape
    n = b.shape[2]
    blk = acc.block
    pad = (-k) % blk
    # Zero padding adds zero products: they never change e_max or the sum.
    a_p = jnp.pad(a, ((0, 0), (0, 0), (0, pad)))
    b_p = jnp.pad(b, ((0, 0), (0, pad), (0, 0)))
    groups = (k + pad) // blk
    # (G, B, M, blk) and (G, B, N, blk): one scan step per group of K.
    a_g = a_p.reshape(batch, m, groups, blk).transpose(2, 0, 1, 3)
    b_g = b_p.reshape(batch, groups, blk, n).transpose(1, 0, 3, 2)
    per_promotion = None if acc.promote_every is None else acc.promote_every // blk

    def step(carry, xs):
        c, c32 = carry
        idx, a_blk, b_blk = xs
        p, e = _two_product(a_blk[:, :, None, :], b_blk[:, None, :, :])
        c = _group_step(c, p, e, acc.frac_bits)
        if per_promotion is not None:
            promote = (idx + 1) % per_promotion == 0
            # Promotion: an ordinary round-to-nearest float32 add, then reset.
            c32 = jnp.where(promote, c32 + c, c32)
            c = jnp.where(promote, jnp.zeros_like(c), c)
        return (c, c32), None

    init = (jnp.zeros((batch, m, n), jnp.float32), jnp.zeros((batch, m, n), jnp.float32))
    (c, c32), _ = lax.scan(step, init, (jnp.arange(groups), a_g, b_g))
    out = c if per_promotion is None else c32 + c
    # Non-finite inputs are outside the model: return what a float32 matmul gives.
    plain = jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
    out = jnp.where(jnp.isfinite(plain), out, plain)
    return out[0] if squeeze else out


# --------------------------------------------------------------------------- #
# Independent reference: float64 products, Python integers, explicit loops
# --------------------------------------------------------------------------- #


def _ref_dot(a_row: np.ndarray, b_col: np.ndarray, acc: Accumulation) -> float:
    """One output element of the model, exactly (float64 + arbitrary-size ints)."""
    f = acc.frac_bits
    k = a_row.shape[0]
    c = 0.0  # the limited-precision accumulator (exact float64 value)
    c32 = np.float32(0.0)
    for g0 in range(0, k, acc.block):
        # float32 x float32 has <= 48 significant bits: exact in float64.
        prods = [float(a_row[i]) * float(b_col[i]) for i in range(g0, min(g0 + acc.block, k))]
        terms = [c, *prods]
        nonzero = [abs(t) for t in terms if t != 0.0]
        if nonzero:
            # math.frexp(x) = (m, e) with 0.5 <= m < 1: floor(log2 x) = e - 1.
            e_max = math.frexp(max(nonzero))[1] - 1
            # Multiplying by 2^(f - e_max) is exact in float64; trunc rounds toward zero.
            s = sum(int(math.trunc(math.ldexp(t, f - e_max))) for t in terms)
            drop = max(abs(s).bit_length() - (f + 1), 0)
            kept = (abs(s) >> drop) << drop
            c = math.ldexp(float(kept if s >= 0 else -kept), e_max - f)
        else:
            c = 0.0
        done = min(g0 + acc.block, k)
        if acc.promote_every is not None and done % acc.promote_every == 0:
            # Promotion: numpy float32 + float32 rounds to nearest, like the FP32 adder.
            c32 = np.float32(c32 + np.float32(c))
            c = 0.0
    if acc.promote_every is None:
        return c
    return float(np.float32(c32 + np.float32(c)))


def emulated_dot_reference_numpy(a, b, acc: Accumulation) -> np.ndarray:
    """Slow, exact reference of :func:`emulated_matmul` (float64 result).

    ``a`` (B, M, K) / ``b`` (B, K, N) (or 2-d) are first cast to float32 (the
    contract of the emulator).  Loops over every output element; meant for
    tiny shapes in tests.  Without promotion and with ``frac_bits`` > 23 it
    returns the model's exact value (not representable in float32).
    """
    if acc.block < 1:
        raise ValueError("block must be >= 1")
    if acc.promote_every is not None and acc.promote_every % acc.block:
        raise ValueError("promote_every must be a multiple of block")
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    squeeze = a.ndim == 2
    if squeeze:
        a, b = a[None], b[None]
    batch, m, _ = a.shape
    n = b.shape[2]
    out = np.zeros((batch, m, n), np.float64)
    for ib in range(batch):
        for im in range(m):
            for jn in range(n):
                out[ib, im, jn] = _ref_dot(a[ib, im, :], b[ib, :, jn], acc)
    return out[0] if squeeze else out


# One compilation cache shared by every study helper (acc is static and hashable).
_emulated_jit = jax.jit(emulated_matmul, static_argnames=("acc",))
# The FP32 baseline: full float32 products and sums, no bf16 passes.
_f32_matmul_jit = jax.jit(functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST))

# --------------------------------------------------------------------------- #
# Study helpers (experiments/accumulation.py, notebooks/03_accumulation.py)
# --------------------------------------------------------------------------- #

DISTRIBUTIONS = ("uniform", "gaussian", "llm")


@functools.partial(jax.jit, static_argnames=("dist", "m", "k", "n"))
def sample_operands(dist: str, key: jax.Array, m: int, k: int, n: int):
    """Raw float32 operands x (M, K), w (K, N) of a GEMM y = x w.

    * "uniform": both U[0, 1) -- all products positive, the worst case for
      truncation (errors never cancel); DeepSeek-V3's "nearly 2%" setting.
    * "gaussian": both N(0, 1).
    * "llm": LLM-like activations: N(0, 1) with 1 in 64 feature channels
      (columns of x, i.e. K indices) scaled by 50 (outlier features), times
      N(0, 0.02^2) weights.
    """
    kx, kw, ko = jax.random.split(key, 3)
    if dist == "uniform":
        x = jax.random.uniform(kx, (m, k), jnp.float32)
        w = jax.random.uniform(kw, (k, n), jnp.float32)
    elif dist == "gaussian":
        x = jax.random.normal(kx, (m, k), jnp.float32)
        w = jax.random.normal(kw, (k, n), jnp.float32)
    elif dist == "llm":
        x = jax.random.normal(kx, (m, k), jnp.float32)
        outlier = jax.random.uniform(ko, (k,)) < 1.0 / 64
        # Outlier channels ~50x the typical activation (LLM.int8-style features).
        x = x * jnp.where(outlier, 50.0, 1.0)
        w = 0.02 * jax.random.normal(kw, (k, n), jnp.float32)
    else:
        raise ValueError(f"unknown distribution {dist!r}; choose from {DISTRIBUTIONS}")
    return x, w


@functools.partial(jax.jit, static_argnames=("fmt",))
def deepseek_dequantized(x: jax.Array, w: jax.Array, fmt=E4M3):
    """DeepSeek-V3 fprop quantization, returned dequantized (float32).

    x (M, K): 1x128 tiles along K; w (K, N): 128x128 blocks.
    """
    xq = dequantize(quantize(x, fmt, granularity="tile", axis=-1, tile=128))
    wq = dequantize(quantize(w, fmt, granularity="block", tile=128))
    return xq, wq


def relative_error(y, a, b) -> np.ndarray:
    """|y - a b| / (|a| |b|), elementwise, with the products in float64.

    Normalising by sum_k |a_k b_k| (not |sum_k a_k b_k|) keeps the measure
    meaningful for signed inputs whose dot products cancel to ~0; for
    positive inputs (the "uniform" case) the two coincide.
    """
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    exact = a64 @ b64
    mag = np.abs(a64) @ np.abs(b64)
    return np.abs(np.asarray(y, np.float64) - exact) / np.maximum(mag, np.finfo(np.float64).tiny)


def error_vs_k(
    dist: str,
    ks: Sequence[int],
    m: int = 16,
    n: int = 16,
    acc: Accumulation | None = None,
    promote_every: int = 128,
    seed: int = 0,
) -> list[dict]:
    """Max/mean relative error of the emulated FP8 GEMM vs K, with and without promotion.

    For each K: sample x (M, K), w (K, N), quantize them the DeepSeek-V3 way
    (E4M3, 1x128 / 128x128), and compare against the float64 product of the
    *same dequantized operands*, so only accumulation error is measured.  Also
    reports a plain float32 matmul for reference.
    """
    base = acc or Accumulation()
    no_prom = dataclasses.replace(base, promote_every=None)
    prom = dataclasses.replace(base, promote_every=promote_every)
    gemms = (
        ("no_promotion", functools.partial(_emulated_jit, acc=no_prom)),
        ("promote", functools.partial(_emulated_jit, acc=prom)),
        ("fp32", _f32_matmul_jit),
    )
    rows = []
    for i, k in enumerate(ks):
        x, w = sample_operands(dist, jax.random.key(seed * 1000 + i), m, k, n)
        xq, wq = deepseek_dequantized(x, w)
        row = {"dist": dist, "K": int(k)}
        for name, f in gemms:
            err = relative_error(f(xq, wq), xq, wq)
            row[f"{name}_max"] = float(err.max())
            row[f"{name}_mean"] = float(err.mean())
        rows.append(row)
    return rows


def time_vs_f32(m: int, k: int, n: int, acc: Accumulation | None = None, repeats: int = 3) -> dict:
    """Wall-clock of the jitted emulator vs a jitted float32 matmul (best of ``repeats``)."""
    acc = acc or Accumulation()
    a = jax.random.uniform(jax.random.key(1), (1, m, k), jnp.float32)
    b = jax.random.uniform(jax.random.key(2), (1, k, n), jnp.float32)
    emu = functools.partial(_emulated_jit, acc=acc)
    ref = _f32_matmul_jit

    def best(f):
        f(a, b).block_until_ready()  # compile outside the timing
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    t_emu, t_ref = best(emu), best(ref)
    return {"emulated_s": t_emu, "f32_s": t_ref, "slowdown": t_emu / t_ref}


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`error_vs_k` as a fixed-width text table."""
    head = (
        f"{'dist':>9} {'K':>6} | {'no promotion':^21} | {'promote every 128':^21} | "
        f"{'fp32 dot':^21}\n{'':>9} {'':>6} | {'max':>10} {'mean':>10} | {'max':>10} "
        f"{'mean':>10} | {'max':>10} {'mean':>10}"
    )
    lines = [head, "-" * len(head.splitlines()[0])]
    for r in rows:
        lines.append(
            f"{r['dist']:>9} {r['K']:>6} | {r['no_promotion_max']:10.3e} "
            f"{r['no_promotion_mean']:10.3e} | {r['promote_max']:10.3e} "
            f"{r['promote_mean']:10.3e} | {r['fp32_max']:10.3e} {r['fp32_mean']:10.3e}"
        )
    return "\n".join(lines)


def plot_error_vs_k(rows: Sequence[dict], path: str | None = None, title: str = ""):
    """Log-log plot of max (solid) and mean (dotted) relative error vs K, one panel per distribution.

    Saves a PNG when ``path`` is given; returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    dists = list(dict.fromkeys(r["dist"] for r in rows))
    fig, axes = plt.subplots(1, len(dists), figsize=(4.5 * len(dists), 3.8), squeeze=False)
    styles = {
        "no_promotion": ("tab:red", "13-bit accumulation, no promotion"),
        "promote": ("tab:blue", "promote to FP32 every 128"),
        "fp32": ("tab:gray", "FP32 dot (XLA)"),
    }
    for ax, dist in zip(axes[0], dists):
        sub = [r for r in rows if r["dist"] == dist]
        ks = [r["K"] for r in sub]
        for key, (color, label) in styles.items():
            ax.loglog(ks, [r[f"{key}_max"] for r in sub], "o-", color=color, label=label + " (max)")
            ax.loglog(ks, [r[f"{key}_mean"] for r in sub], ":", color=color)
        ax.set_xscale("log", base=2)
        ax.set_title(dist)
        ax.set_xlabel("K (contraction length)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("relative error  |y - xw| / (|x||w|)")
    axes[0][0].plot([], [], ":", color="k", label="dotted: mean over outputs")
    axes[0][0].legend(fontsize=7, loc="center right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def emulated_gemm(a_codes, a_scale, b_codes, b_scale, *, group: int, acc: Accumulation):
    """The emulator on FP8 codes with per-run scales (see the GEMM core's contract).

    a_codes (B, M, K), a_scale (B, M, ceil(K/group)); b_codes (B, K, N),
    b_scale (B, ceil(K/group), N).  Each run of ``group`` along K is one
    accumulation chain on the scaled values (:func:`emulated_matmul`); the
    runs' results are added in float32 in order.
    """
    k = a_codes.shape[2]
    out = None
    for r, start in enumerate(range(0, k, group)):
        stop = min(start + group, k)
        a = a_codes[:, :, start:stop].astype(jnp.float32) * a_scale[:, :, r : r + 1]
        b = b_codes[:, start:stop, :].astype(jnp.float32) * b_scale[:, r : r + 1, :]
        part = emulated_matmul(a, b, acc)
        out = part if out is None else out + part
    return out
