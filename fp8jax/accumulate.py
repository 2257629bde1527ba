"""The Hopper tensor-core accumulation model of an FP8 GEMM, on the FP8 codes.

Hopper tensor cores do not accumulate FP8 products in IEEE FP32.  Fasi et
al. (2021, "Numerical behavior of NVIDIA tensor cores") and Khattak and
Mikaitis (2026, "Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004)
describe the FP8 path; DeepSeek-V3 (arXiv 2412.19437, sec. 3.3) works around
it by promoting partial sums to FP32 every N_C = 128 elements of K and
applying the per-tile / per-block scales there (as DeepGEMM's kernels do).

The model (:func:`emulated_gemm`, configured by
``fp8jax.recipes.Accumulation(block, frac_bits, promote_every)``), for one
output y = sum_k s(k) a_k b_k with FP8 codes a_k, b_k and scales s:

1. **Codes, not scaled values.**  The tensor core multiplies the FP8 codes.
   A code is (-1)^sign * M * 2^(e - p): p mantissa bits (3 for E4M3, 2 for
   E5M2), M the integer significand (implicit bit included for normal codes),
   e the unbiased exponent; a subnormal code counts with the format's minimum
   normal exponent (-6 for E4M3, -14 for E5M2).  The product of two codes is
   exact, with exponent e_a + e_b and significand M_a M_b / 2^(p_a + p_b) in
   [0, 4).
2. **Blocks.**  K is walked in blocks of ``block`` (32) products.  A block's
   products and the running chain accumulator c are aligned to the largest of
   their exponents E (a product's e_a + e_b; the accumulator's
   floor(log2 |c|)): each term is truncated toward zero to a multiple of
   2^(E - frac_bits), i.e. to ``frac_bits`` (13) fraction bits below E.
3. The aligned terms are summed exactly, and the block result is truncated
   toward zero to ``frac_bits`` fraction bits below its own leading bit
   (``frac_bits + 1`` significant bits).  That is the new c.
4. **Chains and promotion.**  A chain restarts (c = 0) at every multiple of
   ``group`` along K -- the scales change there, and they can only be applied
   outside the tensor core -- and at every multiple of ``promote_every`` when
   that is not None.  When a chain ends, s = fl32(s_a * s_b) for that row,
   column and run of K, and the FP32 accumulator becomes fl32(acc + c * s)
   with one rounding (``promote_rounding="fma"``: DeepGEMM's
   ``final_accum += scale * accum``, which nvcc compiles to an FFMA) or
   fl32(acc + fl32(c * s)) (``"separate"``), IEEE float32 round to nearest
   even either way.  Without
   promotion and with ``group >= K`` there is one chain and the scale is
   applied once at the end.

Zero codes: a product with a zero factor contributes nothing and does not
take part in the max of step 2, so zero padding along K never changes a
result (the grouped expert GEMM pads tokens with zero codes and relies on
this).  An all-zero block leaves c unchanged.  NaN codes give NaN; an E5M2
infinity gives what IEEE arithmetic gives for the code products (+-Inf, or
NaN for Inf * 0 or Inf - Inf).  Non-finite scales propagate through the
float32 arithmetic of step 4.  Products of scales or results in the float32
subnormal range are outside the model (XLA on CPU flushes subnormals).

Implementation, exact without x64: each code's sign, exponent and significand
are read from its bits (``lax.bitcast_convert_type``); the alignment
exponents are int32.  A product of two codes has at most 8 significant bits,
so it and its multiple by the power of two 2^(frac_bits - E) are exact
float32 numbers, and float32 -> integer truncation is toward zero for either
sign: that is the aligned, truncated term.  A term is below
2^(frac_bits + 2) and the accumulator below 2^(frac_bits + 1), so the block
sum is exact in float32 while (2 block + 1) 2^(frac_bits + 1) <= 2^24 (block
<= 511 at frac_bits 13) and in int32 while it is <= 2^31, which
:func:`validate` enforces.  ``frac_bits <= 23`` makes a chain's value an
exact float32 when it is scaled.  The promotion's add is written so that
XLA's contraction of ``acc + c * s`` into a fused multiply-add cannot skip
the product's rounding (see ``_as_exact_product``).

The FMA promotion is emulated exactly in float32 (Boldo and Melquiond's
rounding-to-odd algorithm, see ``_fma_exact_chain``).

Cost: a ``lax.scan`` over the K blocks, each step two fused elementwise passes
over the block's products (the exponent max, then the truncated sum), plus
O(B M N) work for the accumulator and the promotion; several times a float32
matmul of the same shape (configs/study/accumulation.py measures it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.formats import E4M3, E5M2
from fp8jax.recipes import Accumulation

__all__ = ["Accumulation", "emulated_gemm", "validate", "MAX_FRAC_BITS"]

# The largest frac_bits for which a chain's value (frac_bits + 1 significant
# bits) is exactly a float32 when its scale is applied.
MAX_FRAC_BITS = 23
# Exponent given to zero codes: far below every product exponent (>= -28), so
# a product with a zero factor never wins the alignment max; small enough in
# magnitude that sums of a few of them stay far from int32 overflow.
_ZERO_EXP = -(2**12)


@dataclass(frozen=True)
class _CodeFormat:
    """Bit layout of an FP8 format as a tensor core reads it."""

    mant_bits: int
    exp_bits: int
    bias: int


_CODE_FORMATS = {
    E4M3: _CodeFormat(mant_bits=3, exp_bits=4, bias=7),
    E5M2: _CodeFormat(mant_bits=2, exp_bits=5, bias=15),
}


def validate(acc: Accumulation) -> None:
    """Raise ValueError unless :func:`emulated_gemm` runs ``acc`` exactly (see module doc)."""
    if not isinstance(acc, Accumulation):
        raise TypeError(f"acc must be fp8jax.recipes.Accumulation, got {type(acc).__name__}")
    if acc.block < 1:
        raise ValueError(f"Accumulation.block must be >= 1, got {acc.block}")
    if not 0 <= acc.frac_bits <= MAX_FRAC_BITS:
        raise ValueError(
            f"Accumulation.frac_bits must be in [0, {MAX_FRAC_BITS}] (a chain is scaled as a "
            f"float32), got {acc.frac_bits}"
        )
    if (2 * acc.block + 1) * 2 ** (acc.frac_bits + 1) > 2**31:
        raise ValueError(
            f"block={acc.block} with frac_bits={acc.frac_bits} can overflow the exact int32 block "
            f"sum: need (2 * block + 1) * 2**(frac_bits + 1) <= 2**31"
        )
    if acc.promote_every is not None and (
        acc.promote_every <= 0 or acc.promote_every % acc.block != 0
    ):
        raise ValueError(
            f"Accumulation.promote_every must be a positive multiple of block={acc.block} "
            f"or None, got {acc.promote_every}"
        )


def _decode(codes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(exponent, value, non-finite) of FP8 codes, read from their bits.

    exponent: int32, the code's unbiased exponent, subnormals at the minimum
    normal exponent 1 - bias, zeros at _ZERO_EXP.  value: float32, the code's
    exact value (-1)^s M 2^(e - mant_bits), built from the integer
    significand M.  non-finite: bool (NaN, and E5M2's infinities).
    """
    f = _CODE_FORMATS[jnp.dtype(codes.dtype)]
    bits = lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
    mant = bits & ((1 << f.mant_bits) - 1)
    field = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1)
    signif = jnp.where(field > 0, mant + (1 << f.mant_bits), mant)
    # A subnormal code counts with the minimum normal exponent 1 - bias.
    exp = jnp.maximum(field, 1) - f.bias
    # M < 16 and 2^(exp - mant_bits) >= 2^-16 are exact float32 numbers, and so
    # is their product (at most 4 significant bits, a normal exponent).
    magnitude = signif.astype(jnp.float32) * _pow2(exp - f.mant_bits)
    value = jnp.where(bits >= 0x80, -magnitude, magnitude)
    exponent = jnp.where(signif == 0, _ZERO_EXP, exp)
    if f.exp_bits == 4:
        # float8_e4m3fn: no infinity; S.1111.111 is NaN.
        nonfinite = (bits & 0x7F) == 0x7F
    else:
        # float8_e5m2: the all-ones exponent holds +-Inf and NaN.
        nonfinite = field == (1 << f.exp_bits) - 1
    return exponent, value, nonfinite


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as float32 for integer k in [-126, 127] (clipped), built from its exponent bits."""
    k = jnp.clip(k, -126, 127)
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def _as_exact_product(p: jax.Array) -> jax.Array:
    """p rewritten as an exact product significand * 2^exponent (the same float32 value).

    XLA contracts ``acc + x * y`` into a fused multiply-add, which skips the
    rounding of x * y.  Adding this instead makes a contraction harmless: the
    product it would fuse is exact, so fma and multiply-then-add agree.
    Zero, +-Inf and NaN pass through; subnormal p is outside the model.
    """
    bits = lax.bitcast_convert_type(p, jnp.int32)
    # Keep sign and mantissa, set the biased exponent to 127: a value in [1, 2).
    significand = lax.bitcast_convert_type((bits & ~0x7F800000) | 0x3F800000, jnp.float32)
    exponent = ((bits >> 23) & 0xFF) - 127
    exact = significand * _pow2(exponent)
    return jnp.where(jnp.isfinite(p) & (p != 0), exact, p)


def _bit_length(x: jax.Array) -> jax.Array:
    """Number of significant bits of a non-negative int32 (0 for 0)."""
    return 32 - lax.clz(x)


def _shift(x: jax.Array, k: jax.Array) -> jax.Array:
    """x * 2^k truncated toward zero, for non-negative int32 x and any int32 k."""
    left = x << jnp.clip(k, 0, 31)
    right = x >> jnp.clip(-k, 0, 31)
    return jnp.where(k >= 0, left, right)


def _chain_ends(k: int, block: int, group: int, promote_every: int | None) -> np.ndarray:
    """Bool per block: does a chain end after it (a multiple of group or promote_every, or K)?"""
    ends = np.arange(1, math.ceil(k / block) + 1) * block
    last = ends >= k
    at_group = ends % group == 0
    at_promotion = np.zeros_like(last) if promote_every is None else ends % promote_every == 0
    return last | at_group | at_promotion


def _check_inputs(a_codes, a_scale, b_codes, b_scale, group: int, acc: Accumulation) -> None:
    validate(acc)
    for name, x in (("a_codes", a_codes), ("b_codes", b_codes)):
        if jnp.dtype(x.dtype) not in _CODE_FORMATS:
            raise TypeError(f"{name} must hold float8_e4m3fn or float8_e5m2 codes, got {x.dtype}")
    if a_codes.ndim != 3 or b_codes.ndim != 3:
        raise ValueError(
            f"expected a_codes (B, M, K) and b_codes (B, K, N), got {a_codes.shape} and "
            f"{b_codes.shape}"
        )
    batch, m, k = a_codes.shape
    if b_codes.shape[:2] != (batch, k):
        raise ValueError(f"shape mismatch: a_codes {a_codes.shape} @ b_codes {b_codes.shape}")
    n = b_codes.shape[2]
    if k == 0:
        raise ValueError("K must be at least 1 (an empty contraction has no accumulation)")
    if not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if group < k and group % acc.block != 0:
        raise ValueError(
            f"group={group} must be a multiple of block={acc.block} (or >= K={k}): a block "
            f"cannot straddle a change of scale"
        )
    runs = math.ceil(k / group)
    for name, s, want in (
        ("a_scale", a_scale, (batch, m, runs)),
        ("b_scale", b_scale, (batch, runs, n)),
    ):
        if tuple(s.shape) != want:
            raise ValueError(f"{name} must have shape {want} (ceil(K/group) runs), got {s.shape}")
        if s.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {s.dtype}")


def _product_max(ea: jax.Array, eb: jax.Array) -> jax.Array:
    """max over a block of the product exponents e_a + e_b, (B, M, N) int32.

    ea (B, M, blk), eb (B, blk, N).  Unrolled over the block: each product is
    an elementwise (B, M, N) op, which XLA fuses into one vectorised loop (a
    reduction over a block axis of a (B, M, blk, N) tensor runs element by
    element on CPU).  Zero codes (_ZERO_EXP) never win against a real product.
    """
    e = [ea[:, :, j, None] + eb[:, None, j, :] for j in range(ea.shape[-1])]
    return functools.reduce(jnp.maximum, e)


def _block_sum(chain, chain_exp, e_prod, va, vb, frac: int, float_sum: bool):
    """Exact sum of one block's aligned, truncated products and accumulator.

    chain, chain_exp: the accumulator c = chain 2^chain_exp, (B, M, N) int32.
    e_prod: the block's largest product exponent (:func:`_product_max`).
    va (B, M, blk), vb (B, blk, N): the values of the codes.  Returns
    (total, quantum), int32 (B, M, N): the block sum is total 2^quantum
    exactly.  ``float_sum``: the terms may be added in float32 (every partial
    sum is an integer below 2^24), else in int32.
    """
    # The accumulator's exponent floor(log2 |c|) = chain_exp + bit_length - 1.
    mag_c = jnp.abs(chain)
    e_c = jnp.where(mag_c == 0, _ZERO_EXP, chain_exp + _bit_length(mag_c) - 1)
    quantum = jnp.maximum(e_prod, e_c) - frac
    # Terms in units of 2^quantum.  A code product a b is exact in float32 (at
    # most 8 significant bits, exponent >= -32) and so is its product with a
    # power of two in the normal range; when every term is zero the clipped
    # power is finite and the products stay 0.
    unit = _pow2(-quantum)
    c_aligned = _shift(mag_c, chain_exp - quantum)
    total = jnp.where(chain < 0, -c_aligned, c_aligned)
    if float_sum:
        total = total.astype(jnp.float32)
    for j in range(va.shape[-1]):
        scaled = (va[:, :, j, None] * vb[:, None, j, :]) * unit
        if float_sum:
            # trunc is toward zero for either sign; the float32 sum is exact.
            total = total + jnp.trunc(scaled)
        else:
            # float32 -> int32 conversion truncates toward zero; |scaled| < 2^25.
            total = total + scaled.astype(jnp.int32)
    # Exact on the float path: the float32 total is an integer below 2^24.
    return total.astype(jnp.int32), quantum


def _keep_bits(total: jax.Array, quantum: jax.Array, frac: int) -> tuple[jax.Array, jax.Array]:
    """total 2^quantum truncated toward zero to frac + 1 significant bits: (chain, chain_exp)."""
    mag = jnp.abs(total)
    drop = jnp.maximum(_bit_length(mag) - (frac + 1), 0)
    kept = mag >> drop
    return jnp.where(total < 0, -kept, kept), quantum + drop


def _two_sum(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(fl32(x + y), the exact error x + y - fl32(x + y)): Knuth's TwoSum (additions only)."""
    s = x + y
    yy = s - x
    err = (x - (s - yy)) + (y - yy)
    return s, err


def _significand(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(signed int32 significand n, exponent e) with x == n * 2^e, for normal float32 x."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    mag = (bits & 0x7FFFFF) | 0x800000
    return jnp.where(bits < 0, -mag, mag), ((bits >> 23) & 0xFF) - 150


def _round_to_odd_sum(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y rounded to odd: exact if representable, else the neighbour with an odd last bit."""
    s, err = _two_sum(x, y)
    even = (lax.bitcast_convert_type(s, jnp.int32) & 1) == 0
    toward = jnp.nextafter(s, jnp.where(err > 0, jnp.inf, -jnp.inf).astype(s.dtype))
    return jnp.where((err != 0) & even, toward, s)


def _fma_exact_chain(acc32, chain, chain_exp, scale) -> jax.Array:
    """fl32(acc32 + c * scale) with one rounding, c = chain 2^chain_exp (<= 14 bits).

    Boldo and Melquiond's emulation of a fused multiply-add ("Emulation of
    FMA and correctly rounded sums: proved algorithms using rounding to odd",
    IEEE Trans. Comput. 2008): with c * s = uh + ul exactly, (th, tl) =
    TwoSum(acc, uh), v = the sum tl + ul rounded to odd, the result is
    fl32(th + v).  uh = fl32(c * s); the remainder ul is computed in int32:
    c * s = C S 2^(e_c + e_s) with integer significands, and uh = U 2^k
    2^(e_c + e_s), so the remainder's integer C S - U 2^k has at most k <= 14
    bits and wrapping int32 arithmetic gives it exactly although C S needs up
    to 38 bits.  Operands in the float32 subnormal range are outside the
    model (as XLA on CPU flushes them).
    """
    c_f32 = chain.astype(jnp.float32) * _pow2(chain_exp)
    uh = c_f32 * scale
    s_n, s_e = _significand(scale)
    u_n, u_e = _significand(uh)
    k = u_e - (chain_exp + s_e)
    # C S - U 2^k modulo 2^32: the true remainder is below 2^13 in magnitude.
    rem = chain * s_n - (u_n << jnp.clip(k, 0, 31))
    # k <= 0: the product has at most 24 bits and uh is exact.
    rem = jnp.where(k > 0, rem, 0)
    ul = rem.astype(jnp.float32) * _pow2(chain_exp + s_e)
    # uh enters the sums as an exact product, so that a contraction of
    # acc + c * s into a hardware FMA cannot change which value is summed.
    th, tl = _two_sum(acc32, _as_exact_product(uh))
    out = th + _round_to_odd_sum(tl, ul)
    finite = jnp.isfinite(uh) & (uh != 0) & (chain != 0)
    return jnp.where(finite, out, acc32 + _as_exact_product(uh))


def _promote(acc32, chain, chain_exp, sa, sb, rounding: str) -> jax.Array:
    """acc32 plus the chain c = chain 2^chain_exp times fl32(s_a * s_b), rounded as ``rounding``.

    sa (B, M) and sb (B, N) are the chain's scales.  c has at most 24
    significant bits and a normal exponent, so its float32 value is exact.
    "fma": fl32(acc32 + c * s), one rounding (DeepGEMM's FFMA);
    "separate": fl32(acc32 + fl32(c * s)).
    """
    scale = sa[:, :, None] * sb[:, None, :]
    if rounding == "fma":
        return _fma_exact_chain(acc32, chain, chain_exp, scale)
    c_f32 = chain.astype(jnp.float32) * _pow2(chain_exp)
    return acc32 + _as_exact_product(c_f32 * scale)


@functools.partial(jax.jit, static_argnames=("group", "acc"))
def emulated_gemm(
    a_codes: jax.Array,
    a_scale: jax.Array,
    b_codes: jax.Array,
    b_scale: jax.Array,
    *,
    group: int,
    acc: Accumulation,
) -> jax.Array:
    """A scaled FP8 GEMM accumulated the way a Hopper tensor core does (see module doc).

    Args:
      a_codes: (B, M, K) FP8 codes, float8_e4m3fn or float8_e5m2, as stored.
      a_scale: (B, M, ceil(K / group)) float32, the scale of each row's run of
        ``group`` consecutive K elements.
      b_codes: (B, K, N) FP8 codes (its format may differ from a's).
      b_scale: (B, ceil(K / group), N) float32.
      group: length of a scale run along K (static); a multiple of
        ``acc.block`` unless it is >= K (one run).
      acc: the accumulation model (static; a frozen, hashable dataclass).

    Returns:
      (B, M, N) float32: the chains promoted in K order into a float32
      accumulator that starts at 0.  With s = fl32(s_a * s_b) and c a chain's
      value (exact: its 13-fraction-bit result), each promotion is
      fl32(acc + c * s), one rounding, for ``acc.promote_rounding="fma"``
      (the default, DeepGEMM's FFMA), or fl32(acc + fl32(c * s)) for
      "separate".  Jitted, with ``group`` and ``acc`` static (one
      compilation per shape, format pair, group and acc).
    """
    _check_inputs(a_codes, a_scale, b_codes, b_scale, group, acc)
    batch, m, k = a_codes.shape
    n = b_codes.shape[2]
    blk, frac = acc.block, acc.frac_bits
    nblk = math.ceil(k / blk)
    pad = nblk * blk - k

    exp_a, val_a, bad_a = _decode(a_codes)
    exp_b, val_b, bad_b = _decode(b_codes)
    # Pad K to whole blocks with zero codes (exponent _ZERO_EXP, value 0):
    # they never take part in the max and add nothing.
    pad_a = ((0, 0), (0, 0), (0, pad))
    pad_b = ((0, 0), (0, pad), (0, 0))
    exp_a = jnp.pad(exp_a, pad_a, constant_values=_ZERO_EXP)
    exp_b = jnp.pad(exp_b, pad_b, constant_values=_ZERO_EXP)
    val_a = jnp.pad(val_a, pad_a)
    val_b = jnp.pad(val_b, pad_b)

    # One scan step per block: a side (nblk, B, M, blk), b side (nblk, B, blk, N).
    def a_blocks(x):
        return x.reshape(batch, m, nblk, blk).transpose(2, 0, 1, 3)

    def b_blocks(x):
        return x.reshape(batch, nblk, blk, n).transpose(1, 0, 2, 3)

    # The scale run of each block (a block never straddles two runs).
    run_of_block = (np.arange(nblk) * blk) // group
    sa_blocks = jnp.moveaxis(a_scale[:, :, run_of_block], 2, 0)  # (nblk, B, M)
    sb_blocks = jnp.moveaxis(b_scale[:, run_of_block, :], 1, 0)  # (nblk, B, N)
    ends = _chain_ends(k, blk, group, acc.promote_every)
    # Terms are below 2^(frac + 2), the accumulator below 2^(frac + 1).
    float_sum = (2 * blk + 1) * 2 ** (frac + 1) <= 2**24

    def step(carry, xs):
        # The carry holds the previous block's exact sum and quantum, and this
        # block's largest product exponent: truncation and promotion of the
        # previous block happen here, and the exponent max of the next block,
        # so that each product is visited once by the max and once by the sum
        # (XLA would otherwise fuse the block's work into each output of the
        # step and repeat it).
        total, quantum, e_prod, acc32 = carry
        va, vb, ea_next, eb_next, sa_prev, sb_prev, end_prev = xs
        chain, chain_exp = _keep_bits(total, quantum, frac)
        promoted = _promote(acc32, chain, chain_exp, sa_prev, sb_prev, acc.promote_rounding)
        acc32 = jnp.where(end_prev, promoted, acc32)
        chain = jnp.where(end_prev, 0, chain)
        total, quantum = _block_sum(chain, chain_exp, e_prod, va, vb, frac, float_sum)
        return (total, quantum, _product_max(ea_next, eb_next), acc32), None

    def previous(x, first):
        # Block j promotes the chain that ended at block j - 1.
        return jnp.concatenate([jnp.full((1,) + x.shape[1:], first, x.dtype), x[:-1]])

    def following(x):
        # Block j computes the exponent max of block j + 1 (none after the last).
        return jnp.concatenate([x[1:], jnp.full((1,) + x.shape[1:], _ZERO_EXP, x.dtype)])

    ea_blocks, eb_blocks = a_blocks(exp_a), b_blocks(exp_b)
    xs = (
        a_blocks(val_a),
        b_blocks(val_b),
        following(ea_blocks),
        following(eb_blocks),
        previous(sa_blocks, 1.0),
        previous(sb_blocks, 1.0),
        previous(jnp.asarray(ends), False),
    )
    zeros_i = jnp.zeros((batch, m, n), jnp.int32)
    e_first = _product_max(ea_blocks[0], eb_blocks[0])
    init = (zeros_i, zeros_i, e_first, jnp.zeros((batch, m, n), jnp.float32))
    (total, quantum, _, acc32), _ = lax.scan(step, init, xs)
    # The last block always ends a chain.
    chain, chain_exp = _keep_bits(total, quantum, frac)
    out = _promote(acc32, chain, chain_exp, sa_blocks[-1], sb_blocks[-1], acc.promote_rounding)

    # Non-finite codes: the IEEE result of the code products (NaN, or +-Inf for
    # E5M2 infinities).  Decoding FP8 to float32 is exact and the finite part
    # of such a sum cannot overflow float32, so a float32 matmul gives it.
    any_bad = jnp.any(bad_a) | jnp.any(bad_b)

    def special():
        a32 = a_codes.astype(jnp.float32)
        b32 = b_codes.astype(jnp.float32)
        return jnp.matmul(a32, b32, precision=lax.Precision.HIGHEST)

    plain = lax.cond(any_bad, special, lambda: jnp.zeros((batch, m, n), jnp.float32))
    return jnp.where(jnp.isfinite(plain), out, plain)
