"""fp8jax.inline_ops: the values and dtypes of jnp.where / jnp.clip / jnp.isinf /
jnp.isfinite (and numpy's), with and without jit, traced without a nested jit per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import inline_ops

SPECIALS = np.array(
    [0.0, -0.0, 1.5, -2.5, 1e-45, -1e-40, 3e38, np.inf, -np.inf, np.nan], np.float32
)


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("jit", [False, True])
def test_where_is_numpys_with_broadcasting_and_promotion(jit):
    x = jnp.asarray(SPECIALS)
    # The condition from numpy: XLA on CPU may compare subnormals as zero.
    cond = jnp.asarray(SPECIALS > 0)
    where = jax.jit(inline_ops.where) if jit else inline_ops.where
    _same(where(cond, x, -x), np.where(SPECIALS > 0, SPECIALS, -SPECIALS))
    # A Python scalar takes the array's dtype (int32 here), as in jnp.where.
    ints = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    _same(where(ints > 2, 7, ints), np.where(np.arange(6).reshape(2, 3) > 2, 7, ints))
    assert where(ints > 2, 7, ints).dtype == jnp.int32
    # A column condition broadcast against a row.
    col = jnp.asarray([[True], [False]])
    _same(
        where(col, jnp.float32(1.0), jnp.zeros(3, jnp.float32)),
        np.array([[1.0] * 3, [0.0] * 3], np.float32),
    )
    _same(where(cond, x, 0.0), jnp.where(cond, x, 0.0))


@pytest.mark.parametrize("jit", [False, True])
def test_clip_isinf_and_isfinite_are_numpys(jit):
    clip = jax.jit(inline_ops.clip) if jit else inline_ops.clip
    isinf = jax.jit(inline_ops.isinf) if jit else inline_ops.isinf
    isfinite = jax.jit(inline_ops.isfinite) if jit else inline_ops.isfinite
    x = jnp.asarray(SPECIALS)
    # numpy's values where XLA on CPU keeps them (it may flush subnormals in
    # max / min); jnp.clip's bits everywhere.
    normal = np.abs(SPECIALS) > 1e-30
    _same(clip(x, -448.0, 448.0)[normal], np.clip(SPECIALS, -448.0, 448.0)[normal])
    _same(clip(x, -448.0, 448.0), jnp.clip(x, -448.0, 448.0))
    _same(isinf(x), np.isinf(SPECIALS))
    r = jnp.asarray([-40, -3, 0, 5, 40], jnp.int32)
    _same(clip(r, 0, 31), np.clip(np.asarray(r), 0, 31))
    _same(isinf(x.astype(jnp.bfloat16)), np.isinf(SPECIALS))
    # Subnormals are finite however the CPU reads them (flushed or not).
    _same(isfinite(x), np.isfinite(SPECIALS))
    _same(isfinite(x.astype(jnp.bfloat16)), np.isfinite(SPECIALS))


def test_traced_without_a_nested_jit():
    def f(x):
        clipped = inline_ops.clip(x, -1.0, 1.0)
        return inline_ops.where(inline_ops.isinf(x) | ~inline_ops.isfinite(x), x, clipped)

    jaxpr = jax.make_jaxpr(f)(jnp.asarray(SPECIALS))
    assert all(e.primitive.name not in ("pjit", "jit") for e in jaxpr.eqns), jaxpr


def _int_arithmetic(x):
    # jax.numpy operators and functions: outside traced_inline, each one a jit of its own.
    y = ((x << 3) & 0x7FF) + (x >> 2) * 7 - (x | 9)
    return jnp.maximum(y, 5) - jnp.minimum(y, -5) * (x < 3) + (x == 2)


def _int_arithmetic_numpy(x):
    x = x.astype(np.int64)
    y = ((x << 3) & 0x7FF) + (x >> 2) * 7 - (x | 9)
    return (np.maximum(y, 5) - np.minimum(y, -5) * (x < 3) + (x == 2)).astype(np.int32)


@pytest.mark.parametrize("jit", [False, True])
def test_traced_inline_gives_the_same_values(jit):
    x = np.arange(-300, 300, 7, dtype=np.int32)
    f = inline_ops.traced_inline(_int_arithmetic)
    f = jax.jit(f) if jit else f
    _same(f(jnp.asarray(x)), _int_arithmetic_numpy(x))


def test_traced_inline_binds_the_same_primitives_without_nested_jits():
    spec = jax.ShapeDtypeStruct((37, 5), jnp.int32)
    plain = jax.make_jaxpr(_int_arithmetic)(spec)
    inline = jax.make_jaxpr(inline_ops.traced_inline(_int_arithmetic))(spec)
    assert str(inline) == str(plain)
    assert all(e.primitive.name not in ("pjit", "jit") for e in inline.eqns), inline
    # A jax.numpy function jitted without inlining (jnp.where) is traced into its
    # caller too, its primitives in the same order.
    where = jax.make_jaxpr(inline_ops.traced_inline(lambda x: jnp.where(x > 0, x, -x)))(spec)
    assert [e.primitive.name for e in where.eqns] == ["gt", "neg", "select_n"], where


def test_traced_inline_keeps_the_name():
    wrapped = inline_ops.traced_inline(_int_arithmetic)
    assert wrapped.__name__ == "_int_arithmetic" and wrapped.__wrapped__ is _int_arithmetic
