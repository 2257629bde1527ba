"""The Hopper accumulation model (fp8jax.accumulate) against a plain-integer reference, bit for bit."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from accumulation_reference import _add_f32, _mul_f32, reference_gemm, round_f32

from fp8jax import quantize
from fp8jax.accumulate import emulated_gemm, validate
from fp8jax.formats import E4M3, E5M2, fmt_max
from fp8jax.numerics.inputs import make_activations
from fp8jax.recipes import Accumulation

HOPPER = Accumulation()  # block 32, 13 fraction bits, promote every 128
NO_PROMOTION = Accumulation(promote_every=None)
FORMAT_PAIRS = [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)]
DISTRIBUTIONS = ("uniform", "gaussian", "mixed")


def _bits_equal(got, want) -> None:
    """float32 arrays equal bit for bit (NaN matches NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and got.dtype == np.float32
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@functools.partial(jax.jit, static_argnames=("group", "acc"))
def _inside_jit(a, sa, b, sb, group, acc):
    # A caller's jit around the emulator: the GEMM core's situation.
    return emulated_gemm(a, sa, b, sb, group=group, acc=acc)


def _run(a, sa, b, sb, group, acc, use_jit):
    args = tuple(jnp.asarray(x) for x in (a, sa, b, sb))
    f = _inside_jit if use_jit else emulated_gemm
    return np.asarray(f(*args, group=group, acc=acc))


def _reference(a, sa, b, sb, group, acc):
    return reference_gemm(
        a,
        sa,
        b,
        sb,
        group=group,
        block=acc.block,
        frac_bits=acc.frac_bits,
        promote_every=acc.promote_every,
        promote_rounding=acc.promote_rounding,
    )


def _codes(dist: str, fmt, shape, rng) -> np.ndarray:
    """Random FP8 codes; values are cast with round-to-nearest-even (all within range)."""
    mx = fmt_max(fmt)
    if dist == "uniform":
        x = rng.uniform(0.0, 1.0, shape) * mx
    elif dist == "gaussian":
        x = np.clip(rng.standard_normal(shape) * mx / 8, -mx, mx)
    elif dist == "mixed":
        # Signed, log-uniform over 20 binades: 2^-12..2^8 for E4M3 reaches its
        # subnormals (below 2^-6) and zero (below 2^-10); shifted down by 8
        # binades for E5M2 to reach its own (below 2^-14).
        shift = 0 if fmt == E4M3 else -8
        x = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-12, 8, shape) + shift)
    else:
        raise ValueError(dist)
    return x.astype(fmt)


def _scales(shape, rng) -> np.ndarray:
    """Full-mantissa float32 scales over a few binades."""
    return (rng.uniform(1.0, 2.0, shape) * np.exp2(rng.integers(-3, 4, shape))).astype(np.float32)


def _configs(k: int):
    """(group, acc): one scale run or runs of 128, with and without promotion."""
    groups = (k,) if k <= 128 else (k, 128)
    return [(g, acc) for g in groups for acc in (NO_PROMOTION, HOPPER)]


def _batch_of_distributions(fmt, shape, rng) -> np.ndarray:
    """Batch entry i holds codes of DISTRIBUTIONS[i]; shape is one entry's (rows, cols)."""
    return np.stack([_codes(d, fmt, shape, rng) for d in DISTRIBUTIONS])


# --------------------------------------------------------------------------- #
# Random codes: bit for bit equal to the integer reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("fmts", FORMAT_PAIRS, ids=lambda f: f"{f[0].name}x{f[1].name}")
def test_random_codes_match_reference(fmts):
    # Uniform positive, Gaussian and mixed-sign wide-range codes, one per batch
    # entry; K = 1000 is not a multiple of the block.
    rng = np.random.default_rng(FORMAT_PAIRS.index(fmts))
    batch = len(DISTRIBUTIONS)
    for k in (32, 128, 1000):
        a = _batch_of_distributions(fmts[0], (2, k), rng)
        b = _batch_of_distributions(fmts[1], (k, 2), rng)
        for group, acc in _configs(k):
            runs = math.ceil(k / group)
            sa, sb = _scales((batch, 2, runs), rng), _scales((batch, runs, 2), rng)
            want = _reference(a, sa, b, sb, group, acc)
            # Called directly for one K, inside a caller's jit for the others.
            _bits_equal(_run(a, sa, b, sb, group, acc, use_jit=k != 1000), want)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_act_quant_coded_activations_match_reference(fmt):
    # x: LLM-like activations with outlier channels, quantized like DeepSeek's
    # act_quant (1 x 128 tiles); w: 128 x 128 blocks, whose scale is the same
    # for every column of a block.
    for k in (128, 1000):
        x = make_activations("outlier_channels", 3, k, seed=k)
        w = np.random.default_rng(k).standard_normal((k, 2)).astype(np.float32) / np.sqrt(k)
        qx = quantize(jnp.asarray(x), fmt, granularity="tile", axis=-1, tile=128)
        qw = quantize(jnp.asarray(w), fmt, granularity="block", tile=128)
        a, sa = np.asarray(qx.data)[None], np.asarray(qx.scale)[None]
        b = np.asarray(qw.data)[None]
        sb = np.repeat(np.asarray(qw.scale), 128, axis=1)[None, :, :2]
        for acc in (NO_PROMOTION, HOPPER):
            want = _reference(a, sa, b, sb, 128, acc)
            _bits_equal(_run(a, sa, b, sb, 128, acc, use_jit=True), want)


def test_k4096_one_output_matches_reference():
    rng = np.random.default_rng(4096)
    a = _codes("gaussian", E4M3, (1, 1, 4096), rng)
    b = _codes("mixed", E4M3, (1, 4096, 2), rng)
    sa, sb = _scales((1, 1, 32), rng), _scales((1, 32, 2), rng)
    _bits_equal(_run(a, sa, b, sb, 128, HOPPER, True), _reference(a, sa, b, sb, 128, HOPPER))
    one_a, one_b = sa[:, :, :1], sb[:, :1]
    _bits_equal(
        _run(a, one_a, b, one_b, 4096, NO_PROMOTION, True),
        _reference(a, one_a, b, one_b, 4096, NO_PROMOTION),
    )


@pytest.mark.parametrize(
    "acc",
    [
        Accumulation(block=4, frac_bits=5, promote_every=8),
        Accumulation(block=7, frac_bits=2, promote_every=None),
        # Block sums beyond 2^24: the int32 path.
        Accumulation(block=16, frac_bits=23, promote_every=None),
        Accumulation(block=32, frac_bits=20, promote_every=64),
    ],
    ids=str,
)
def test_other_models_and_batch_match_reference(acc):
    rng = np.random.default_rng(acc.block * 100 + acc.frac_bits)
    k = 300
    a = _codes("mixed", E4M3, (2, 3, k), rng)
    b = _codes("gaussian", E5M2, (2, k, 2), rng)
    sa, sb = _scales((2, 3, 1), rng), _scales((2, 1, 2), rng)
    _bits_equal(_run(a, sa, b, sb, k, acc, True), _reference(a, sa, b, sb, k, acc))


# --------------------------------------------------------------------------- #
# Hand-made cases: the expected values are worked out in the comments
# --------------------------------------------------------------------------- #


def _e4m3(rows) -> np.ndarray:
    return np.asarray(rows, np.float64).astype(E4M3)


def _ones_scale(a_shape, b_shape, runs=1):
    return np.ones(a_shape[:2] + (runs,), np.float32), np.ones(
        (b_shape[0], runs, b_shape[2]), np.float32
    )


def test_small_products_absorbed_by_a_large_one():
    # 256 * 256 = 2^16 (exponent 8 + 8) and 31 products 1 * 1 (exponent 0) in
    # one block: the quantum is 2^(16 - 13) = 8, so every 1 truncates to 0.
    a = _e4m3([[[256.0] + [1.0] * 31]])
    b = _e4m3([[[256.0]] + [[1.0]] * 31])
    sa, sb = _ones_scale(a.shape, b.shape)
    assert _run(a, sa, b, sb, 32, NO_PROMOTION, False)[0, 0, 0] == 65536.0
    # A product of 2^11 instead: the quantum is 2^-2 and the ones survive.
    a = _e4m3([[[32.0] + [1.0] * 31]])
    b = _e4m3([[[64.0]] + [[1.0]] * 31])
    assert _run(a, sa, b, sb, 32, NO_PROMOTION, False)[0, 0, 0] == 2048.0 + 31.0


def test_accumulator_takes_part_in_alignment_and_promotion_restarts_it():
    # Products 16, 1, 1, 1 in blocks of 2 with 3 fraction bits.
    # Block 1: (16, 1), exponent 4, quantum 2: the 1 truncates -> c = 16.
    # Block 2: (c = 16, 1, 1), quantum 2 again: both 1s vanish -> 16.
    a = _e4m3([[[16.0, 1.0, 1.0, 1.0]]])
    b = _e4m3([[[1.0]] * 4])
    sa, sb = _ones_scale(a.shape, b.shape)
    acc = Accumulation(block=2, frac_bits=3, promote_every=None)
    assert _run(a, sa, b, sb, 4, acc, False)[0, 0, 0] == 16.0
    # Promotion after every block: block 2 is a fresh chain (1, 1) -> 2; 16 + 2.
    acc = Accumulation(block=2, frac_bits=3, promote_every=2)
    assert _run(a, sa, b, sb, 4, acc, True)[0, 0, 0] == 18.0
    # A scale run of 2 restarts the chain the same way, and each run gets its
    # own scale: 16 * 0.5 + 2 * 3 = 14.
    sa = np.asarray([[[0.5, 3.0]]], np.float32)
    acc = Accumulation(block=2, frac_bits=3, promote_every=None)
    assert _run(a, sa, b, np.ones((1, 2, 1), np.float32), 2, acc, True)[0, 0, 0] == 14.0


def test_block_result_truncated_to_its_own_leading_bit():
    # 1 + 1 + 1 + 0.75 = 3.75 = 0b11.11: with 2 fraction bits the block result
    # keeps 3 significant bits -> 3.5; negative sums truncate toward zero.
    a = _e4m3([[[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]]])
    b = _e4m3([[[1.0], [1.0], [1.0], [0.75]]])
    sa, sb = _ones_scale(a.shape, b.shape)
    acc = Accumulation(block=4, frac_bits=2, promote_every=None)
    np.testing.assert_array_equal(_run(a, sa, b, sb, 4, acc, False)[0, :, 0], [3.5, -3.5])


def test_subnormal_code_aligns_at_the_minimum_normal_exponent():
    # 2^-9 (E4M3's smallest subnormal, counted at exponent -6) times 2^-6 is
    # 2^-15 with alignment exponent -12; 2^-6 * 2^-7 = 2^-13 has exponent -13.
    # The block aligns at -12: with 2 fraction bits the quantum is 2^-14 and
    # 2^-15 truncates to 0.  (Aligned by value, the quantum would be 2^-15.)
    a = _e4m3([[[2.0**-9, 2.0**-6]]])
    b = _e4m3([[[2.0**-6], [2.0**-7]]])
    sa, sb = _ones_scale(a.shape, b.shape)
    acc = Accumulation(block=2, frac_bits=2, promote_every=None)
    assert _run(a, sa, b, sb, 2, acc, False)[0, 0, 0] == 2.0**-13


@pytest.mark.parametrize("rounding", ["separate", "fma"])
def test_promotion_rounds_as_asked(rounding):
    # Chain 1 is -3 (scale 1), chain 2 is 3 with scale 1 + 2^-11 + 2^-23,
    # whose product with 3 needs rounding: "separate" rounds it before the
    # add, "fma" (DeepGEMM's FFMA) keeps the bits it would drop.
    s = np.float32(1.0 + 2.0**-11 + 2.0**-23)
    a = _e4m3([[[-3.0, 3.0]]])
    b = _e4m3([[[1.0], [1.0]]])
    sa = np.asarray([[[1.0, s]]], np.float32)
    sb = np.ones((1, 2, 1), np.float32)
    separate = np.float32(np.float32(-3.0) + np.float32(np.float32(3.0) * s))
    fused = np.float32(-3.0 + 3.0 * float(s))  # exact in float64, one rounding
    assert separate != fused
    want = fused if rounding == "fma" else separate
    acc = Accumulation(block=1, frac_bits=13, promote_every=None, promote_rounding=rounding)
    for use_jit in (False, True):
        assert _run(a, sa, b, sb, 1, acc, use_jit)[0, 0, 0] == want


@pytest.mark.parametrize("rounding", ["separate", "fma"])
def test_promotion_matches_integer_reference_on_hard_cases(rounding):
    # Many promotions per output with full-mantissa scales over a wide range of
    # binades and cancelling chains: every rounding of the accumulator is
    # exercised, ties included (scales with few bits make exact halves).
    rng = np.random.default_rng(7)
    k, m, n = 512, 3, 3
    a = _codes("mixed", E4M3, (1, m, k), rng)
    b = _codes("mixed", E4M3, (1, k, n), rng)
    runs = k // 32
    sa = rng.uniform(1.0, 2.0, (1, m, runs)) * np.exp2(rng.integers(-20, 20, (1, m, runs)))
    sb = np.exp2(rng.integers(-3, 4, (1, runs, n))) * rng.choice([1.0, 1.5, 1.25], (1, runs, n))
    sa, sb = sa.astype(np.float32), sb.astype(np.float32)
    acc = Accumulation(block=32, frac_bits=13, promote_every=32, promote_rounding=rounding)
    want = _reference(a, sa, b, sb, 32, acc)
    for use_jit in (False, True):
        _bits_equal(_run(a, sa, b, sb, 32, acc, use_jit), want)


def test_fma_and_separate_promotion_differ_in_last_bits_only():
    rng = np.random.default_rng(3)
    k = 1024
    a = _codes("gaussian", E4M3, (1, 4, k), rng)
    b = _codes("gaussian", E4M3, (1, k, 4), rng)
    sa, sb = _scales((1, 4, k // 128), rng), _scales((1, k // 128, 4), rng)
    fma = _run(a, sa, b, sb, 128, Accumulation(), True)
    sep = _run(
        a, sa, b, sb, 128, dataclasses.replace(Accumulation(), promote_rounding="separate"), True
    )
    # Both are the accumulator with a different rounding of each of 8 promotions.
    np.testing.assert_allclose(fma, sep, rtol=2e-6, atol=0)


def test_zero_padding_along_k_changes_nothing():
    # The grouped GEMM pads each expert's tokens with zero codes: zero products
    # never take part in the alignment, so the result is that of the unpadded K.
    rng = np.random.default_rng(7)
    a = _codes("mixed", E4M3, (1, 3, 100), rng)
    b = _codes("gaussian", E4M3, (1, 100, 2), rng)
    sa, sb = _scales((1, 3, 1), rng), _scales((1, 1, 2), rng)
    a_pad = np.concatenate([a, np.zeros((1, 3, 28), E4M3)], axis=2)
    b_pad = np.concatenate([b, np.zeros((1, 28, 2), E4M3)], axis=1)
    for acc in (NO_PROMOTION, HOPPER):
        _bits_equal(_run(a_pad, sa, b_pad, sb, 128, acc, True), _run(a, sa, b, sb, 128, acc, True))
    # Zero rows give exact zeros.
    z = np.zeros((1, 3, 100), E4M3)
    assert not _run(z, sa, b, sb, 128, HOPPER, True).any()


def test_non_finite_codes():
    a = np.ones((1, 3, 40), np.float32)
    a[0, 0, 3] = np.nan
    b = np.ones((1, 40, 2), np.float32)
    sa, sb = _ones_scale(a.shape, b.shape)
    got = _run(a.astype(E4M3), sa, b.astype(E4M3), sb, 40, HOPPER, True)
    assert np.isnan(got[0, 0]).all() and (got[0, 1:] == 40.0).all()
    # E5M2 infinities: inf * 1 = inf, inf * 0 = NaN, inf - inf = NaN.
    a[0, 0, 3] = np.inf
    a[0, 1, 3] = np.inf
    a[0, 1, 4] = -np.inf
    b[0, 5, 1] = 0.0
    a[0, 2, 5] = np.inf
    got = _run(a.astype(E5M2), sa, b.astype(E5M2), sb, 40, HOPPER, False)
    assert np.isposinf(got[0, 0]).all() and np.isnan(got[0, 1]).all()
    assert np.isposinf(got[0, 2, 0]) and np.isnan(got[0, 2, 1])
    _bits_equal(got, _reference(a.astype(E5M2), sa, b.astype(E5M2), sb, 40, HOPPER))


# --------------------------------------------------------------------------- #
# The reference's own float32 arithmetic, and bad input
# --------------------------------------------------------------------------- #


def test_reference_float32_rounding_agrees_with_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(2000) * np.exp2(rng.integers(-140, 120, 2000))
    want = x.astype(np.float32)
    for xi, wi in zip(x, want):
        n, d = float(xi).as_integer_ratio()
        assert round_f32(n, -(d.bit_length() - 1)) == float(wi) or (
            math.isinf(wi) and math.isinf(round_f32(n, -(d.bit_length() - 1)))
        )
    u = (rng.standard_normal(500) * np.exp2(rng.integers(-40, 40, 500))).astype(np.float32)
    v = (rng.standard_normal(500) * np.exp2(rng.integers(-40, 40, 500))).astype(np.float32)
    for ui, vi in zip(u, v):
        assert _mul_f32(float(ui), float(vi)) == float(ui * vi)
        assert _add_f32(float(ui), float(vi)) == float(ui + vi)


@pytest.mark.parametrize(
    "acc, msg",
    [
        (Accumulation(block=0), "block"),
        (Accumulation(frac_bits=24), "frac_bits"),
        (Accumulation(frac_bits=-1), "frac_bits"),
        (Accumulation(block=64, frac_bits=23), "overflow"),
        (Accumulation(block=32, promote_every=100), "multiple"),
        (Accumulation(block=32, promote_every=0), "multiple"),
    ],
)
def test_validate_rejects(acc, msg):
    with pytest.raises(ValueError, match=msg):
        validate(acc)
    a, b = jnp.ones((1, 2, 64), E4M3), jnp.ones((1, 64, 2), E4M3)
    with pytest.raises(ValueError, match=msg):
        emulated_gemm(a, jnp.ones((1, 2, 1)), b, jnp.ones((1, 1, 2)), group=64, acc=acc)


def test_bad_inputs():
    a, b = jnp.ones((1, 2, 64), E4M3), jnp.ones((1, 64, 2), E4M3)
    sa, sb = jnp.ones((1, 2, 1)), jnp.ones((1, 1, 2))
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        emulated_gemm(a.astype(jnp.float32), sa, b, sb, group=64, acc=HOPPER)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        emulated_gemm(a, sa, b.astype(ml_dtypes.float8_e4m3fnuz), sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match="mismatch"):
        emulated_gemm(a, sa, b[:, :63], sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match=r"\(B, M, K\)"):
        emulated_gemm(a[0], sa, b, sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match="a_scale must have shape"):
        emulated_gemm(a, jnp.ones((1, 2, 2)), b, sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match="b_scale must have shape"):
        emulated_gemm(a, jnp.ones((1, 2, 2)), b, sb, group=32, acc=HOPPER)
    with pytest.raises(TypeError, match="float32"):
        emulated_gemm(a, sa.astype(jnp.bfloat16), b, sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match="multiple of block"):
        emulated_gemm(a, jnp.ones((1, 2, 4)), b, jnp.ones((1, 4, 2)), group=16, acc=HOPPER)
    with pytest.raises(ValueError, match="K must be at least 1"):
        emulated_gemm(a[:, :, :0], sa, b[:, :0], sb, group=64, acc=HOPPER)
    with pytest.raises(ValueError, match="positive int"):
        emulated_gemm(a, sa, b, sb, group=0, acc=HOPPER)
    with pytest.raises(TypeError, match="Accumulation"):
        emulated_gemm(a, sa, b, sb, group=64, acc=(32, 13, 128))
