import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax.formats import as_format, fmt_max, saturating_cast


@pytest.mark.parametrize(
    "fmt,mx",
    [
        (fp8jax.E4M3, 448.0),
        (fp8jax.E5M2, 57344.0),
        (fp8jax.E4M3FNUZ, 240.0),
        (fp8jax.E5M2FNUZ, 57344.0),
    ],
)
def test_fmt_max(fmt, mx):
    assert fmt_max(fmt) == mx


def test_as_format_names():
    assert as_format("e4m3") == fp8jax.E4M3
    assert as_format("float8_e5m2") == fp8jax.E5M2
    assert as_format("e8m0") == fp8jax.E8M0
    with pytest.raises(ValueError):
        as_format("e3m4x")


def test_plain_cast_is_not_saturating_but_ours_is():
    x = jnp.array([500.0, -1e6, 448.0, 449.0], jnp.float32)
    plain = np.asarray(x.astype(fp8jax.E4M3)).astype(np.float32)
    assert np.isnan(plain[0])  # the trap the saturating cast avoids
    for fn in (saturating_cast, jax.jit(saturating_cast, static_argnums=1)):
        ours = np.asarray(fn(x, fp8jax.E4M3)).astype(np.float32)
        np.testing.assert_array_equal(ours, [448.0, -448.0, 448.0, 448.0])


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2, fp8jax.E4M3FNUZ, fp8jax.E5M2FNUZ])
def test_saturating_cast_matches_reference(fmt):
    rng = np.random.default_rng(0)
    m = fmt_max(fmt)
    x = np.concatenate(
        [
            rng.standard_normal(1000) * m / 4,
            rng.standard_normal(100) * m * 100,
            [0.0, -0.0, m, -m, 2 * m, 1e-12, -1e-12, np.inf, -np.inf, np.nan],
        ]
    ).astype(np.float32)
    ref = np.clip(x, -m, m).astype(ml_dtypes.finfo(fmt).dtype)
    ours = np.asarray(saturating_cast(jnp.asarray(x), fmt))
    np.testing.assert_array_equal(ours.view(np.uint8), ref.view(np.uint8))
    # Inf saturates, NaN stays NaN.
    out = ours.astype(np.float32)
    assert out[-3] == m and out[-2] == -m and np.isnan(out[-1])


def test_bf16_input():
    x = jnp.array([1000.0, 1.5], jnp.bfloat16)
    out = np.asarray(saturating_cast(x, fp8jax.E4M3)).astype(np.float32)
    np.testing.assert_array_equal(out, [448.0, 1.5])
