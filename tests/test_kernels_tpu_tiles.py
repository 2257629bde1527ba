"""The Pallas TPU kernels that lay rows out in expert-aligned tiles and take them back, in
TPU interpret mode on CPU: every row's bit pattern where numpy's gather puts it and the
values of ``fp8jax.groups``' gathers of rows (NaN, -0, Inf, every dtype width the kernels
move); and, where libtpu is installed, the kernels in a TPU program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import groups
from fp8jax.kernels import tpu_tiles

DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32, jnp.int32]


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _rows(shape, dtype, seed=0):
    """Values with NaN, +-Inf and -0 among them (integers: any bits)."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-(2**31), 2**31 - 1, shape), dtype)
    x = (rng.standard_normal(shape) * 8).astype(np.float32)
    flat = x.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0], np.float32)
    flat[rng.choice(flat.size, 4 * min(8, flat.size // 4), replace=False)] = np.repeat(
        specials, min(8, flat.size // 4)
    )
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sizes, m, tail",
    [
        ([100, 0, 57, 120], 300, (256,)),  # groups ending anywhere, an empty one
        ([5, 300, 0, 130, 1, 256], 700, (3, 5)),  # trailing axes, rows past the groups
        ([128, 128], 256, ()),  # one value per row, whole tiles
        ([0, 0], 40, (8,)),  # no rows in any group
        ([40], 40, (600,)),  # fewer rows than a tile, columns past one block
    ],
)
def test_kernel_tiles_are_the_row_gather(sizes, m, tail, dtype):
    a = _rows((m,) + tail, dtype, seed=m)
    layout = groups.group_layout(jnp.asarray(sizes, jnp.int32), m)
    for fill in (0, 1):
        got = groups._to_tiles_kernel(a, layout, fill, interpret=True)
        want = groups._to_tile_rows(a, layout, fill)
        assert got.shape == want.shape and got.dtype == want.dtype
        # Every bit pattern moved as it is, and XLA's gather of rows: NaNs
        # compared as NaNs (XLA's CPU moves of 8-bit floats, the interpret
        # mode's too, may give a NaN another payload).
        for ref in (_numpy_tiles(a, layout, fill), _bits(want)):
            _assert_same_bits(got, ref)


def _assert_same_bits(got, ref_bits):
    nan = np.isnan(np.asarray(got, np.float32))
    ref = ref_bits.view(np.asarray(got).dtype)
    np.testing.assert_array_equal(np.isnan(np.asarray(ref, np.float32)), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], ref_bits[~nan])


def _numpy_tiles(a, layout, fill):
    """The tiles' bit patterns by numpy: each valid aligned row is its source row's bits."""
    bits = _bits(a)
    fill_bits = _bits(np.asarray(jnp.asarray(fill, a.dtype)))
    out = np.broadcast_to(fill_bits, (layout.src_row.shape[0],) + bits.shape[1:]).copy()
    valid = np.asarray(layout.row_valid)
    out[valid] = bits[np.asarray(layout.src_row)[valid]]
    return out.reshape((layout.num_tiles, layout.tile) + bits.shape[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sizes, m, tail",
    [
        ([100, 0, 57, 120], 300, (256,)),  # blocks of several experts, an empty one
        ([3, 700], 703, (128,)),  # a shifted group over blocks: first tiles carried
        ([5, 300, 0, 130, 1, 256], 700, (3, 5)),  # trailing axes, rows past the groups
        ([128, 128], 256, ()),  # whole tiles: every window on a tile's first row
        ([0, 0], 40, (8,)),  # no rows in any group: zeros
        ([40], 40, (600,)),  # fewer rows than a tile, columns past one block
    ],
)
def test_kernel_rows_are_the_row_gather(sizes, m, tail, dtype):
    layout = groups.group_layout(jnp.asarray(sizes, jnp.int32), m)
    t = _rows((layout.num_tiles, layout.tile) + tail, dtype, seed=m + 1)
    got = groups._from_tiles_kernel(t, layout, interpret=True)
    want = groups._from_tile_rows(t, layout)
    assert got.shape == want.shape and got.dtype == want.dtype
    for ref in (_numpy_rows(t, layout), _bits(want)):
        _assert_same_bits(got, ref)


def _numpy_rows(t, layout):
    """The rows' bit patterns by numpy: row m is its aligned row's bits, or zeros."""
    bits = _bits(t).reshape((-1,) + t.shape[2:])
    out = np.zeros((layout.dst_row.shape[0],) + bits.shape[1:], bits.dtype)
    in_group = np.asarray(layout.in_group)
    out[in_group] = bits[np.asarray(layout.dst_row)[in_group]]
    return out


def test_window_segments_cover_every_block_in_order():
    # Segments begin at every block and at every group's end; those of rows in
    # no group write nothing.
    sizes = jnp.asarray([3, 0, 200, 61, 130], jnp.int32)
    layout = groups.group_layout(sizes, 500)
    block, start, lo_row, hi_row = map(np.asarray, groups.window_segments(layout))
    assert block.shape == (4 + 5,)
    assert np.all(np.diff(block) >= 0) and set(block) == {0, 1, 2, 3}
    written = hi_row > lo_row
    assert np.all(np.diff(start[written]) >= 0)
    # Every row in a group is written by exactly one segment.
    rows = np.zeros(500, int)
    for b, lo, hi in zip(block, lo_row, hi_row):
        rows[b * 128 + lo : b * 128 + hi] += 1
    np.testing.assert_array_equal(rows, np.asarray(layout.in_group).astype(int))


@pytest.mark.parametrize("jit", [False, True])
def test_kernel_rows_under_jit(jit):
    layout = groups.group_layout(jnp.asarray([70, 200, 0, 129], jnp.int32), 500)
    t = _rows((layout.num_tiles, layout.tile, 128), jnp.float32, seed=4)
    run = groups._from_tiles_kernel
    if jit:
        run = jax.jit(run, static_argnums=(2,))
    _assert_same_bits(run(t, layout, True), _numpy_rows(t, layout))


@pytest.mark.parametrize("jit", [False, True])
def test_kernel_tiles_under_jit(jit):
    a = _rows((500, 128), jnp.bfloat16, seed=3)
    layout = groups.group_layout(jnp.asarray([70, 200, 0, 129], jnp.int32), 500)
    run = groups._to_tiles_kernel
    if jit:
        run = jax.jit(run, static_argnums=(2, 3))
    got = run(a, layout, 0, True)
    _assert_same_bits(got, _numpy_tiles(a, layout, 0))


def test_kernel_refuses_what_it_cannot_move():
    start = count = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="2-D"):
        tpu_tiles.window_tiles(jnp.zeros((256,)), start, count, tile=128)
    with pytest.raises(ValueError, match="multiple of 32"):
        tpu_tiles.window_tiles(jnp.zeros((256, 8)), start, count, tile=100)
    for dtype in (jnp.complex64, jnp.bool_):
        with pytest.raises(ValueError, match="1-, 2- and 4-byte"):
            tpu_tiles.window_tiles(jnp.zeros((256, 8), dtype), start, count, tile=128)
    with pytest.raises(ValueError, match="same 1-D shape"):
        tpu_tiles.window_tiles(jnp.zeros((256, 8)), start, count[:1], tile=128)
    segs = (start,) * 4
    with pytest.raises(ValueError, match="2-D"):
        tpu_tiles.window_rows(jnp.zeros((256,)), *segs, rows=256, tile=128)
    with pytest.raises(ValueError, match="multiple of 32"):
        tpu_tiles.window_rows(jnp.zeros((256, 8)), *segs, rows=256, tile=100)
    with pytest.raises(ValueError, match="1-, 2- and 4-byte"):
        tpu_tiles.window_rows(jnp.zeros((256, 8), jnp.bool_), *segs, rows=256, tile=128)
    with pytest.raises(ValueError, match="one 1-D shape"):
        tpu_tiles.window_rows(jnp.zeros((256, 8)), *segs[:3], start[:1], rows=256, tile=128)


def test_tpu_program_takes_the_kernel():
    from fp8jax.bench import compilers

    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)

    def tiles(a, sizes):
        return groups.to_tiles(a, groups.group_layout(sizes, a.shape[0]))

    args = (
        jax.ShapeDtypeStruct((1024, 256), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    compiled = compilers.compile_for(tiles, args, t)
    assert "fp8_window_tiles" in compiled.text
    census = compilers.census(compiled)
    # No GEMM, and no gather turned into a loop.
    assert census.gemm_kernels == {} and census.loops == []


def test_tpu_grouped_gemm_takes_the_kernel_and_keeps_its_gemms():
    """The grouped GEMM's forward and backward on tpu7x lay their rows out with the tiles'
    kernel, and the census counts its three GEMM kernels, none of them as a tile kernel."""
    import fp8jax
    from fp8jax.bench import compilers
    from fp8jax.registry import get

    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)

    def fwd_bwd(x, w):
        sizes = jnp.full((4,), x.shape[0] // 4, jnp.int32)
        y, vjp = jax.vjp(
            lambda x, w: fp8jax.ragged_dot(x, w, sizes, recipe=get("deepseek_v3")), x, w
        )
        return vjp(y)

    args = (
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16),
    )
    compiled = compilers.compile_for(fwd_bwd, args, t)
    assert "fp8_window_tiles" in compiled.text and "fp8_window_rows" in compiled.text
    # Fprop, Dgrad and Wgrad.
    assert compilers.census(compiled).gemm_kernels == {"Mosaic TPU": 3}
