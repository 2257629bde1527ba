"""Tests of the tensor-core accumulation emulator against an exact numpy reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.accumulate import (
    deepseek_dequantized,
    emulated_dot_reference_numpy,
    emulated_matmul,
    relative_error,
    sample_operands,
    validate,
)
from fp8jax.recipes import Accumulation

HOPPER = Accumulation()  # block 32, 13 fraction bits, promote every 128
NO_PROMOTION = Accumulation(promote_every=None)


def _run(a, b, acc, use_jit):
    f = jax.jit(functools.partial(emulated_matmul, acc=acc)) if use_jit else emulated_matmul
    if use_jit:
        return np.asarray(f(jnp.asarray(a), jnp.asarray(b)))
    return np.asarray(f(jnp.asarray(a), jnp.asarray(b), acc))


def _mat(rows):
    return np.asarray(rows, np.float32)


# --------------------------------------------------------------------------- #
# Hand-made cases: expected values worked out by hand, and the reference agrees
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("use_jit", [False, True])
def test_small_terms_absorbed_by_big_accumulator(use_jit):
    # Products 16, 1, 1, 1 in groups of 2 with 3 fraction bits.
    # Group 1: terms (0, 16, 1), e_max = 4, q = 2: 1 truncates to 0 -> c = 16.
    # Group 2: terms (16, 1, 1), q = 2 again: both 1s vanish -> 16 (exact: 19).
    a = _mat([[16.0, 1.0, 1.0, 1.0]])
    b = _mat([[1.0], [1.0], [1.0], [1.0]])
    acc = Accumulation(block=2, frac_bits=3, promote_every=None)
    assert _run(a, b, acc, use_jit)[0, 0] == 16.0
    assert emulated_dot_reference_numpy(a, b, acc)[0, 0] == 16.0
    # Promoting after every group resets c: group 2 sees (0, 1, 1) with q = 1/8
    # and keeps 2 -> 16 + 2 = 18 (the 1 in group 1 is still lost).
    acc = dataclasses.replace(acc, promote_every=2)
    assert _run(a, b, acc, use_jit)[0, 0] == 18.0
    assert emulated_dot_reference_numpy(a, b, acc)[0, 0] == 18.0


@pytest.mark.parametrize("use_jit", [False, True])
def test_group_sum_truncated_to_own_exponent(use_jit):
    # 1 + 1 + 1 + 0.75 = 3.75 = 0b11.11: with 2 fraction bits the group sum keeps
    # 3 significant bits -> 3.5; negative values truncate toward zero -> -3.5.
    acc = Accumulation(block=4, frac_bits=2, promote_every=None)
    b = _mat([[1.0], [1.0], [1.0], [0.75]])
    a = _mat([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    got = _run(a, b, acc, use_jit)[:, 0]
    np.testing.assert_array_equal(got, [3.5, -3.5])
    np.testing.assert_array_equal(emulated_dot_reference_numpy(a, b, acc)[:, 0], [3.5, -3.5])


@pytest.mark.parametrize("use_jit", [False, True])
def test_exact_product_not_its_float32_rounding(use_jit):
    # (1 + 2^-15)(1 - 2^-15) = 1 - 2^-30 rounds to 1.0 in float32, but the exact
    # product has exponent -1: q = 2^-4 and trunc gives 15/16.  Truncating the
    # rounded product instead would give exponent 0, q = 1/8 and 1.0.
    a = _mat([[1.0 + 2.0**-15]])
    b = _mat([[1.0 - 2.0**-15]])
    acc = Accumulation(block=1, frac_bits=3, promote_every=None)
    assert _run(a, b, acc, use_jit)[0, 0] == 0.9375
    assert emulated_dot_reference_numpy(a, b, acc)[0, 0] == 0.9375


@pytest.mark.parametrize("use_jit", [False, True])
def test_exact_product_below_multiple_of_quantum(use_jit):
    # (1 + 2^-12)(1 - 2^-20) = 1 + 2^-12 - 2^-20 - 2^-32 rounds to the float32
    # 1 + 2^-12 - 2^-20, a multiple of the quantum 2^-23 (frac_bits 23); the
    # exact value lies just below it, so the truncated product is one quantum less.
    a = np.float32(1.0 + 2.0**-12)
    b = np.float32(1.0 - 2.0**-20)
    exact = float(a) * float(b)
    acc = Accumulation(block=1, frac_bits=23, promote_every=None)
    got = _run(_mat([[a]]), _mat([[b]]), acc, use_jit)[0, 0]
    assert got == np.float64(np.trunc(exact * 2.0**23) / 2.0**23)
    assert got != a * b  # the float32-rounded product is not what the model keeps
    assert emulated_dot_reference_numpy(_mat([[a]]), _mat([[b]]), acc)[0, 0] == got


def test_zeros_and_padding():
    acc = Accumulation(block=8, frac_bits=5, promote_every=16)
    z = np.zeros((2, 3, 5), np.float32)
    np.testing.assert_array_equal(_run(z, np.ones((2, 5, 4), np.float32), acc, True), 0.0)
    # K = 13 is zero-padded to 16: same as padding by hand.
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 13)).astype(np.float32)
    b = rng.standard_normal((2, 13, 4)).astype(np.float32)
    a16 = np.pad(a, ((0, 0), (0, 0), (0, 3)))
    b16 = np.pad(b, ((0, 0), (0, 3), (0, 0)))
    np.testing.assert_array_equal(_run(a, b, acc, True), _run(a16, b16, acc, True))


# --------------------------------------------------------------------------- #
# Random inputs: bit-for-bit equal to the exact reference
# --------------------------------------------------------------------------- #

CONFIGS = [
    HOPPER,
    NO_PROMOTION,
    Accumulation(block=4, frac_bits=5, promote_every=8),
    Accumulation(block=7, frac_bits=2, promote_every=None),
    Accumulation(block=16, frac_bits=23, promote_every=None),
]


@pytest.mark.parametrize("acc", CONFIGS, ids=str)
@pytest.mark.parametrize("use_jit", [False, True])
def test_random_matches_reference_bitwise(acc, use_jit):
    rng = np.random.default_rng(acc.block * 100 + acc.frac_bits)
    # Full-mantissa float32 values across 20 binades, signed, batched; K = 300
    # is not a multiple of any block.
    shape_a, shape_b = (2, 3, 300), (2, 300, 4)
    a = rng.standard_normal(shape_a) * np.exp2(rng.integers(-10, 10, shape_a))
    b = rng.standard_normal(shape_b)
    got = _run(a.astype(np.float32), b.astype(np.float32), acc, use_jit)
    want = emulated_dot_reference_numpy(a, b, acc)
    np.testing.assert_array_equal(got, want)


def test_dequantized_fp8_matches_reference_and_2d_inputs():
    x, w = sample_operands("llm", jax.random.key(3), 4, 384, 5)
    xq, wq = deepseek_dequantized(x, w)
    got = np.asarray(jax.jit(lambda a, b: emulated_matmul(a, b, HOPPER))(xq, wq))
    assert got.shape == (4, 5) and got.dtype == np.float32
    np.testing.assert_array_equal(got, emulated_dot_reference_numpy(xq, wq, HOPPER))


def test_reference_with_many_bits_is_exact_dot():
    # The reference itself: with 45 fraction bits nothing is truncated for these
    # inputs (products of 12-bit numbers, sums < 2^20), so it is the exact dot.
    rng = np.random.default_rng(1)
    a = rng.integers(-2048, 2048, (3, 64)).astype(np.float32) / 256
    b = rng.integers(-2048, 2048, (64, 2)).astype(np.float32) / 128
    acc = Accumulation(block=32, frac_bits=45, promote_every=None)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(emulated_dot_reference_numpy(a, b, acc), exact)


# --------------------------------------------------------------------------- #
# The acceptance result and the float32 limit
# --------------------------------------------------------------------------- #


def _uniform_fp8(k, seed=0):
    x, w = sample_operands("uniform", jax.random.key(seed), 8, k, 8)
    return deepseek_dequantized(x, w)


def test_k4096_error_between_1_and_10_percent_and_promotion_cuts_10x():
    xq, wq = _uniform_fp8(4096)
    f = jax.jit(emulated_matmul, static_argnames="acc")
    err_none = relative_error(f(xq, wq, acc=NO_PROMOTION), xq, wq).max()
    err_prom = relative_error(f(xq, wq, acc=HOPPER), xq, wq).max()
    assert 0.01 < err_none < 0.10, err_none
    assert err_prom * 10 <= err_none, (err_prom, err_none)


def test_23_fraction_bits_is_float32_like():
    xq, wq = _uniform_fp8(2048, seed=1)
    f = jax.jit(emulated_matmul, static_argnames="acc")
    err_f32 = relative_error(jnp.matmul(xq, wq, precision="highest"), xq, wq).max()
    err_13 = relative_error(f(xq, wq, acc=NO_PROMOTION), xq, wq).max()
    acc23 = Accumulation(frac_bits=23, promote_every=None)
    err_23 = relative_error(f(xq, wq, acc=acc23), xq, wq).max()
    # Truncation (not rounding) over 2048 terms: ~K 2^-25 at most, a float32-class error.
    assert err_23 < 2048 * 2.0**-25 and err_23 * 500 < err_13, (err_23, err_13)
    # Promoted every 128, a 24-bit truncating accumulator is within 10x of an FP32 dot.
    err_23p = relative_error(f(xq, wq, acc=dataclasses.replace(acc23, promote_every=128)), xq, wq)
    assert err_23p.max() < 10 * max(err_f32, 2.0**-24), (err_23p.max(), err_f32)


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "acc, msg",
    [
        (Accumulation(block=0), "block"),
        (Accumulation(frac_bits=24), "frac_bits"),
        (Accumulation(frac_bits=-1), "frac_bits"),
        (Accumulation(block=128, frac_bits=23), "overflow"),
        (Accumulation(block=32, promote_every=100), "multiple"),
        (Accumulation(block=32, promote_every=0), "multiple"),
    ],
)
def test_validate_rejects(acc, msg):
    with pytest.raises(ValueError, match=msg):
        validate(acc)
    with pytest.raises(ValueError, match=msg):
        emulated_matmul(jnp.ones((1, 2, 64)), jnp.ones((1, 64, 2)), acc)


def test_bad_shapes_and_types():
    with pytest.raises(ValueError, match="mismatch"):
        emulated_matmul(jnp.ones((1, 2, 64)), jnp.ones((1, 63, 2)), HOPPER)
    with pytest.raises(ValueError, match="expected"):
        emulated_matmul(jnp.ones((2, 64)), jnp.ones((1, 64, 2)), HOPPER)
    with pytest.raises(TypeError, match="floating"):
        emulated_matmul(jnp.ones((2, 4), jnp.int32), jnp.ones((4, 2), jnp.int32), HOPPER)
    with pytest.raises(TypeError, match="Accumulation"):
        emulated_matmul(jnp.ones((2, 4)), jnp.ones((4, 2)), (32, 13, 128))


def test_non_finite_inputs_propagate():
    a = np.ones((2, 40), np.float32)
    a[0, 3] = np.nan
    a[1, 5] = np.inf
    got = _run(a, np.ones((40, 2), np.float32), HOPPER, True)
    assert np.isnan(got[0]).all() and np.isposinf(got[1]).all()
