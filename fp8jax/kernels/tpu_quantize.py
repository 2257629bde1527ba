"""Online FP8 quantization (DeepSeek-V3 1x128 tiles, 128x1 tiles, 128x128 blocks) as a
Pallas TPU (Mosaic) kernel: x is read from HBM once, codes and scales written once.

The numerics are :func:`fp8jax.quant.quantize`'s on a TPU, operation for
operation, so the codes and scales are the same bits:

* amax per group over the finite elements, on the float32 bit patterns
  (exact under flush-to-zero, NaN and +-Inf ignored);
* the scale from it by :func:`fp8jax.scaling.scale_from_amax` (correctly
  rounded amax / fmt_max, the subnormal and zero guards, ``pow2`` rounding,
  ``amax_floor``), floored at 2^-127 for UE8M0 scales;
* x / scale correctly rounded (the offset division, immune to
  flush-to-zero), saturated to +-fmt_max, +-Inf to the format's code, then
  the hardware cast.

Why a kernel: XLA's TPU compiler splits the same computation into several
passes over HBM.  The scale groups are reshapes of x ((M, K) -> (M, K/128,
128)) that change the tiled layout, so it copies x (and the scales broadcast
to x's size) through HBM, and moves the amax's layout change to the
SparseCore: about 1 GB of traffic for three 4096 x 4096 operands, where the
data themselves are 96 MB in bfloat16.  Here each grid step holds a block
of x in VMEM, reduces each group there and writes its codes.

Orientations (``x`` 2-D, (R, C)):

    "row"    1x128 tiles along C (activations, output gradients; Fprop, Dgrad)
             scales (R, C/128).  A block is (bm, C): every tile of its rows.
    "col"    128x1 tiles along R (the 128-token tiles of Wgrad)
             scales (R/128, C).  A block is (128 i, bn).
    "block"  128x128 blocks (weights)
             scales (R/128, C/128).  A block is (128 i, bn); the kernel
             writes each block's scale over its 128 columns, (R/128, C), and
             every 128th column is kept (the GEMM kernel's own B-scale form).

:func:`quantize_rows_cols` gives "row" and "col" of one x from one read (an
output gradient: Dgrad's 1x128 tiles and Wgrad's 128-token tiles).  A block
is (128 g, 128 h); each of its 128 x 128 squares holds whole tiles of both
kinds, so both are quantized there.  Its 1x128 tiles' scales are written
transposed, (C/128, R), the form the GEMM kernel reads them in.

Shapes that are not multiples of the blocks: :func:`quantize_2d` and
:func:`quantize_rows_cols` take x in place, the last row and column blocks
running past its edges (:mod:`fp8jax.kernels.tpu_edges`), zeroed there
before the amax of a group that crosses an edge (a zero changes no amax),
their codes and scales there never written back; :func:`requantize_col`
pads its codes with zeros and crops its outputs.  ``interpret=True`` runs
the kernel in Pallas' TPU interpret mode (the tests, on CPU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8jax import formats, platforms, scaling
from fp8jax.kernels import tpu_edges
from fp8jax.kernels.block_gemm import _pad_to, cdiv, round_up
from fp8jax.kernels.tpu_params import F32_SUBLANES, compiler_params

#: The group length (DeepSeek-V3's 128).
GROUP = 128
ORIENTS = ("row", "col", "block")

#: Bytes of x per "row" block (at least 32 rows, at most 256); groups of 128
#: rows per block of "col" and "block" steps, and their columns.  A 2 MiB
#: block, double-buffered with its codes and the float32 temporaries of one
#: group, stays inside every TPU generation's default scoped VMEM (16 MiB on
#: v5e, measured by compiling for it).
ROW_BLOCK_BYTES = 2 << 20
ROW_BLOCK_MAX = 256
COL_GROUPS = 8
COL_BLOCK = 512
#: Rows and columns of a block of :func:`quantize_rows_cols` (8 groups each: the
#: float32 sublane tile of both scale arrays).  2 MiB of bfloat16 per block.
DUAL_BLOCK = 1024


def _scale(amax: jax.Array, fmt, pow2: bool, amax_floor: float, ue8m0: bool) -> jax.Array:
    """The online scale of each group from its finite amax (``quant._online_scale``'s steps)."""
    # The integer arithmetic: a kernel's body has no platform choice, and TPUs no float64.
    scale = scaling.scale_from_amax(amax, fmt, pow2=pow2, amax_floor=amax_floor, arithmetic="bits")
    # E8M0 holds no power of two below 2^-127: such groups get 2^-127.
    return formats.floor_e8m0(scale) if ue8m0 else scale


def _codes(xs: jax.Array, scale: jax.Array, fmt, cast=None) -> jax.Array:
    """x / scale to ``fmt``: quant.quantize_with_scale's per-element steps on a TPU.

    ``cast(xs, saturated quotient, fmt)`` replaces the final ``astype`` where a
    compiler's own conversion differs (:mod:`fp8jax.kernels.gpu_quantize`).
    """
    y = formats.saturate(scaling.divide_offset(xs, scale), fmt)
    return y.astype(fmt) if cast is None else cast(xs, y, fmt)


def row_kernel(x_ref, q_ref, s_ref, *, groups, fmt, pow2, amax_floor, ue8m0, cast=None):
    def tile(t) -> jax.Array:
        cols = _group(t)
        # float32: bfloat16 / float16 values are exact in it, and the amax of
        # the float32 bit patterns is the amax of the values.
        xs = x_ref[:, cols].astype(jnp.float32)
        amax = scaling._bits_amax(xs, 1, True)
        scale = _scale(amax, fmt, pow2, amax_floor, ue8m0)
        q_ref[:, cols] = _codes(xs, scale, fmt, cast)
        return scale

    if groups == 1:
        s_ref[:, 0:1] = tile(0)
        return

    # The tiles of a row block in a loop (all of C: 56 of them unrolled at
    # C = 7168 took libtpu 4 s to compile); each tile's column of scales goes
    # into the carry (a store of one column at a traced column is no legal
    # access), stored at the end.
    def add_tile(t, scales):
        scale = tile(t)
        return jnp.where(lax.broadcasted_iota(jnp.int32, scales.shape, 1) == t, scale, scales)

    s_ref[...] = lax.fori_loop(0, groups, add_tile, jnp.zeros(s_ref.shape, jnp.float32))


def col_kernel(x_ref, q_ref, s_ref, *, groups, fmt, pow2, amax_floor, ue8m0, cast=None):
    def tile_row(t) -> jax.Array:
        rows = _group(t)
        xs = x_ref[rows, :].astype(jnp.float32)
        amax = scaling._bits_amax(xs, 0, True)
        scale = _scale(amax, fmt, pow2, amax_floor, ue8m0)
        q_ref[rows, :] = _codes(xs, scale, fmt, cast)
        return scale

    _rows_in_eights(groups, s_ref.shape[1], tile_row, s_ref)


def block_kernel(
    x_ref, q_ref, s_ref, *, groups, col_groups, fmt, pow2, amax_floor, ue8m0, cast=None
):
    def block_row(t) -> jax.Array:
        rows = _group(t)
        scales = []
        for c in range(col_groups):
            cols = slice(c * GROUP, (c + 1) * GROUP)
            xs = x_ref[rows, cols].astype(jnp.float32)
            amax = scaling._bits_amax(scaling._bits_amax(xs, 1, True), 0, True)
            scale = _scale(amax, fmt, pow2, amax_floor, ue8m0)
            q_ref[rows, cols] = _codes(xs, scale, fmt, cast)
            scales.append(jnp.broadcast_to(scale, (1, GROUP)))
        return jnp.concatenate(scales, axis=1)

    _rows_in_eights(groups, col_groups * GROUP, block_row, s_ref)


def _group(t) -> slice | Any:
    """The 128 rows (or columns) of group ``t``, a Python int or a traced index."""
    if isinstance(t, int):
        return slice(t * GROUP, (t + 1) * GROUP)
    return pl.ds(pl.multiple_of(t * GROUP, GROUP), GROUP)


def _rows_in_eights(groups: int, width: int, row: Callable, out_ref) -> None:
    """``out_ref[t] = row(t)`` for each of ``groups`` rows t, ``row`` giving a (1, width)
    float32 row (and storing whatever else it writes), one traced t at a time.

    A store of one row at a traced row is no legal access (8-row tiles): each
    run of 8 rows is gathered in a loop's carry and stored as one aligned
    (8, width) block, a last run of fewer rows as those rows.  Two loops, over
    the runs and within a run, so the kernel holds the code of one row's work.
    A single row (a GPU kernel's one group, a 128-row block) needs no loop.
    """
    if groups == 1:
        out_ref[0:1, :] = row(0)
        return

    def run_of(first, count: int) -> jax.Array:
        def add_row(u, rows8):
            at = lax.broadcasted_iota(jnp.int32, rows8.shape, 0) == u
            return jnp.where(at, row(first + u), rows8)

        return lax.fori_loop(0, count, add_row, jnp.zeros((F32_SUBLANES, width), jnp.float32))

    def full_run(g, carry):
        first = pl.multiple_of(g * F32_SUBLANES, F32_SUBLANES)
        out_ref[pl.ds(first, F32_SUBLANES), :] = run_of(first, F32_SUBLANES)
        return carry

    full = groups // F32_SUBLANES
    lax.fori_loop(0, full, full_run, 0)
    if groups % F32_SUBLANES:
        first, count = full * F32_SUBLANES, groups % F32_SUBLANES
        out_ref[first : first + count, :] = run_of(first, count)[:count]


def _row_tiles(xs, q_ref, s_ref, t: int | jax.Array, c: int, scales_t: bool, cast, kw) -> None:
    """The 1x128 tiles of the 128 x 128 square (t, c) of a block, float32 ``xs``: codes
    into ``q_ref``, scales into ``s_ref`` as (C/128, R) (``scales_t``) or (R, C/128)."""
    rows = _group(t)
    cols = slice(c * GROUP, (c + 1) * GROUP)
    # The amax of each row; for the transposed scales the same maxima taken
    # over the transposed square (max is exact in any order, so both forms
    # hold the same bits).
    row_scale = _scale(scaling._bits_amax(xs, 1, True), **kw)
    q_ref[rows, cols] = _codes(xs, row_scale, kw["fmt"], cast)
    if scales_t:
        amax_t = scaling._bits_amax(jnp.transpose(xs), 0, True)
        s_ref[c : c + 1, rows] = _scale(amax_t, **kw)
    else:
        s_ref[rows, c : c + 1] = row_scale


def rows_cols_kernel(
    x_ref,
    qr_ref,
    srt_ref,
    qc_ref,
    sc_ref,
    *,
    groups,
    col_groups,
    cast=None,
    row_scales_t=True,
    cols_t=False,
    looped=False,
    **kw,
):
    """Both tile layouts of a block of ``groups`` x ``col_groups`` 128 x 128 squares
    (also the body of :func:`fp8jax.kernels.gpu_quantize.quantize_rows_cols`, with its
    ``cast`` (see :func:`_codes`) and its 1x128 tiles' scales untransposed,
    ``row_scales_t=False``: ``srt_ref`` then takes them as (R, C/128); and its 128x1
    tiles' codes and scales transposed, ``cols_t=True``: (C, R) and (C, R/128)).
    ``qc_ref`` None: the 1x128 tiles alone.

    ``looped`` (not with ``cols_t``): the rows of squares in a loop, each row's
    squares unrolled, the same bits (the body of the GEMM kernels that quantize
    their A, ``fp8jax.kernels.tpu_block_gemm``: unrolled over a 2048 x 1024 block,
    one K step of theirs, Mosaic spilled 67 MiB of registers into VMEM, past
    tpu7x's 64 MiB; and of :func:`quantize_rows_cols`, whose 64 squares unrolled
    took libtpu 6 s to compile).
    """
    if looped and cols_t:
        raise ValueError("rows_cols_kernel: looped takes the 128x1 tiles untransposed")

    def square_row(t) -> list[jax.Array]:
        # The row of squares t: both tile layouts' codes stored, the 128x1 tiles'
        # scales returned (one (1, 128) row per square) where not stored here.
        rows = _group(t)
        col_scales = []
        for c in range(col_groups):
            cols = slice(c * GROUP, (c + 1) * GROUP)
            xs = x_ref[rows, cols].astype(jnp.float32)
            _row_tiles(xs, qr_ref, srt_ref, t, c, row_scales_t, cast, kw)
            if qc_ref is None:
                continue
            # 128x1 tiles: the square's columns are whole tiles.
            if cols_t:
                # The same tiles as rows of the transposed square.
                xt = jnp.transpose(xs)
                col_scale = _scale(scaling._bits_amax(xt, 1, True), **kw)
                qc_ref[cols, rows] = _codes(xt, col_scale, kw["fmt"], cast)
                sc_ref[cols, t : t + 1] = col_scale
            else:
                col_scale = _scale(scaling._bits_amax(xs, 0, True), **kw)
                qc_ref[rows, cols] = _codes(xs, col_scale, kw["fmt"], cast)
                if looped:
                    col_scales.append(col_scale)
                else:
                    sc_ref[t : t + 1, cols] = col_scale
        return col_scales

    if not looped:
        for t in range(groups):
            square_row(t)
        return
    if qc_ref is None:
        lax.fori_loop(0, groups, lambda t, carry: (square_row(t), carry)[1], 0)
        return
    # The 128x1 tiles' scales: one row per row of squares.
    width = col_groups * GROUP
    _rows_in_eights(groups, width, lambda t: jnp.concatenate(square_row(t), axis=1), sc_ref)


def requantize_block(
    d_ref,
    st_ref,
    flag_ref,
    q_ref,
    s_ref,
    *,
    groups,
    col_groups,
    fmt_in,
    fmt,
    pow2,
    amax_floor,
    ue8m0,
):
    """FP8 codes ``d_ref`` (128 groups x 128 col_groups) in 1x128 tiles (their scales
    ``st_ref`` as (tiles, rows), at least ``col_groups`` rows) quantized again in 128x1
    tiles into ``q_ref`` and ``s_ref`` (groups, columns): the body of
    :func:`requantize_col`, and of the Wgrad GEMM kernel that requantizes its cache
    (``fp8jax.kernels.tpu_block_gemm``).  ``flag_ref[0, 0]`` != 0: some scale of the
    cache is subnormal."""
    subnormal = flag_ref[0:1, 0:1] != 0

    def requant(rows, cols, row_scales):
        # One 128 x 128 group: its codes into q_ref, its row of 128 scales returned.
        x = dequantize_group(d_ref[rows, cols], row_scales, subnormal, fmt_in)
        scale = _scale(scaling._bits_amax(x, 0, True), fmt, pow2, amax_floor, ue8m0)
        q_ref[rows, cols] = _codes(x, scale, fmt)
        return scale

    # A loop over the block's rows of groups, each row's groups unrolled, so the
    # kernel holds the code of one row of them (8 rows of a 2048-wide block
    # unrolled, 128 groups, took libtpu 13 s to compile).
    def group_row(t) -> jax.Array:
        rows = _group(t)
        # This row's cached scales, one column per 128-column tile of the block.
        s_cols = jnp.transpose(st_ref[:, rows])
        scales = []
        for c in range(col_groups):
            cols = slice(c * GROUP, (c + 1) * GROUP)
            scales.append(requant(rows, cols, s_cols[:, c : c + 1]))
        return jnp.concatenate(scales, axis=1)

    _rows_in_eights(groups, col_groups * GROUP, group_row, s_ref)


def dequantize_group(codes, row_scales, subnormal, fmt) -> jax.Array:
    """In a kernel: FP8 ``codes`` of one 128-column group times each row's scale
    (``row_scales``, a column), float32, as quant.dequantize on a TPU: the plain
    product, or the bit-pattern one (subnormal scales, which flush-to-zero would
    zero) for every element when ``subnormal`` (any scale of the cache is)."""
    d = codes.astype(jnp.float32)
    s = jnp.broadcast_to(row_scales, d.shape)
    return jnp.where(subnormal, scaling.exact_product(d, s, fmt), d * s)


def subnormal_flag(subnormal: jax.Array) -> jax.Array:
    """The bool scalar ``subnormal`` as the (8, 128) int32 tile a kernel reads it from."""
    return jnp.full((8, GROUP), subnormal, jnp.int32)


def cost_estimate(rows: int, cols: int, in_itemsize: int, layouts: int = 1) -> pl.CostEstimate:
    """One read of x; for each of ``layouts`` tile layouts, one write of its codes and of
    its float32 scales (at most one per column per group).  About 60 integer and float
    operations per element and layout (amax, the offset division, saturation)."""
    scales = 4 * rows * cols // GROUP
    return pl.CostEstimate(
        flops=60 * rows * cols * layouts,
        transcendentals=0,
        bytes_accessed=rows * cols * (in_itemsize + layouts) + scales * layouts,
    )


def groups_per_block(groups: int, cap: int = COL_GROUPS) -> int:
    """128-groups per block along an axis of ``groups`` of them: all of them up to ``cap``;
    ``cap`` where it divides them; all of them up to twice ``cap`` (one block, whose
    scale block is then the whole scale axis: 1536 rows in one block rather than padded
    to 2048); else ``cap``, the axis padded to a multiple of it."""
    if groups <= cap or (groups % cap and groups <= 2 * cap):
        return groups
    return cap


def _blocks(rows: int, cols: int, orient: str, itemsize: int) -> tuple[int, int]:
    """The block (rows, columns) of one grid step, clipped to the operand."""
    if orient == "row":
        cp = round_up(cols, GROUP)
        # Multiples of 32 rows: FP8 codes are tiled (32, 128).
        bm = max(32, min(ROW_BLOCK_MAX, ROW_BLOCK_BYTES // (cp * itemsize)) // 32 * 32)
        return min(bm, round_up(rows, 32)), cp
    col_groups = groups_per_block(cdiv(cols, GROUP), COL_BLOCK // GROUP)
    return GROUP * groups_per_block(cdiv(rows, GROUP)), GROUP * col_groups


@functools.partial(
    jax.jit, static_argnames=("fmt", "orient", "pow2", "amax_floor", "ue8m0", "interpret")
)
def quantize_2d(
    x: jax.Array,
    *,
    fmt,
    orient: str,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(codes, float32 scales) of a 2-D ``x`` (module docstring).

    Scales: "row" (R, ceil(C/128)); "col" (ceil(R/128), C); "block"
    (ceil(R/128), ceil(C/128)).  ``ue8m0``: the scales are the powers of two
    an E8M0 byte holds (needs ``pow2``); the caller encodes them.
    """
    check_2d(x, orient)
    fmt = jnp.dtype(fmt)
    r, c = x.shape
    bm, bn = _blocks(r, c, orient, jnp.dtype(x.dtype).itemsize)
    # x taken in place: the last row and column blocks run past its edges (tpu_edges).
    grid = (cdiv(r, bm), cdiv(c, bn))
    kw = dict(fmt=fmt, pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0)
    if orient == "row":
        kernel = functools.partial(row_kernel, groups=bn // GROUP, **kw)
        s_shape, s_block = (r, cdiv(c, GROUP)), (bm, bn // GROUP)
        grid = grid[:1]
        x_spec = pl.BlockSpec((bm, bn), lambda i: (i, 0))
        s_spec = pl.BlockSpec(s_block, lambda i: (i, 0))
    else:
        if orient == "col":
            kernel = functools.partial(col_kernel, groups=bm // GROUP, **kw)
        else:
            kernel = functools.partial(
                block_kernel, groups=bm // GROUP, col_groups=bn // GROUP, **kw
            )
        s_shape, s_block = (cdiv(r, GROUP), c), (bm // GROUP, bn)
        x_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
        s_spec = pl.BlockSpec(s_block, lambda i, j: (i, j))
    kernel = tpu_edges.zeroing(kernel, *edges(orient, r, c, bm, bn))
    params = None
    if not interpret:
        params = compiler_params(("parallel",) * len(grid))
    codes, scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((r, c), fmt),
            jax.ShapeDtypeStruct(s_shape, jnp.float32),
        ),
        grid=grid,
        in_specs=[x_spec],
        out_specs=(x_spec, s_spec),
        compiler_params=params,
        cost_estimate=cost_estimate(r, c, jnp.dtype(x.dtype).itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"fp8_quantize_{orient}",
    )(x)
    return crop(orient, codes, scales, r, c)


def edges(orient: str, r: int, c: int, bm: int, bn: int) -> tuple[tuple, tuple]:
    """``quantize_2d``'s edges of an (r, c) x in (bm, bn) blocks, as
    :func:`fp8jax.kernels.tpu_edges.zeroing` takes them: a group's amax across an
    edge reduces over zeros past it, 1x128 tiles across C's (every row block's
    block of whole rows), 128x1 tiles across R's (the last row block), 128x128
    blocks across both (the last row or column block).  A row or column past the
    edge that is a tile of its own is never written back: nothing to zero."""
    if orient == "row":
        return (None, 1, tpu_edges.valid_in_last(c, bn)), (0, 0, None)
    cols = tpu_edges.valid_in_last(c, bn) if orient == "block" else None
    return (0, 0, tpu_edges.valid_in_last(r, bm)), (1, 1, cols)


def crop(orient: str, codes: jax.Array, scales: jax.Array, r: int, c: int):
    """A kernel's (codes, scales) of an (r, c) input cut to ``quantize_2d``'s shapes (the
    codes already are; a 128x128 block's scale, written over its 128 columns, kept once)."""
    codes = codes[:r, :c]
    if orient == "row":
        return codes, scales[:r, : cdiv(c, GROUP)]
    if orient == "col":
        return codes, scales[: cdiv(r, GROUP), :c]
    # One scale per 128x128 block, written over its 128 columns: keep the first.
    return codes, scales[: cdiv(r, GROUP), : cdiv(c, GROUP) * GROUP : GROUP]


def check_2d(x: jax.Array, orient: str) -> None:
    """Refuse an unknown orientation or an ``x`` that is not 2-D (``quantize_2d``'s input)."""
    if orient not in ORIENTS:
        raise ValueError(f"orient must be one of {ORIENTS}, got {orient!r}")
    if x.ndim != 2:
        raise ValueError(f"quantize_2d takes a 2-D array, got shape {x.shape}")


def _dual_block(size: int) -> int:
    """A block of :func:`quantize_rows_cols` along an axis of ``size``: groups of 128 as
    :func:`groups_per_block` takes them, at most :data:`DUAL_BLOCK` rows where that
    divides the axis."""
    return GROUP * groups_per_block(cdiv(size, GROUP), DUAL_BLOCK // GROUP)


@functools.partial(jax.jit, static_argnames=("fmt", "pow2", "amax_floor", "ue8m0", "interpret"))
def quantize_rows_cols(
    x: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``quantize_2d(x, orient="row")`` and ``quantize_2d(x, orient="col")`` from one read
    of a 2-D ``x``: (row codes, row scales (R, ceil(C/128)), col codes, col scales
    (ceil(R/128), C)), the same bits as the two calls."""
    if x.ndim != 2:
        raise ValueError(f"quantize_rows_cols takes a 2-D array, got shape {x.shape}")
    fmt = jnp.dtype(fmt)
    r, c = x.shape
    bm, bn = _dual_block(r), _dual_block(c)
    kernel = functools.partial(
        rows_cols_kernel,
        groups=bm // GROUP,
        col_groups=bn // GROUP,
        fmt=fmt,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
        looped=True,
    )
    # x taken in place (tpu_edges): the 128x1 tiles' amax across R's edge and the 1x128
    # tiles' across C's reduce over zeros past them, as 128x128 blocks' do.
    kernel = tpu_edges.zeroing(kernel, *edges("block", r, c, bm, bn))
    x_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    row_codes, row_scales_t, col_codes, col_scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((r, c), fmt),
            jax.ShapeDtypeStruct((cdiv(c, GROUP), r), jnp.float32),
            jax.ShapeDtypeStruct((r, c), fmt),
            jax.ShapeDtypeStruct((cdiv(r, GROUP), c), jnp.float32),
        ),
        grid=(cdiv(r, bm), cdiv(c, bn)),
        in_specs=[x_spec],
        out_specs=(
            x_spec,
            pl.BlockSpec((bn // GROUP, bm), lambda i, j: (j, i)),
            x_spec,
            pl.BlockSpec((bm // GROUP, bn), lambda i, j: (i, j)),
        ),
        compiler_params=None if interpret else compiler_params(("parallel", "parallel")),
        cost_estimate=cost_estimate(r, c, jnp.dtype(x.dtype).itemsize, layouts=2),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="fp8_quantize_rows_cols",
    )(x)
    return (
        row_codes[:r, :c],
        row_scales_t[: cdiv(c, GROUP), :r].T,
        col_codes[:r, :c],
        col_scales[: cdiv(r, GROUP), :c],
    )


@functools.partial(jax.jit, static_argnames=("fmt", "pow2", "amax_floor", "ue8m0", "interpret"))
def requantize_col(
    codes: jax.Array,
    row_scales: jax.Array,
    subnormal: jax.Array | None = None,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """FP8 ``codes`` (R, C) with 1x128 tiles (float32 ``row_scales`` (R, ceil(C/128)))
    quantized again in 128x1 tiles: (codes, float32 scales (ceil(R/128), C)).

    The values are :func:`fp8jax.quant.dequantize`'s on a TPU (float32), then
    quantized as by ``quantize_2d(..., orient="col")``; the float32 values
    never leave VMEM.  The cached activations of DeepSeek-V3's Wgrad: read
    as their FP8 codes (one byte each) instead of a float32 copy.
    ``subnormal``: whether any scale of the whole cache is subnormal (the
    dequantization's choice, :func:`subnormal_scales`), where these codes
    are part of a larger cache; by default, of ``row_scales``.
    """
    if codes.ndim != 2:
        raise ValueError(f"requantize_col takes a 2-D array, got shape {codes.shape}")
    fmt = jnp.dtype(fmt)
    r, c = codes.shape
    # Its (C/128, R) scale block needs 8 rows (the float32 sublane tile) or all
    # of them: 8 tiles of the cache per block where 8 divide them, else the
    # whole axis up to 16 (groups_per_block).
    bm = GROUP * groups_per_block(cdiv(r, GROUP))
    bn = GROUP * groups_per_block(cdiv(c, GROUP), 8)
    rp, cp = round_up(r, bm), round_up(c, bn)
    dp = _pad_to(codes, (rp, cp), 0)
    # Unit scales keep the padding zeros; the flag reads the real scales only.
    st = _pad_to(row_scales.astype(jnp.float32), (rp, cp // GROUP), 1.0).T
    if subnormal is None:
        subnormal = subnormal_scales(row_scales)
    flag = subnormal_flag(subnormal)
    kernel = functools.partial(
        requantize_block,
        groups=bm // GROUP,
        col_groups=bn // GROUP,
        fmt_in=jnp.dtype(codes.dtype),
        fmt=fmt,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
    )
    params = None
    if not interpret:
        params = compiler_params(("parallel", "parallel"))
    x_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    out_codes, scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((rp, cp), fmt),
            jax.ShapeDtypeStruct((rp // GROUP, cp), jnp.float32),
        ),
        grid=(rp // bm, cp // bn),
        in_specs=[
            x_spec,
            pl.BlockSpec((bn // GROUP, bm), lambda i, j: (j, i)),
            pl.BlockSpec((8, GROUP), lambda i, j: (0, 0)),
        ],
        out_specs=(x_spec, pl.BlockSpec((bm // GROUP, bn), lambda i, j: (i, j))),
        compiler_params=params,
        cost_estimate=cost_estimate(rp, cp, 1),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="fp8_quantize_requantize_col",
    )(dp, st, flag)
    return out_codes[:r, :c], scales[: cdiv(r, GROUP), :c]


def subnormal_scales(scales: jax.Array) -> jax.Array:
    """Whether any of the float32 ``scales`` is subnormal (then :func:`requantize_col`
    dequantizes every element on the bit patterns, as quant.dequantize does)."""
    bits = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.int32)
    return jnp.any((bits & 0x7FFFFFFF) < 0x00800000)


def on_tpu(fn, *arrays: jax.Array):
    """``fn`` (one of this module's 2-D entry points, its settings bound) over ``arrays``
    whose leading axes stack matrices (experts, a batch: one grid each), lowered for
    TPU only: any other platform of a multi-platform export sees dead zeros."""
    return on_platform("tpu", fn, *arrays)


def on_platform(platform: str, fn, *arrays: jax.Array):
    """:func:`on_tpu` for ``platform`` (the GPU quantizers' ``on_gpu`` too): where
    :func:`result_shapes` knows ``fn``, the kernel is traced only when the program is
    lowered for ``platform``."""

    def call(fn, arrays, out_shape):
        return platforms.only_on((platform,), fn, *arrays, out_shape=out_shape)

    return over_matrices(fn, arrays, call)


def over_matrices(fn: Callable, arrays: Sequence[jax.Array], call: Callable) -> Any:
    """``fn`` (a 2-D entry point of this module or the GPU quantizers', settings bound)
    over ``arrays`` whose leading axes stack matrices, as ``call(fn2, arrays2,
    out_shape)`` runs it (``out_shape``: :func:`result_shapes`, or None).

    One matrix (leading axes of size 1) is the 2-D call itself.  A stack whose
    groups never cross from one matrix into the next (1x128 tiles, always;
    128x1 tiles or 128x128 blocks where a matrix's rows are a multiple of
    128) is quantized as the rows of one matrix: each group
    holds the same elements, so the codes and scales are the same bits.
    Any other stack is ``fn`` vmapped over the leading axes.  Both forms
    spare the kernel the batch axis of a vmap, a grid axis more for Mosaic
    to lower and compile per call.
    """
    lead = arrays[0].shape[:-2]
    n = math.prod(lead)
    if lead and (n == 1 or _stacks_as_rows(fn, arrays)):
        if n == 1:
            flat = tuple(a.reshape(a.shape[len(lead) :]) for a in arrays)
        else:
            flat = tuple(a.reshape((-1,) + a.shape[len(lead) + 1 :]) for a in arrays)
        out = call(fn, flat, result_shapes(fn, flat[0].shape))
        # Each result stacks along its first axis as the inputs did.
        return jax.tree.map(lambda y: y.reshape(lead + (y.shape[0] // n,) + y.shape[1:]), out)
    out = result_shapes(fn, arrays[0].shape[-2:])
    if out is not None:
        out = tuple(jax.ShapeDtypeStruct(lead + o.shape, o.dtype) for o in out)
    for _ in lead:
        fn = jax.vmap(fn)
    return call(fn, arrays, out)


def _stacks_as_rows(fn: Callable, arrays: Sequence[jax.Array]) -> bool:
    """Whether the matrices of ``arrays`` (one x, leading axes stacking matrices) may be
    quantized by ``fn`` as the rows of one: its groups then never span two matrices."""
    if len(arrays) != 1 or not isinstance(fn, functools.partial):
        return False
    name = getattr(fn.func, "__name__", "")
    if name == "quantize_2d":
        orient = fn.keywords.get("orient")
    elif name == "quantize_rows_cols":
        # Its 1x128 tiles stack in any case; its 128x1 tiles decide.
        orient = "col"
    else:
        return False
    return orient == "row" or (orient in ("col", "block") and arrays[0].shape[-2] % GROUP == 0)


def result_shapes(fn, shape: tuple[int, int]) -> tuple[jax.ShapeDtypeStruct, ...] | None:
    """What ``fn`` (a ``functools.partial`` of a quantizer kernel's entry point, settings
    bound: this module's or :mod:`fp8jax.kernels.gpu_quantize`'s) returns for a 2-D
    input of ``shape``, as its docstring states; None for anything else, or where an
    array is bound (a traced value cannot wait for the lowering)."""
    if not isinstance(fn, functools.partial) or fn.args:
        return None
    if any(isinstance(v, (jax.Array, jax.core.Tracer)) for v in fn.keywords.values()):
        return None
    name = getattr(fn.func, "__name__", "")
    r, c = shape
    codes = jax.ShapeDtypeStruct((r, c), jnp.dtype(fn.keywords.get("fmt", jnp.float32)))
    rows = jax.ShapeDtypeStruct((r, cdiv(c, GROUP)), jnp.float32)
    cols = jax.ShapeDtypeStruct((cdiv(r, GROUP), c), jnp.float32)
    if name == "quantize_2d":
        orient = fn.keywords.get("orient")
        blocks = jax.ShapeDtypeStruct((cdiv(r, GROUP), cdiv(c, GROUP)), jnp.float32)
        scales = {"row": rows, "col": cols, "block": blocks}.get(orient)
        return None if scales is None else (codes, scales)
    if name == "quantize_rows_cols":
        return codes, rows, codes, cols
    if name == "quantize_block_both":
        blocks = jax.ShapeDtypeStruct((cdiv(r, GROUP), cdiv(c, GROUP)), jnp.float32)
        return codes, jax.ShapeDtypeStruct((c, r), codes.dtype), blocks
    if name == "requantize_col":
        return codes, cols
    if name == "requantize_col_t":
        return (
            jax.ShapeDtypeStruct((c, r), codes.dtype),
            jax.ShapeDtypeStruct((c, cdiv(r, GROUP)), jnp.float32),
        )
    return None
