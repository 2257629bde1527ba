"""FP8 codes as bytes in the GPU kernels (``fp8jax.kernels.gpu_codes``): the values a
code holds against ml_dtypes in float64, every byte, every NaN's sign; the cast of
+-Inf and NaN as XLA writes them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.kernels import gpu_codes

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_code_values_are_the_codes_float32_values_with_every_nans_sign(fmt, jit):
    code_bytes = np.arange(256, dtype=np.uint8).view(np.int8)
    convert = jax.jit(gpu_codes.code_values, static_argnums=1) if jit else gpu_codes.code_values
    got = np.asarray(convert(jnp.asarray(code_bytes), fmt))
    want = code_bytes.view(fmt).astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), code_bytes < 0)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_cast_writes_finite_codes_and_specials_as_xla(fmt, jit):
    xs = np.array([1.5, -2.0, np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0], np.float32)
    # The saturated quotient the kernels cast (x itself here: unit scales).
    fm = float(jnp.finfo(fmt).max)
    y = np.clip(np.nan_to_num(xs, nan=0.0), -fm, fm)
    cast = (
        jax.jit(gpu_codes.cast_with_specials, static_argnums=2)
        if jit
        else (gpu_codes.cast_with_specials)
    )
    got = np.asarray(cast(jnp.asarray(xs), jnp.asarray(y), fmt)).view(np.uint8)
    want = xs.astype(fmt).view(np.uint8)  # ml_dtypes: XLA's conversion
    nan = np.isnan(xs)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # A NaN's code is a NaN of x's sign.
    assert np.isnan(got[nan].view(fmt).astype(np.float32)).all()
    np.testing.assert_array_equal(got[nan] & 0x80, np.signbit(xs[nan]) * 0x80)
