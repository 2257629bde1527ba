import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import E4M3, E5M2, groups_for, ref_act_quant, ref_quantize_groups

import fp8jax

FMTS = {"e4m3": (fp8jax.E4M3, E4M3), "e5m2": (fp8jax.E5M2, E5M2)}


def _q(x, fmt, gran, axis, tile, jit):
    f = lambda x: fp8jax.quantize(x, fmt, gran, axis=axis, tile=tile)
    return (jax.jit(f) if jit else f)(jnp.asarray(x))


@pytest.mark.parametrize("jit", [False, True])
def test_tile_equals_deepseek_act_quant(jit):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 1024)) * np.exp(rng.standard_normal((64, 1)))).astype(np.float32)
    x[3, :128] *= 1e4  # a massive activation
    ref_data, ref_s = ref_act_quant(x)
    q = _q(x, fp8jax.E4M3, "tile", -1, 128, jit)
    assert q.scale.shape == (64, 8) and q.scale.dtype == jnp.float32
    # Scales are correctly rounded: equal, not just within an ulp.
    np.testing.assert_array_equal(np.asarray(q.scale), ref_s)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), ref_data.view(np.uint8))


@pytest.mark.parametrize("gran", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("jit", [False, True])
def test_granularities_match_reference(gran, fmt, jit):
    rng = np.random.default_rng(1)
    shape = (3, 130, 200)  # not multiples of the tile
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x[0, 5, 7] = 1e5
    axis = 1 if gran in ("row", "tile") else -1
    jf, nf = FMTS[fmt]
    q = _q(x, jf, gran, axis, 64, jit)
    data, scale_el = ref_quantize_groups(x, groups_for(shape, gran, axis, 64), nf)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    deq = np.asarray(fp8jax.dequantize(q, jnp.float32))
    np.testing.assert_allclose(deq, data.astype(np.float64) * scale_el, rtol=2**-23, atol=0)


def test_scale_shapes():
    x = jnp.ones((5, 300, 7))
    assert fp8jax.quantize(x, fp8jax.E4M3, "tile", axis=1).scale.shape == (5, 3, 7)
    assert fp8jax.quantize(x, fp8jax.E4M3, "row", axis=1).scale.shape == (5, 1, 7)
    assert fp8jax.quantize(x, fp8jax.E4M3, "block").scale.shape == (5, 3, 1)
    assert fp8jax.quantize(x, fp8jax.E4M3, "tensor").scale.shape == ()


def test_zero_tiles_and_bad_input():
    x = jnp.zeros((2, 256))
    q = fp8jax.quantize(x, fp8jax.E4M3)
    np.testing.assert_array_equal(np.asarray(q.scale), 1.0)
    np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(q)), 0.0)
    with pytest.raises(ValueError):
        fp8jax.quantize(jnp.ones(()), fp8jax.E4M3)
    with pytest.raises(ValueError):
        fp8jax.quantize(jnp.ones((4, 4)), fp8jax.E4M3, "diagonal")
    with pytest.raises(ValueError):
        fp8jax.quantize(jnp.ones((4,)), fp8jax.E4M3, "block")


def test_nonfinite_inputs():
    x = jnp.array([[1.0, jnp.inf, -2.0, jnp.nan] + [0.5] * 124], jnp.float32)
    q = fp8jax.quantize(x, fp8jax.E4M3)
    d = np.asarray(fp8jax.dequantize(q))
    assert float(q.scale[0, 0]) == pytest.approx(2.0 / 448)
    assert d[0, 1] == 2.0  # Inf saturates to the group's max
    assert np.isnan(d[0, 3])  # NaN stays NaN
    assert np.all(np.isfinite(np.delete(d[0], 3)))


def test_pytree_and_nbytes():
    q = fp8jax.quantize(jnp.ones((4, 256)), fp8jax.E4M3)
    leaves = jax.tree.leaves(q)
    assert len(leaves) == 2
    assert q.nbytes == 4 * 256 + 4 * 2 * 4


_special = st.sampled_from(
    [0.0, -0.0, 448.0, -448.0, 1e-40, 2.0**-9, 1e-7, 1e6, -1e30, 3e38, np.inf, -np.inf, np.nan]
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 5),
    cols=st.sampled_from([1, 3, 64, 65, 130, 200]),
    gran=st.sampled_from(["tensor", "row", "tile", "block"]),
    pow2=st.booleans(),
    data=st.data(),
)
def test_property_bounds(rows, cols, gran, pow2, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-6, 6)).astype(np.float32)
    n_special = data.draw(st.integers(0, 4))
    for _ in range(n_special):
        x[rng.integers(rows), rng.integers(cols)] = data.draw(_special)
    q = fp8jax.quantize(jnp.asarray(x), fp8jax.E4M3, gran, axis=-1, tile=64, pow2=pow2)
    s = np.asarray(q.scale)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    d = np.asarray(fp8jax.dequantize(q)).astype(np.float64)
    finite = np.isfinite(x)
    assert not np.any(np.isnan(d[finite])), "finite input gave NaN"
    assert np.all(np.isnan(d[np.isnan(x)]))
    # Per-element error bound of a non-saturating E4M3 quantization with the
    # element's own scale: half an ulp (2^-4 relative) or half the smallest
    # subnormal step (2^-10 * scale).
    sel = finite
    se = np.broadcast_to(
        np.asarray(
            fp8jax.quant.expand_scale(q.scale, x.shape, q.granularity, q.axis, q.tile)
        ).astype(np.float64),
        x.shape,
    )
    xd = x.astype(np.float64)
    bound = np.maximum(np.abs(xd) * 2.0**-4, se * 2.0**-10) * (1 + 1e-6)
    ok = np.abs(d - xd) <= bound
    assert np.all(ok[sel]), (x[sel & ~ok], d[sel & ~ok])


def test_e8m0_scale_format_roundtrip():
    # Power-of-two scales are representable exactly in E8M0.
    q = fp8jax.quantize(jnp.linspace(-3, 5, 256).reshape(2, 128), fp8jax.E4M3, pow2=True)
    s = np.asarray(q.scale)
    np.testing.assert_array_equal(s.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), s)
