import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import E4M3, E5M2, groups_for, max_scale, ref_act_quant, ref_quantize_groups

import fp8jax
from fp8jax import formats, quant, scaling

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


@pytest.mark.parametrize("jit", [False, True])
def test_rows_and_cols_match_reference(jit):
    # One call, two layouts: 1x128 tiles along the last axis and along the
    # second-to-last, each the reference's groups.
    rng = np.random.default_rng(2)
    shape = (2, 130, 200)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x[1, 3, 9] = 1e5
    f = (
        jax.jit(quant.quantize_rows_and_cols, static_argnums=1)
        if jit
        else quant.quantize_rows_and_cols
    )
    rows, cols = f(jnp.asarray(x), fp8jax.E4M3)
    for q, axis in ((rows, 2), (cols, 1)):
        assert (q.granularity, q.axis, q.tile) == ("tile", axis, 128)
        data, scale_el = ref_quantize_groups(x, groups_for(shape, "tile", axis, 128), E4M3)
        np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
        deq = np.asarray(fp8jax.dequantize(q, jnp.float32))
        np.testing.assert_allclose(deq, data.astype(np.float64) * scale_el, rtol=2**-23, atol=0)
    with pytest.raises(ValueError, match="2-d"):
        quant.quantize_rows_and_cols(jnp.ones(128), fp8jax.E4M3)


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


@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_inputs_propagate(jit):
    # One Inf used to saturate to the tile's max and give a finite GEMM output.
    x = jnp.array([[1.0, jnp.inf, -2.0, jnp.nan, -jnp.inf] + [0.5] * 123], jnp.float32)
    q = _q(x, fp8jax.E4M3, "tile", -1, 128, jit)
    d = np.asarray(fp8jax.dequantize(q))
    # The scale comes from the finite elements.
    assert float(q.scale[0, 0]) == np.float32(2.0) / np.float32(448.0)
    assert np.all(np.isnan(d[0, [1, 3, 4]]))  # E4M3 has no Inf: NaN code
    np.testing.assert_array_equal(d[0, [0, 2, 5]], [1.0, -2.0, 0.5])
    # E5M2 has Inf: +-Inf survives with its sign.
    d5 = np.asarray(fp8jax.dequantize(_q(x, fp8jax.E5M2, "tile", -1, 128, jit)))
    assert d5[0, 1] == np.inf and d5[0, 4] == -np.inf and np.isnan(d5[0, 3])
    # A GEMM on the quantized operand is non-finite, as in bf16.
    w = jnp.ones((128, 4), jnp.float32)
    y = jnp.dot(fp8jax.dequantize(q), w)
    assert not np.any(np.isfinite(np.asarray(y)))


@pytest.mark.parametrize("gran", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("jit", [False, True])
def test_nonfinite_matches_reference(gran, jit):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 130)).astype(np.float32)
    x[1, 3], x[2, 100], x[4, 0] = np.inf, -np.inf, np.nan
    x[0, :] = np.inf  # a group with no finite element
    q = _q(x, fp8jax.E4M3, gran, -1, 64, jit)
    data, scale_el = ref_quantize_groups(x, groups_for(x.shape, gran, -1, 64), E4M3)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))


def _subnormal_tiles(rng):
    # Tiles of float32 subnormals, tiles whose amax / 448 is subnormal, a
    # normal tile and a mixed one, in one tensor (rows of 256 = 2 tiles).
    x = np.empty((6, 256), np.float32)
    x[0] = rng.standard_normal(256) * 1e-40
    x[1] = rng.standard_normal(256) * 1e-44
    x[2] = rng.standard_normal(256) * 1e-37
    x[3] = rng.standard_normal(256) * 3e-39
    x[4] = rng.standard_normal(256)
    x[5, :128] = rng.standard_normal(128) * 1e-41
    x[5, 128:] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_huge_amax_tiles_quantize_like_the_reference(fmt, pow2, jit):
    # Tiles whose scales meet the cap near float32's max (amax / fmt_max
    # rounded, or rounded up to a power of two, times fmt_max overflows) and
    # tiles just below it, alone and beside ordinary tiles.
    jf, nf = FMTS[fmt]
    rng = np.random.default_rng(5)
    top = float(np.nextafter(np.float32(2.0**127), np.float32(0)))
    f32max = float(np.finfo(np.float32).max)
    x = rng.standard_normal((2, 4, 128))
    for i, amax in enumerate([top, 2.0**127, f32max, 1e38]):
        x[:, i] *= amax / np.abs(x[:, i]).max(-1, keepdims=True)
        x[:, i, 7] = amax
    x[1] = rng.standard_normal((4, 128))  # a second row of ordinary tiles
    x = x.reshape(8, 128).astype(np.float32)
    for rows in (x[:4], x):  # only huge tiles; huge and ordinary ones together
        f = lambda t: fp8jax.quantize(t, jf, "tile", axis=-1, pow2=pow2)
        q = (jax.jit(f) if jit else f)(jnp.asarray(rows))
        groups = groups_for(rows.shape, "tile", -1, 128)
        data, scale_el = ref_quantize_groups(rows, groups, nf, pow2=pow2)
        np.testing.assert_array_equal(np.asarray(q.scale)[:, 0], scale_el[:, 0])
        np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("jit", [False, True])
def test_subnormal_amax_tiles_quantize_like_any_tile(fmt, jit):
    # XLA on CPU flushes float32 subnormals to zero: these tiles used to get
    # scale 1 and all-zero data (100% error).
    jf, nf = FMTS[fmt]
    x = _subnormal_tiles(np.random.default_rng(4))
    q = _q(x, jf, "tile", -1, 128, jit)
    data, scale_el = ref_quantize_groups(x, groups_for(x.shape, "tile", -1, 128), nf)
    # Bit for bit the float64-free numpy reference (which keeps subnormals).
    np.testing.assert_array_equal(np.asarray(q.scale), scale_el[:, ::128].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    # Round trip within the format's relative error, measured on the codes
    # (float64) and on dequantize's float32 output.
    ulp = 2.0**-4 if fmt == "e4m3" else 2.0**-3
    x64 = x.astype(np.float64)
    tile_amax = np.repeat(np.abs(x64).reshape(6, 2, 128).max(-1), 128, 1)
    codes = data.astype(np.float64) * scale_el
    nonzero = tile_amax > 0
    assert np.all(np.abs(codes - x64)[nonzero] <= ulp * tile_amax[nonzero])
    deq = _jit(fp8jax.dequantize, jit)(q)
    deq = np.asarray(deq).astype(np.float64)
    # Subnormal results lose bits below 2^-149 (float32's own grid).
    assert np.all(np.abs(deq - x64)[nonzero] <= ulp * tile_amax[nonzero] + 2.0**-149)
    # Every tile keeps its information: relative error of each tile well below 1.
    err = np.abs(deq - x64).reshape(6, 2, 128).max(-1)
    amx = tile_amax[:, ::128]
    assert np.all(err[amx > 0] / amx[amx > 0] <= ulp)


def _jit(f, jit):
    return jax.jit(f) if jit else f


@pytest.mark.parametrize("gran", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("jit", [False, True])
def test_subnormal_groups_all_granularities(gran, jit):
    x = _subnormal_tiles(np.random.default_rng(5))[:4] * np.float32(1.0)
    x[3] *= np.float32(1e-3)  # a whole row below float32's normal range
    q = _q(x, fp8jax.E4M3, gran, -1, 128, jit)
    data, scale_el = ref_quantize_groups(x, groups_for(x.shape, gran, -1, 128), E4M3)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    deq = np.asarray(_jit(fp8jax.dequantize, jit)(q)).astype(np.float64)
    with np.errstate(under="ignore"):
        ref = (data.astype(np.float64) * scale_el).astype(np.float32)
    np.testing.assert_array_equal(deq.astype(np.float32), ref)


@pytest.mark.parametrize(
    "shape,axis",
    [((0, 128), -1), ((4, 0), -1), ((0,), 0), ((2, 0, 3), 1), ((3, 0), 0), ((0, 0), 0)],
)
@pytest.mark.parametrize("gran", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("jit", [False, True])
def test_zero_size_dimensions(shape, axis, gran, jit):
    # Used to raise ZeroDivisionError ("tile") or "zero-size array to reduction".
    if gran == "block" and len(shape) < 2:
        pytest.skip("block needs 2 dims")
    x = jnp.zeros(shape, jnp.float32)
    q = _q(x, fp8jax.E4M3, gran, axis, 128, jit)
    assert q.data.shape == shape and q.data.dtype == fp8jax.E4M3
    assert np.all(np.asarray(q.scale) == 1.0)
    d = _jit(fp8jax.dequantize, jit)(q)
    assert d.shape == shape


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
    assert np.all(np.isnan(d[~finite])), "NaN / Inf must become E4M3's NaN"
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
    # Subnormal results also lose what lies below float32's grid (2^-149).
    ok = np.abs(d - xd) <= bound + 2.0**-149
    # Beyond fmt_max * (capped) scale a value saturates there.
    saturated = np.abs(xd) > 448.0 * se
    ok |= saturated & (np.abs(d) == 448.0 * se) & (np.sign(d) == np.sign(xd))
    assert np.all(ok[sel]), (x[sel & ~ok], d[sel & ~ok])
    assert np.all(np.isfinite(d[sel])), "finite input gave a non-finite output"
    assert np.all(se <= max_scale(fp8jax.E4M3, pow2))


def test_e8m0_scale_format_roundtrip():
    # Power-of-two scales are representable exactly in E8M0.
    q = fp8jax.quantize(jnp.linspace(-3, 5, 256).reshape(2, 128), fp8jax.E4M3, pow2=True)
    s = np.asarray(q.scale)
    np.testing.assert_array_equal(s.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), s)


@pytest.mark.parametrize("gran", ["tensor", "row", "tile", "block"])
@pytest.mark.parametrize("jit", [False, True])
def test_nan_is_never_dropped_from_a_group(gran, jit):
    # A max-reduction on CPU can drop a NaN (and the values before it): block
    # [[3, 1], [nan, 2]] got amax 2, so 3 saturated to 2.  Every group holding
    # a NaN must take its scale from all of its finite elements.
    x = np.float32([[3.0, 1.0], [np.nan, 2.0]])
    q = _q(x, fp8jax.E4M3, gran, -1, 128, jit)
    d = np.asarray(fp8jax.dequantize(q))
    assert d[0, 0] == 3.0 and np.isnan(d[1, 0])
    rng = np.random.default_rng(11)
    for nans in (1, 3, 40):  # on CPU (jit) each of these used to lose NaNs
        x = rng.standard_normal((2, 256, 256)).astype(np.float32)
        for _ in range(nans):
            x[tuple(rng.integers(0, n) for n in x.shape)] = np.nan
        q = _q(x, fp8jax.E4M3, gran, -1, 128, jit)
        data, scale_el = ref_quantize_groups(x, groups_for(x.shape, gran, -1, 128), E4M3)
        np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
        # dequantize rounds the (exact) product once to float32.
        want = (data.astype(np.float64) * scale_el).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(q)), want)


# --------------------------------------------------------------------------
# UE8M0 scales: E8M0 bytes bit-exact to float32 power-of-two scales
# --------------------------------------------------------------------------


def test_e8m0_encode_decode_every_code_against_ml_dtypes():
    from fp8jax.formats import decode_e8m0, encode_e8m0

    codes = np.arange(255, dtype=np.uint8)  # 255 is NaN
    want = codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert want[0] == 2.0**-127 and want[254] == 2.0**127
    got = np.asarray(jax.jit(decode_e8m0)(jnp.asarray(codes.view(ml_dtypes.float8_e8m0fnu))))
    np.testing.assert_array_equal(got.astype(np.float64), want)
    back = encode_e8m0(jnp.asarray(want.astype(np.float32)))
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), codes)
    nan = np.array([255], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    assert np.isnan(np.asarray(decode_e8m0(jnp.asarray(nan)))[0])


@pytest.mark.parametrize("bad", [3.0, 0.75, 2.0**-128, 0.0, -2.0, np.inf, np.nan])
def test_e8m0_encode_refuses_non_pow2_eager_and_nans_under_jit(bad):
    from fp8jax.formats import encode_e8m0

    s = jnp.asarray([1.0, bad, 0.5], jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        encode_e8m0(s)
    codes = np.asarray(jax.jit(encode_e8m0)(s)).view(np.uint8)
    # Under jit: the bad scale's code is E8M0's NaN, the others exact.
    np.testing.assert_array_equal(codes, [127, 255, 126])


@pytest.mark.parametrize(
    "granularity,axis", [("tensor", -1), ("row", -1), ("tile", -1), ("tile", 0), ("block", -1)]
)
def test_quantize_ue8m0_equals_float32_pow2(granularity, axis):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((200, 300)) * np.exp(rng.normal(0, 4, (200, 1))))
    x = x.astype(jnp.float32)
    a = fp8jax.quantize(x, fp8jax.E4M3, granularity, axis=axis, pow2=True)
    b = fp8jax.quantize(x, fp8jax.E4M3, granularity, axis=axis, pow2=True, scale_fmt="ue8m0")
    assert b.scale.dtype == jnp.dtype(ml_dtypes.float8_e8m0fnu) and b.scale_fmt == "ue8m0"
    assert a.scale_fmt == "float32"
    np.testing.assert_array_equal(
        np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)
    )
    # The bytes are the float32 scales' exponents (independent: ml_dtypes' cast).
    want = np.asarray(a.scale).astype(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(b.scale).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(fp8jax.dequantize(a)), np.asarray(fp8jax.dequantize(b))
    )
    assert a.nbytes - b.nbytes == 3 * a.scale.size


def test_quantize_ue8m0_needs_pow2_and_floors_tiny_tiles():
    x = jnp.ones((4, 128), jnp.float32)
    with pytest.raises(ValueError, match="pow2=True"):
        fp8jax.quantize(x, fp8jax.E4M3, "tile", scale_fmt="ue8m0")
    # amax 2^-130: the float32 power-of-two scale 2^-138 has no E8M0 code.
    # Built in numpy: XLA on CPU would flush the float32 subnormal product to 0.
    tiny = jnp.asarray(np.full((4, 128), 2.0**-130, np.float32))
    q = fp8jax.quantize(tiny, fp8jax.E4M3, "tile", pow2=True, scale_fmt="ue8m0")
    assert np.asarray(q.scale).view(np.uint8).tolist() == [[0]] * 4  # 2^-127
    # The codes are x / 2^-127 = 2^-3 rounded to E4M3 (exact here).
    np.testing.assert_array_equal(np.asarray(q.data, np.float64), 2.0**-3)


def test_quantize_with_scale_ue8m0_refuses_non_pow2_scale():
    from fp8jax.quant import quantize_with_scale

    x = jnp.ones((2, 128), jnp.float32)
    with pytest.raises(ValueError, match="powers of two"):
        quantize_with_scale(x, jnp.float32(0.3), fp8jax.E4M3, "tensor", scale_fmt="ue8m0")

    def f(s):
        q = quantize_with_scale(x, s, fp8jax.E4M3, "tensor", scale_fmt="ue8m0")
        return fp8jax.dequantize(q)

    # Under jit the refused scale makes the values NaN, never a rounded scale.
    assert np.isnan(np.asarray(jax.jit(f)(jnp.float32(0.3)))).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(jnp.float32(0.25))), 1.0)


def test_ue8m0_scales_refuses_non_pow2_operand_and_float32_scales_decodes():
    from fp8jax.quant import float32_scales, ue8m0_scales

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)), jnp.float32)
    amax_q = fp8jax.quantize(x, fp8jax.E4M3, "tile")
    with pytest.raises(ValueError, match="powers of two"):
        ue8m0_scales(amax_q)
    p = fp8jax.quantize(x, fp8jax.E4M3, "tile", pow2=True)
    e = ue8m0_scales(p)
    assert e.scale.dtype == jnp.dtype(ml_dtypes.float8_e8m0fnu)
    back = float32_scales(e)
    np.testing.assert_array_equal(np.asarray(back.scale), np.asarray(p.scale))
    assert back.scale.dtype == jnp.float32


def _awkward(rng, shape):
    """Normal values with NaN, +-Inf, zero, subnormal, huge and tiny tiles mixed in."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :128] = 0.0  # an all-zero tile
    x[1, :128] = np.float32(1e-42) * rng.standard_normal(128).astype(np.float32)  # subnormal
    x[2, :128] *= np.float32(1e-30)  # a tiny scale (the offset division)
    x[3, :128] *= np.float32(3e38) / np.abs(x[3, :128]).max()  # near float32's max
    x[4, 5], x[5, 7], x[6, 9] = np.nan, np.inf, -np.inf
    x[7, 130:140] = 1e-39  # subnormal elements beside normal ones
    return x


@pytest.mark.parametrize("amax_floor", [0.0, 1e-30])
@pytest.mark.parametrize("jit", [False, True])
def test_tiny_tiles_are_exact_under_flush_to_zero(jit, amax_floor):
    # One tensor's only tiny tiles have float32 subnormal amaxes; another's
    # sit just either side of fmt_max * 2^-96 (where the plain division stops
    # being exact under flush-to-zero): the numpy reference's bits (numpy
    # keeps subnormals).
    bound = np.float32(448.0 * 2.0**-96)
    ramp = np.linspace(-1, 1, 128, dtype=np.float32)
    args = (fp8jax.E4M3, "tile", -1, 128, False, amax_floor, "float32")
    for amaxes in ([2.0**-130, 2.0**-149, 1.0, 0.0], [np.nextafter(bound, 0), bound, 1.0]):
        amaxes = np.float32(amaxes)
        x = np.repeat(amaxes[:, None], 128, axis=1) * ramp
        x[:, 0] = amaxes
        x = x.astype(np.float32)
        got = _jit(lambda x: quant.quantize(x, *args[:4], amax_floor=amax_floor), jit)(
            jnp.asarray(x)
        )
        groups = groups_for(x.shape, "tile", -1, 128)
        data, scale_el = ref_quantize_groups(x, groups, E4M3, amax_floor=amax_floor)
        np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), data.view(np.uint8))
        np.testing.assert_array_equal(
            np.asarray(got.scale)[:, 0], scale_el[:, 0].astype(np.float32)
        )
    # A subnormal tile's largest element maps to E4M3's max (not to NaN, as
    # a plain division by its flushed scale would give); 2^-149's scale is
    # the smallest subnormal itself (448 times less would round to 0), so 1.
    # With the floor, both tiles' scales are 1e-30 / 448: their codes are 0.
    x = jnp.asarray(np.float32([[2.0**-130] * 128, [2.0**-149] * 128, [1.0] * 128]))
    got = _jit(lambda x: quant.quantize(x, *args[:4], amax_floor=amax_floor), jit)(x)
    want = [448.0, 1.0] if amax_floor == 0 else [0.0, 0.0]
    np.testing.assert_array_equal(np.asarray(got.data, np.float64)[:2, 0], want)


@pytest.mark.parametrize("jit", [False, True])
def test_shift_offset_is_ldexp_exact_by_64(jit):
    # The per-element shift of the offset division against the exact ldexp.
    bits = np.array(
        [
            0,
            1,
            2,
            0x7FFFFF,
            0x800000,
            0x800001,
            0x3F800000,
            0x5F7FFFFF,
            0x5F800000,
            0x7F7FFFFF,
            0x7F800000,
            0x7FC00000,
        ],
        np.uint32,
    )
    x = np.concatenate([bits, bits | 0x80000000]).view(np.float32)
    x = np.concatenate([x, np.random.default_rng(1).standard_normal(1000).astype(np.float32)])
    shifted = np.arange(x.size) % 3 != 0
    got = _jit(scaling.shift_offset, jit)(jnp.asarray(x), jnp.asarray(shifted))
    with np.errstate(over="ignore"):  # beyond float32's range: +-Inf, as ldexp's
        want = np.where(shifted, np.ldexp(x.astype(np.float64), 64), x).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("jit", [False, True])
def test_divide_by_scale_is_the_correctly_rounded_quotient(jit):
    # Groups of 64 elements (normals of every size, subnormals, +-Inf), each
    # with one scale: normal, just above and below the 2^-96 offset limit,
    # subnormal.  float64 division rounded to float32 is the exact quotient
    # rounded once (53 >= 2 * 24 + 2 bits: the double rounding is innocuous).
    rng = np.random.default_rng(3)
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    scales = np.float32([0.75, 2.0**-96 * 1.5, 2.0**-97, 3e-39, 1000 * tiny, 7 * tiny, tiny])
    x = rng.standard_normal((scales.size, 64)) * np.exp2(rng.integers(-150, 60, (scales.size, 64)))
    x[:, :4] = np.array([np.inf, -np.inf, 5 * tiny, -tiny])
    x = x.astype(np.float32)
    got = _jit(quant.divide_by_scale, jit)(jnp.asarray(x), jnp.asarray(scales[:, None]))
    with np.errstate(over="ignore"):  # quotients past float32's range are +-Inf
        want = (x.astype(np.float64) / scales[:, None].astype(np.float64)).astype(np.float32)
    got = np.asarray(got)
    kept = ~(np.abs(want) < 2.0**-30)
    assert kept.sum() > x.size // 2 and (~kept).sum() > 10
    np.testing.assert_array_equal(got[kept].view(np.uint32), want[kept].view(np.uint32))
    # A smaller quotient (code 0 in every FP8 format) is exact or zero.
    small = got[~kept]
    assert np.all((small == want[~kept]) | (small == 0))


def test_float_amax_is_the_bits_amax_on_normal_and_nonfinite_values():
    # CUDA's float reduction against the bit patterns' (both run here; CPU
    # flushes subnormals in float arithmetic, so normal values, zeros, NaN, Inf).
    x = np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32) * 1e3
    x[0, 3], x[1, 4], x[2, :] = np.nan, -np.inf, 0.0
    for dt in (jnp.float32, jnp.bfloat16):
        xj = jnp.asarray(x).astype(dt)
        got = scaling._float_amax(xj, 1, True)
        want = scaling._bits_amax(xj, 1, True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fp8_codes_equal_the_hardware_cast_on_clipped_values():
    # GPUs and TPUs cast with the hardware conversion, the CPU on the bit
    # patterns: the same codes for every value the quantizer casts.
    rng = np.random.default_rng(3)
    for fmt in (fp8jax.E4M3, fp8jax.E5M2):
        m = float(ml_dtypes.finfo(fmt).max)
        y = np.concatenate(
            [
                rng.uniform(-m, m, 20000),
                rng.standard_normal(20000) * 1e-3,
                [
                    0.0,
                    -0.0,
                    m,
                    -m,
                    np.nan,
                    np.inf,
                    -np.inf,
                    1e-45,
                    float(ml_dtypes.finfo(fmt).smallest_subnormal) / 2,
                ],
            ]
        ).astype(np.float32)
        y = np.where(np.isinf(y), y, np.clip(y, -m, m)).astype(np.float32)
        got = np.asarray(formats.fp8_codes(jnp.asarray(y), fmt)).view(np.uint8)
        want = y.astype(fmt).view(np.uint8)
        np.testing.assert_array_equal(got, want)


def test_cpu_quantizer_compiles_without_branch_or_split_reduction():
    # The CPU's quantizer: one reduction kernel (no reduce-window, XLA's split
    # of a long reduction), no conditional; the same codes as everywhere.
    x = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
    for gran, axis in (("tile", -1), ("tile", 0), ("block", -1)):
        f = jax.jit(lambda x, g=gran, a=axis: quant.quantize(x, fp8jax.E4M3, g, a).data)
        text = f.trace(x).lower(lowering_platforms=("cpu",)).compile().as_text()
        assert "reduce-window" not in text and "conditional" not in text, (gran, axis)


# ---------------------------------------------------------------- GPU quantizer choice


@pytest.fixture
def hopper_attached(monkeypatch):
    """A Hopper GPU as the kernels' choice sees one, its bit check passed; the
    timing decision asked afresh."""
    from fp8jax.kernels import gpu_quantize

    monkeypatch.setattr(quant.platforms, "local_cuda_capability", lambda: "9.0")
    monkeypatch.setattr(gpu_quantize, "_passed", lambda kind: True)
    monkeypatch.delenv(gpu_quantize.OPT_IN, raising=False)
    quant._gpu_kernels_faster.cache_clear()
    yield
    quant._gpu_kernels_faster.cache_clear()


@pytest.mark.parametrize("kernels_us, taken", [(50.0, True), (90.0, False)])
def test_gpu_kernels_taken_only_where_no_slower_than_xla(
    hopper_attached, monkeypatch, caplog, kernels_us, taken
):
    from fp8jax.kernels import mgpu_quantize

    times = {"n": 4096, "kernels_us": kernels_us, "xla_us": 70.0}
    monkeypatch.setattr(quant, "gpu_kernels_time", lambda kind: times)
    with caplog.at_level("WARNING"):
        got = quant.gpu_kernels()
    assert got is (mgpu_quantize if taken else None)
    # The decision and its numbers are logged once.
    assert "mosaic quantizer kernels" in caplog.text and "70.0 us" in caplog.text
    caplog.clear()
    quant.gpu_kernels()
    assert caplog.text == ""


def test_gpu_kernels_time_runs_both_quantizers():
    # Interpreted on this CPU: the numbers say nothing of a GPU, only that both ran.
    times = quant.gpu_kernels_time("mosaic", n=256, interpret=True, iters=1)
    assert times["n"] == 256 and times["kernels_us"] > 0 and times["xla_us"] > 0


def test_group_rows_buckets_hold_their_groups_with_a_quarter_to_spare():
    for n in list(range(1, 300)) + [1023, 1024, 1025, 5000, 65537]:
        b = quant.group_rows_bucket(n)
        assert b >= n and (b <= max(5, n * 5 // 4) or n < 5)
        top = 1 << (b - 1).bit_length()
        assert b * 8 % top == 0 and b * 8 // top in (5, 6, 7, 8)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "shape,granularity,axis,tile",
    [
        ((1, 128, 64), "tile", 2, 128),
        ((10, 128, 192), "tile", 1, 128),
        ((2, 64, 2, 256), "tile", -1, 128),
        ((5, 7, 300), "tile", 0, 32),
        ((300,), "tile", 0, 128),
        ((1, 64, 192), "block", 1, 128),
        ((300, 200), "block", 1, 128),
        ((33, 70, 3), "block", -1, 16),
    ],
)
def test_group_rows_quantize_as_the_one_pass(jit, shape, granularity, axis, tile):
    # The CPU's bucketed layout against the one pass, bit for bit: partial
    # edge tiles and blocks, every axis, NaN / Inf / zero elements, values
    # from about e^-100 to e^80, an operand of float32 subnormals (every
    # scale subnormal), float32 and bfloat16, float32 and UE8M0 scales.
    rng = np.random.default_rng(4)
    wide = rng.standard_normal(shape) * np.exp(rng.uniform(-100, 80, shape))
    wide.flat[:3] = [np.nan, np.inf, 0.0]
    tiny = rng.standard_normal(shape) * 1e-40
    for x, dtype in itertools.product((wide, tiny), (jnp.float32, jnp.bfloat16)):
        xd = jnp.asarray(x.astype(np.float32), dtype)
        for pow2, scale_fmt in ((False, "float32"), (True, "ue8m0")):
            args = (fp8jax.E4M3, granularity, axis, tile, pow2, 0.0, scale_fmt)
            # The one pass as quantize runs it, under jit (op by op, XLA's CPU
            # moves bfloat16 through float32 and flushes its subnormals).
            one = jax.jit(lambda x, a=args: quant._quantize_one_pass(x, *a))(xd)
            rows = _jit(lambda x, a=args: quant._quantize_as_group_rows(x, *a), jit)(xd)
            assert rows.layout == one.layout and rows.scale.shape == one.scale.shape
            np.testing.assert_array_equal(
                np.asarray(rows.data).view(np.uint8), np.asarray(one.data).view(np.uint8)
            )
            np.testing.assert_array_equal(
                np.asarray(rows.scale).view(np.uint8), np.asarray(one.scale).view(np.uint8)
            )
