"""The Pallas TPU quantizer in TPU interpret mode on CPU: the same codes and scales as
``fp8jax.quantize``, bit for bit; and, where libtpu is installed, compiled for a TPU
as the quantizer's one kernel.

``fp8jax.quantize`` on CPU is the reference here (its own tests check it
against numpy / ml_dtypes in float64): the kernel must give its bits for
every group kind, format and scale option, on data that hits every guard
(NaN, +-Inf, all-zero groups, float32 subnormals, values past the format's
range) and on shapes that are not multiples of the blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import quant
from fp8jax.kernels import tpu_quantize as tq

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
GRANULARITY = {"row": ("tile", -1), "col": ("tile", 0), "block": ("block", -1)}


def _data(shape, dtype, seed=0):
    """Values over many binades, with every special case of the quantizer's guards."""
    rng = np.random.default_rng(seed)
    r, c = shape
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-20, 20, (r, 1)))
    x[0, 1], x[1, 0], x[2, 2] = np.nan, np.inf, -np.inf
    x[3, :] = 0.0  # all-zero row tiles
    x[:, 4] = 0.0  # all-zero column tiles
    if dtype == jnp.float32:
        x[5, :] = rng.standard_normal(c) * 1e-41  # float32 subnormals
    x[6, 7] = 3e38  # past every format's range
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _bits(a) -> np.ndarray:
    """The bit patterns of codes or scales, an FP8 NaN as 0xFF whatever its payload and
    sign: XLA's CPU casts give an E5M2 NaN one payload or another by the shape of the
    loop they run in (the reference's and interpret mode's alike)."""
    a = np.asarray(a)
    bits = a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])
    if a.dtype.itemsize == 1:
        bits = np.where(np.isnan(a.astype(np.float32)), np.uint8(0xFF), bits)
    return bits


def _reference(x, fmt, orient, **kw):
    granularity, axis = GRANULARITY[orient]
    return quant.quantize(x, fmt, granularity, axis=axis, **kw)


@pytest.mark.parametrize("orient", tq.ORIENTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_kernel_gives_quantize_bits(orient, dtype, fmt):
    x = _data((300, 260), dtype)
    codes, scales = tq.quantize_2d(x, fmt=fmt, orient=orient, interpret=True)
    want = _reference(x, fmt, orient)
    assert codes.dtype == fmt and codes.shape == x.shape
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


@pytest.mark.parametrize("orient", tq.ORIENTS)
def test_kernel_scale_options(orient):
    # Power-of-two scales (DeepSeek-V3.1's UE8M0 ones, floored at 2^-127),
    # and an amax floor (DeepGEMM's 1e-4).
    x = _data((160, 384), jnp.float32, seed=1)
    for kw in (
        dict(pow2=True),
        dict(pow2=True, scale_fmt="ue8m0"),
        dict(amax_floor=1e-4),
    ):
        codes, scales = tq.quantize_2d(
            x,
            fmt=E4M3,
            orient=orient,
            pow2=kw.get("pow2", False),
            amax_floor=kw.get("amax_floor", 0.0),
            ue8m0=kw.get("scale_fmt") == "ue8m0",
            interpret=True,
        )
        want = quant.float32_scales(_reference(x, E4M3, orient, **kw))
        np.testing.assert_array_equal(_bits(codes), _bits(want.data), err_msg=str(kw))
        np.testing.assert_array_equal(_bits(scales), _bits(want.scale), err_msg=str(kw))


def test_kernel_under_jit_and_small_shapes():
    # A shape smaller than one block in both axes; jitted around the kernel.
    x = _data((40, 130), jnp.bfloat16, seed=2)
    f = jax.jit(lambda x: tq.quantize_2d(x, fmt=E4M3, orient="col", interpret=True))
    codes, scales = f(x)
    want = _reference(x, E4M3, "col")
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


def _assert_rows_cols(got, x, fmt, **kw):
    """The kernel's four outputs against fp8jax.quantize along each of x's two axes."""
    for (codes, scales), axis in zip((got[:2], got[2:]), (1, 0)):
        want = quant.float32_scales(quant.quantize(x, fmt, "tile", axis=axis, **kw))
        assert codes.shape == want.data.shape and scales.shape == want.scale.shape
        np.testing.assert_array_equal(_bits(codes), _bits(want.data), err_msg=f"{axis} {kw}")
        np.testing.assert_array_equal(_bits(scales), _bits(want.scale), err_msg=f"{axis} {kw}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_rows_cols_kernel_gives_both_layouts_bits(dtype, fmt):
    # An output gradient's 1x128 tiles (Dgrad) and 128-token tiles (Wgrad)
    # from one read, on a shape that is not a multiple of 128 either way.
    x = _data((300, 260), dtype, seed=4)
    _assert_rows_cols(tq.quantize_rows_cols(x, fmt=fmt, interpret=True), x, fmt)


def test_rows_cols_kernel_scale_options_blocks_and_jit():
    # More rows than 1024 (9 groups of 128: one block of 1152, not two of
    # 1024); power-of-two, UE8M0 and floored scales; jitted around it.
    x = _data((1100, 130), jnp.float32, seed=5)
    _assert_scale_options_under_jit(tq.quantize_rows_cols, x, (dict(), *SCALE_OPTIONS))


@pytest.mark.parametrize(
    "groups, cap, want", [(3, 8, 3), (8, 8, 8), (12, 8, 12), (16, 8, 8), (18, 8, 8), (56, 8, 8)]
)
def test_blocks_take_whole_axes_rather_than_padding(groups, cap, want):
    # 1536 rows: one block of 12 groups (its scale block the whole scale
    # axis), not padded to 2048; past 16 groups that do not divide, padded.
    assert tq.groups_per_block(groups, cap) == want


def test_block_quantizer_columns_are_not_padded_past_the_lane_tile():
    # W (7168, 576), DeepSeek-V3's kv_a: 5 column groups in one block of 640,
    # not two of 512; 1536 rows in one block of 12 groups.
    assert tq._blocks(7168, 576, "block", 2) == (1024, 640)
    assert tq._blocks(1536, 7168, "col", 2) == (1536, 512)


@pytest.mark.parametrize("orient", ["col", "block"])
def test_an_axis_of_twelve_groups_gives_quantize_bits(orient):
    x = _data((1536, 200), jnp.bfloat16, seed=6)
    codes, scales = tq.quantize_2d(x, fmt=E4M3, orient=orient, interpret=True)
    want = _reference(x, E4M3, orient)
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


#: Power-of-two, UE8M0 and floored scales (quant.quantize's keywords).
SCALE_OPTIONS = (dict(pow2=True), dict(pow2=True, scale_fmt="ue8m0"), dict(amax_floor=1e-4))


def _assert_scale_options_under_jit(rows_cols, x, options):
    """A ``quantize_rows_cols`` (TPU or GPU kernel, interpreted) jitted with each of
    ``options``, against fp8jax.quantize along each axis."""
    for kw in options:
        f = jax.jit(
            lambda x, kw=kw: rows_cols(
                x,
                fmt=E4M3,
                pow2=kw.get("pow2", False),
                amax_floor=kw.get("amax_floor", 0.0),
                ue8m0=kw.get("scale_fmt") == "ue8m0",
                interpret=True,
            )
        )
        _assert_rows_cols(f(x), x, E4M3, **kw)


@pytest.mark.parametrize("cache_fmt, fmt", [(E4M3, E4M3), (E5M2, E4M3)])
@pytest.mark.parametrize("subnormal_scales", [False, True])
def test_requantize_gives_dequantize_then_quantize_bits(cache_fmt, fmt, subnormal_scales):
    # DeepSeek-V3's cached activation for Wgrad: FP8 codes in 1x128 tiles,
    # quantized again in 128-token tiles from the values they hold.
    x = np.asarray(_data((300, 260), jnp.float32, seed=3))
    x = np.where(np.isfinite(x), x, 1.0)
    if subnormal_scales:
        # A tile of tiny values: its scale is a float32 subnormal, and the
        # dequantizer forms every product on the bit patterns.
        x[9, :] *= 1e-36
    cached = quant.quantize(jnp.asarray(x), cache_fmt, "tile", axis=1)
    codes, scales = tq.requantize_col(cached.data, cached.scale, fmt=fmt, interpret=True)
    want = quant.quantize(quant.dequantize(cached), fmt, "tile", axis=0)
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


def test_requantize_of_nine_row_groups_gives_dequantize_then_quantize_bits():
    # 1100 rows: one block of 9 groups, whose scale rows are stored as a run of
    # 8 gathered in the loop and a last run of 1.
    x = np.asarray(_data((1100, 260), jnp.float32, seed=7))
    x = np.where(np.isfinite(x), x, 1.0)
    cached = quant.quantize(jnp.asarray(x), E4M3, "tile", axis=1)
    codes, scales = jax.jit(lambda d, s: tq.requantize_col(d, s, fmt=E4M3, interpret=True))(
        cached.data, cached.scale
    )
    want = quant.quantize(quant.dequantize(cached), E4M3, "tile", axis=0)
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


def kernel_equations(fn, *args) -> int:
    """Equations of ``fn``'s jaxpr, those of every nested jaxpr (the Pallas kernel's
    body, a loop's body) counted once each."""

    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            total += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        total += count(sub)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize(
    "name, fn, one_shape, eight_shape",
    [
        ("rows_cols", lambda x: tq.quantize_rows_cols(x, fmt=E4M3), (128, 1024), (1024, 1024)),
        (
            "requantize_col",
            lambda x: tq.requantize_col(x.astype(E4M3), x[:, ::128], fmt=E4M3),
            (128, 1024),
            (1024, 1024),
        ),
        ("row", lambda x: tq.quantize_2d(x, fmt=E4M3, orient="row"), (256, 256), (256, 1024)),
        ("col", lambda x: tq.quantize_2d(x, fmt=E4M3, orient="col"), (128, 512), (1024, 512)),
        ("block", lambda x: tq.quantize_2d(x, fmt=E4M3, orient="block"), (128, 512), (1024, 512)),
    ],
)
def test_kernels_hold_the_code_of_one_row_of_groups(name, fn, one_shape, eight_shape):
    # A block of 8 rows of 128 x 128 groups (the row quantizer's: 8 tiles
    # along its rows) goes through them in a loop: its kernel holds about the
    # code of a block of one row (two tiles). Unrolled it was 4-8 times as
    # much, and libtpu compiled dy's both-layout quantizer and the requantizer
    # of one 4096^3 GEMM's fwd+bwd 6 s and 13 s, the row quantizer of 4096 x
    # 7168 4 s; the traced equations stand in for that here.
    one = kernel_equations(fn, jnp.zeros(one_shape, jnp.float32))
    eight = kernel_equations(fn, jnp.zeros(eight_shape, jnp.float32))
    assert eight < 1.5 * one, (name, one, eight)


@pytest.mark.parametrize("tiny_row", [None, 20, 290])
def test_requantize_token_tiles_with_the_cache_flag(tiny_row):
    # The grouped Wgrad's x: the cache's codes and scales laid out in expert
    # tiles (padding code 0, scale 1), requantized per tile with the whole
    # cache's subnormal flag; row 290 is in no expert, yet its tiny scale
    # decides how every element is dequantized.
    from fp8jax.groups import group_layout, to_tiles

    x = np.asarray(_data((300, 260), jnp.float32, seed=5))
    x = np.where(np.isfinite(x), x, 1.0)
    x[5, :] = 1.0  # no float32 subnormals but those of the tiny row
    # Expert 0's first columns: normal scales (2^-120) whose products with
    # subnormal codes are float32 subnormals, which only the bit-pattern
    # product keeps: there the flag decides the requantized codes.
    x[:100, 0], x[:100, 1:128] = 448.0 * 2.0**-120, 2.0**-129
    if tiny_row is not None:
        x[tiny_row, :] = np.linspace(-1.0, 1.0, 260) * 1e-37  # scale about 2e-40
    cached = quant.quantize(jnp.asarray(x), E4M3, "tile", axis=1)
    layout = group_layout(jnp.asarray([100, 0, 150, 30]), 300, 128)
    want = quant.quantize(to_tiles(quant.dequantize(cached), layout), E4M3, "tile", axis=1)
    flag = tq.subnormal_scales(cached.scale)
    assert bool(flag) == (tiny_row is not None)
    codes, scales = jax.vmap(lambda d, s: tq.requantize_col(d, s, flag, fmt=E4M3, interpret=True))(
        to_tiles(cached.data, layout), to_tiles(cached.scale, layout, fill=1.0)
    )
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


def test_refuses_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="orient"):
        tq.quantize_2d(jnp.ones((128, 128)), fmt=E4M3, orient="diagonal", interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        tq.quantize_2d(jnp.ones((2, 128, 128)), fmt=E4M3, orient="row", interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        tq.quantize_rows_cols(jnp.ones((128,)), fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        tq.requantize_col(jnp.ones((2, 128, 128), E4M3), jnp.ones((2, 128, 1)), fmt=E4M3)


def test_quantizer_chooses_the_kernel_for_its_groups():
    x2, x3 = jnp.ones((256, 384), jnp.bfloat16), jnp.ones((2, 256, 384), jnp.float32)
    orient = quant.tpu_quantizer_orient
    assert orient(x3, E4M3, "tile", -1, 128) == "row"
    assert orient(x2, E4M3, "tile", 0, 128) == "col"
    assert orient(x3, E5M2, "tile", 1, 128) == "col"
    assert orient(x2, E4M3, "block", -1, 128) == "block"
    # Not the kernel's: other tiles, formats, inputs, groups.
    assert orient(x2, E4M3, "tile", -1, 32) is None
    assert orient(x2, jnp.float8_e4m3fnuz, "tile", -1, 128) is None
    assert orient(x2.astype(jnp.float16), E4M3, "tile", -1, 128) is None
    assert orient(x3, E4M3, "tile", 0, 128) is None
    assert orient(x2, E4M3, "row", -1, 128) is None


def test_requantize_is_chosen_for_tiles_moving_axis():
    from fp8jax import recipes
    from fp8jax.operands import requantize_kernel_fits

    spec = recipes.deepseek_v3().wgrad.lhs
    for shape in [(256, 384), (2, 256, 384)]:
        cached = quant.quantize(jnp.ones(shape), E4M3, "tile", axis=-1)
        assert requantize_kernel_fits(cached, spec, len(shape) - 2)
        # Along any other axis, from other tiles, or to another granularity: not the kernel's.
        assert not requantize_kernel_fits(cached, spec, len(shape) - 1)
        assert not requantize_kernel_fits(cached, dataclasses.replace(spec, granularity="block"), 0)
    cols = quant.quantize(jnp.ones((256, 384)), E4M3, "tile", axis=0)
    assert not requantize_kernel_fits(cols, spec, 0)


@pytest.mark.parametrize(
    "granularity, axis, shape",
    [("tile", -1, (2, 256, 512)), ("tile", 0, (512, 256)), ("block", -1, (384, 512))],
)
def test_quantize_compiles_to_the_kernel_for_tpu(granularity, axis, shape):
    pytest.importorskip("libtpu")
    from fp8jax.bench import compilers

    def q(x):
        out = quant.quantize(x, E4M3, granularity, axis=axis)
        return out.data, out.scale

    c = compilers.compile_for(q, [jax.ShapeDtypeStruct(shape, jnp.bfloat16)], "tpu7x")
    kernels = [
        line for line in c.text.splitlines() if "fp8_quantize_" in line and "custom-call(" in line
    ]
    assert len(kernels) == 1, kernels
    # One read of x: no fusion of XLA's touches the full-size data.
    census = compilers.census(c)
    assert census.fusions == 0 and not census.gemm_kernels


def _called(fn, arrays, out_shape):
    # over_matrices' call, run here and now (interpret mode), its declared shapes checked.
    got = fn(*arrays)
    if out_shape is not None:
        assert [(g.shape, g.dtype) for g in jax.tree.leaves(got)] == [
            (o.shape, o.dtype) for o in out_shape
        ]
    return got


@pytest.mark.parametrize(
    "shape, as_rows",
    [
        ((1, 256, 384), {"row", "col", "block", "rows_cols"}),
        ((3, 256, 260), {"row", "col", "block", "rows_cols"}),
        ((2, 3, 128, 200), {"row", "col", "block", "rows_cols"}),
        ((2, 130, 200), {"row"}),
    ],
)
def test_a_stack_of_matrices_is_quantized_as_each_matrix_alone(shape, as_rows):
    # One matrix, or a stack whose groups stay inside each matrix, goes to the
    # kernel as one 2-D call; any other stack is vmapped.  Every way gives
    # each matrix's own codes and scales.
    from functools import partial

    rng = np.random.default_rng(1)
    mags = np.exp2(rng.uniform(-20, 20, shape[:-1] + (1,)))
    x = jnp.asarray(rng.standard_normal(shape) * mags, jnp.bfloat16)
    runs = {o: partial(tq.quantize_2d, fmt=E4M3, orient=o, interpret=True) for o in tq.ORIENTS}
    runs["rows_cols"] = partial(tq.quantize_rows_cols, fmt=E4M3, interpret=True)
    mats = x.reshape((-1,) + shape[-2:])
    for name, fn in runs.items():
        assert tq._stacks_as_rows(fn, (x,)) == (name in as_rows), name
        got = tq.over_matrices(fn, (x,), _called)
        alone = [fn(m) for m in mats]
        for k, g in enumerate(got):
            want = np.stack([np.asarray(a[k]) for a in alone]).reshape(g.shape)
            np.testing.assert_array_equal(_bits(g), _bits(want), err_msg=f"{name} result {k}")


@pytest.mark.parametrize(
    "shape, view",
    [((64, 2, 256), (64, 512)), ((3, 32, 2, 384), (96, 768)), ((64, 2, 200), (128, 200))]
    + [((64, 8, 256), (512, 256)), ((128, 256), (128, 256))],
)
def test_a_short_split_axis_joins_the_rows_it_was_split_from(shape, view):
    # (..., 2, F): SwiGLU's gate and up, split from a (..., 2F) GEMM output.
    # With F a whole number of tiles the row kernel quantizes (..., 2F) rows
    # (the tiles are the same), else (..., 2) rows of F; a longer axis is rows.
    assert quant._row_view(shape, 128) == view
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape) * np.exp2(rng.uniform(-9, 9, shape)), jnp.bfloat16)
    run = functools.partial(tq.quantize_2d, fmt=E4M3, orient="row", interpret=True)
    codes, scales = run(x.reshape(view))
    want = quant.quantize(x, E4M3, "tile", axis=-1)
    np.testing.assert_array_equal(_bits(codes.reshape(shape)), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales.reshape(want.scale.shape)), _bits(want.scale))


def test_a_split_quantizes_for_tpu_as_the_array_it_was_split_from():
    pytest.importorskip("libtpu")
    from fp8jax.bench import compilers

    def q(h):
        out = quant.quantize(h.reshape(256, 2, 384), E4M3, "tile", axis=-1)
        return out.data, out.scale

    c = compilers.compile_for(q, [jax.ShapeDtypeStruct((256, 768), jnp.bfloat16)], "tpu7x")
    kernels = [
        line for line in c.text.splitlines() if "fp8_quantize_" in line and "custom-call(" in line
    ]
    # The kernel reads h as it is: no copy of it into 512 rows of 384.
    assert len(kernels) == 1 and "bf16[256,768]" in kernels[0], kernels
    assert "bf16[512,384]" not in c.text


def test_a_stack_of_matrices_compiles_to_one_two_dimensional_kernel_for_tpu():
    pytest.importorskip("libtpu")
    from fp8jax.bench import compilers

    def q(w):
        out = quant.quantize(w, E4M3, "block")
        return out.data, out.scale

    c = compilers.compile_for(q, [jax.ShapeDtypeStruct((3, 256, 512), jnp.bfloat16)], "tpu7x")
    kernels = [
        line for line in c.text.splitlines() if "fp8_quantize_" in line and "custom-call(" in line
    ]
    # The three experts' blocks as the rows of one (768, 512) matrix.
    assert len(kernels) == 1 and "bf16[768,512]" in kernels[0], kernels


def test_rows_and_cols_compile_to_one_kernel_for_tpu():
    pytest.importorskip("libtpu")
    from fp8jax.bench import compilers

    def q(x):
        rows, cols = quant.quantize_rows_and_cols(x, E4M3)
        return rows.data, rows.scale, cols.data, cols.scale

    c = compilers.compile_for(q, [jax.ShapeDtypeStruct((2, 256, 512), jnp.bfloat16)], "tpu7x")
    kernels = [
        line for line in c.text.splitlines() if "fp8_quantize_" in line and "custom-call(" in line
    ]
    assert len(kernels) == 1 and "fp8_quantize_rows_cols" in kernels[0], kernels


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (64, 64)])
def test_result_shapes_are_the_kernels_own(shape):
    # What on_tpu / on_gpu declare, so that the kernel waits for a TPU (CUDA)
    # lowering to be traced, against what tracing the entry points gives.
    from functools import partial

    from fp8jax.kernels import gpu_quantize as gq

    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    codes = jax.ShapeDtypeStruct(shape, E4M3)
    scales = jax.ShapeDtypeStruct((shape[0], -(-shape[1] // 128)), jnp.float32)
    runs = [(partial(tq.quantize_2d, fmt=E4M3, orient=o, interpret=True), (x,)) for o in tq.ORIENTS]
    runs += [
        (partial(tq.quantize_rows_cols, fmt=E4M3, interpret=True), (x,)),
        (partial(tq.requantize_col, fmt=E4M3, interpret=True), (codes, scales)),
        (partial(gq.quantize_2d, fmt=E4M3, orient="row", interpret=True), (x,)),
        (partial(gq.quantize_rows_cols, fmt=E4M3, interpret=True), (x,)),
        (partial(gq.requantize_col_t, fmt=E4M3, interpret=True), (codes, scales)),
    ]
    for fn, args in runs:
        traced = jax.tree.leaves(jax.eval_shape(fn, *args))
        declared = tq.result_shapes(fn, shape)
        assert [(t.shape, t.dtype) for t in traced] == [(d.shape, d.dtype) for d in declared], fn
    # Unknown functions and bound arrays: traced as they are called.
    assert tq.result_shapes(jnp.abs, shape) is None
    bound = partial(tq.requantize_col, subnormal=jnp.asarray(False), fmt=E4M3)
    assert tq.result_shapes(bound, shape) is None


def test_quantize_for_tpu_traces_no_kernel_until_lowered():
    # The TPU branch of a quantization holds the kernel unlowered: a CPU
    # lowering never traces it, a TPU lowering does.
    x = jax.ShapeDtypeStruct((2, 256, 384), jnp.bfloat16)
    traced = jax.jit(lambda x: quant.quantize(x, E4M3, "tile").data).trace(x)
    text = str(traced.jaxpr)
    assert "fp8jax_only_on_deferred" in text and "pallas_call" not in text
    tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert "fp8_quantize_row" in tpu
