"""Rows laid out in expert-aligned tiles as a Pallas TPU (Mosaic) kernel: each tile is
assembled in VMEM from the two aligned blocks of rows its window spans.

The grouped GEMM moves each expert's rows (consecutive, sorted by expert) to
the next multiple of ``tile`` rows of an aligned buffer
(:func:`fp8jax.groups.to_tiles`).  Tile ``t`` holds the window of ``tile``
consecutive input rows starting at its first row ``start[t]``, its first
``count[t]`` rows valid and the rest ``fill``.  XLA gathers those rows one by
one, and libtpu prices a gather of single rows at several times the bytes
it moves (3,072 rows of a (2,048, 256) bfloat16 array: 18.4 MB accessed for
1.6 MB of rows).  Here grid step (j, t) takes the two aligned blocks of
``tile`` rows (and the j-th block of columns) that the window spans and
rotates them into place in VMEM.  The steps of a column block go in order,
and a tile's second block is the next tile's first where a group goes on:
kept in VMEM, not read again (:func:`_fetched`), so a block is read about
once, twice where a group's first window starts in it; the tiles are
written once.

The rows are moved as signed integers of their width (a bitcast in the
kernel), widened to int32 for the rotation and narrowed back, so every bit
pattern comes out as it went in.  (Pallas' interpret mode, on CPU, moves
8-bit floats with XLA's CPU operations, which may give an E5M2 NaN another
payload, as XLA's CPU gather does.)

Shapes: ``a`` (M, C) of any 1-, 2- or 4-byte dtype; ``start`` and ``count``
int32 (T,); the result (T * tile, C).  ``interpret=True`` runs Pallas' TPU
interpret mode (the tests, on CPU).

:func:`window_rows` moves rows back (:func:`fp8jax.groups.from_tiles`): the
output's rows in blocks of ``tile``, each block assembled over segments of
consecutive rows that share one shift into the tiles (a block spans as many
segments as experts whose rows it holds, plus one past the last expert), each
segment's window of ``tile`` rows rotated out of the two aligned tiles it
spans, the second carried to the next segment as above.  What it replaces
was about 270 of libtpu's 1,090 us at 8 experts x 512 x 7168 x 2048
(deepseek_v3's fwd+bwd on tpu7x): XLA's gather of those rows about 230 and
the select of the rows in a group about 40 (the program with the select
left out, then with both replaced by a slice).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8jax.kernels.block_gemm import cdiv
from fp8jax.kernels.tpu_params import compiler_params

#: Columns per grid step: 512 lanes keep two input blocks, the output and their
#: int32 copies of a 128-row tile within a few MiB of VMEM.
BLOCK_COLS = 512
#: Tile lengths the kernel takes: whole sublane tiles of every width it moves
#: (32 rows of 8-bit values).
TILE_MULTIPLE = 32
#: The integer of each width the rows are moved as.
_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}


def moves(dtype, tile: int) -> bool:
    """Whether the tile kernels (:func:`window_tiles`, :func:`window_rows`) move values of
    ``dtype`` in tiles of ``tile`` rows: 1-, 2- and 4-byte numbers (an integer view of
    their width), whole sublane tiles."""
    dtype = jnp.dtype(dtype)
    return tile % TILE_MULTIPLE == 0 and dtype.itemsize in _INT and dtype != jnp.bool_


def _kernel(
    start_ref,
    count_ref,
    carried_ref,
    lo_tile,
    hi_tile,
    lo_ref,
    hi_ref,
    o_ref,
    carry_ref,
    *,
    tile: int,
    fill_bits: int,
):
    t = pl.program_id(1)
    window, row = _window(t, start_ref, carried_ref, lo_ref, hi_ref, carry_ref, tile=tile)
    _store(o_ref, jnp.where(row < count_ref[t], window, fill_bits))


def _window(step, start_ref, carried_ref, lo_ref, hi_ref, carry_ref, *, tile: int):
    """(window, row): the ``tile`` rows of a kernel's window at ``start_ref[step]`` as int32
    bit patterns, and each one's row.  Both blocks are rotated up by the window's
    offset within the first, so that its rows sit in place, the first tile - off
    of them from the first block: the step before's second where ``carried_ref``
    says so (:func:`_fetched`).  This step's second block is kept for the next."""
    # Starts are non-negative: the remainder and quotient need no sign fix-up.
    off = jax.lax.rem(start_ref[step], tile)
    shift = jax.lax.rem(tile - off, tile)
    first = jnp.where(carried_ref[step] != 0, carry_ref[...], lo_ref[...])
    lo = pltpu.roll(_widened(first), shift, 0)
    hi = pltpu.roll(_widened(hi_ref[...]), shift, 0)
    carry_ref[...] = hi_ref[...]
    row = jax.lax.broadcasted_iota(jnp.int32, lo.shape, 0)
    return jnp.where(row < tile - off, lo, hi), row


def _store(o_ref, bits: jax.Array) -> None:
    """int32 bit patterns narrowed to ``o_ref``'s width and written as its dtype."""
    ints = _INT[jnp.dtype(o_ref.dtype).itemsize]
    o_ref[...] = jax.lax.bitcast_convert_type(bits.astype(ints), o_ref.dtype)


def _fetched(start, lo_row, hi_row, *, tile: int, last: int):
    """(carried, first block, second block) per step of a kernel whose step s writes the
    rows ``lo_row[s]`` .. ``hi_row[s]`` of the window of ``tile`` rows from ``start[s]``.

    A step's second block is the next step's first wherever rows go on past a
    block (a group's next tile, or its window in the next block of rows): kept
    in VMEM (``carried``), not read again.  A block a step needs no row of stays
    the one the step before read (a running maximum: the windows of the steps
    that need rows start in order), which the pipeline does not fetch again.
    """
    first = jax.lax.div(start, tile)
    split = tile - jax.lax.rem(start, tile)
    lo_needed = lo_row < jnp.minimum(hi_row, split)
    hi_needed = hi_row > jnp.maximum(lo_row, split)
    hi_tile = jnp.minimum(jax.lax.cummax(jnp.where(hi_needed, first + 1, 0)), last)
    held = jnp.concatenate([jnp.full((1,), -1, jnp.int32), hi_tile[:-1]])
    carried = lo_needed & (first == held)
    lo_tile = jnp.minimum(jax.lax.cummax(jnp.where(lo_needed & ~carried, first, 0)), last)
    return carried.astype(jnp.int32), lo_tile, hi_tile


def _widened(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as int32 (sign-extended from their width): the values
    the rotation moves.  In the kernel, so that no integer copy of the array is
    written to HBM (XLA's TPU compiler copies a bitcast between float and integer)."""
    ints = _INT[jnp.dtype(x.dtype).itemsize]
    return jax.lax.bitcast_convert_type(x, ints).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("tile", "fill", "interpret"))
def window_tiles(
    a: jax.Array,
    start: jax.Array,
    count: jax.Array,
    *,
    tile: int,
    fill=0,
    interpret: bool = False,
) -> jax.Array:
    """(T * tile, C): tile t is rows ``start[t]`` .. ``start[t] + tile`` of the 2-D ``a``,
    those from ``count[t]`` on replaced by ``fill`` (module docstring)."""
    _check_moved("window_tiles", a, tile)
    if start.shape != count.shape or start.ndim != 1:
        raise ValueError(
            f"start and count must be the same 1-D shape, {start.shape}, {count.shape}"
        )
    m = a.shape[0]
    n_tiles = start.shape[0]
    ints = _INT[jnp.dtype(a.dtype).itemsize]
    # fill's bit pattern in a's dtype, as that width's signed integer.
    fill_bits = int(np.asarray(fill, jnp.dtype(a.dtype)).view(jnp.dtype(ints)))
    start, count = start.astype(jnp.int32), count.astype(jnp.int32)
    # A block read per tile and one more per group (n_tiles - ceil(M / tile) of
    # them in fp8jax.groups' layout: a group's first window, not carried), each
    # tile written once.
    reads = n_tiles + max(n_tiles - cdiv(m, tile), 0)
    return _launch(
        functools.partial(_kernel, tile=tile, fill_bits=fill_bits),
        "fp8_window_tiles",
        a,
        (start, count),
        start,
        jnp.zeros_like(count),
        count,
        out_block=lambda t, refs: t,
        out_rows=n_tiles * tile,
        tiles_moved=reads + n_tiles,
        tile=tile,
        interpret=interpret,
    )


def _check_moved(name: str, a: jax.Array, tile: int) -> None:
    """Refuse what the tile kernels cannot move: ``a`` not 2-D, a tile length that is no
    whole number of sublane tiles, values other than 1-, 2- and 4-byte numbers."""
    if a.ndim != 2:
        raise ValueError(f"{name} takes a 2-D array, got shape {a.shape}")
    if tile % TILE_MULTIPLE:
        raise ValueError(f"tile must be a multiple of {TILE_MULTIPLE}, got {tile}")
    if not moves(a.dtype, tile):
        raise ValueError(f"{name} moves 1-, 2- and 4-byte numbers, got {a.dtype}")


def _launch(
    kernel,
    name: str,
    a: jax.Array,
    scalars: tuple[jax.Array, ...],
    start: jax.Array,
    lo_row: jax.Array,
    hi_row: jax.Array,
    *,
    out_block,
    out_rows: int,
    tiles_moved: int,
    tile: int,
    interpret: bool,
) -> jax.Array:
    """Either tile kernel over ``a``, one step per entry of ``start``: step s writes rows
    ``lo_row[s]`` .. ``hi_row[s]`` of the window of ``tile`` rows of ``a`` from
    ``start[s]`` into the output's block ``out_block(s, refs)`` of ``tile`` rows.

    The kernel is given ``scalars`` (``start`` among them), then :func:`_fetched`'s
    three arrays, all prefetched to SMEM; the window's two blocks of ``a``; the
    output block; and the VMEM buffer that carries a block to the next step.
    Column blocks of :data:`BLOCK_COLS` go outermost, the steps of one in order
    ("arbitrary"): an output block is visited in one run of consecutive steps,
    which Mosaic needs of a block it keeps, and a column block's first step
    carries nothing in.  ``tiles_moved``: the blocks of ``tile`` rows read and
    written, the cost estimate's bytes.
    """
    c = a.shape[1]
    bc = c if c <= BLOCK_COLS else BLOCK_COLS
    fetched = _fetched(start, lo_row, hi_row, tile=tile, last=cdiv(a.shape[0], tile) - 1)
    lo_at = len(scalars) + 1

    def block_of(at):
        return lambda j, s, *refs: (refs[at][s], j)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars) + len(fetched),
        grid=(cdiv(c, bc), start.shape[0]),
        in_specs=[
            pl.BlockSpec((tile, bc), block_of(lo_at)),
            pl.BlockSpec((tile, bc), block_of(lo_at + 1)),
        ],
        out_specs=pl.BlockSpec((tile, bc), lambda j, s, *refs: (out_block(s, refs), j)),
        scratch_shapes=[pltpu.VMEM((tile, bc), a.dtype)],
    )
    moved = tile * c * jnp.dtype(a.dtype).itemsize
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_rows, c), a.dtype),
        grid_spec=grid_spec,
        compiler_params=None if interpret else compiler_params(("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=0, transcendentals=0, bytes_accessed=tiles_moved * moved
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=name,
    )(*scalars, *fetched, a, a)


def _rows_kernel(
    block_ref,
    start_ref,
    lo_row_ref,
    hi_row_ref,
    carried_ref,
    lo_tile,
    hi_tile,
    lo_ref,
    hi_ref,
    o_ref,
    carry_ref,
    *,
    tile,
):
    s = pl.program_id(1)
    # A block's first segment starts it from zeros (the rows of no segment:
    # past the last expert); the blocks of segments come in order, so a
    # block's segments are consecutive grid steps and it stays in VMEM.
    first = (s == 0) | (block_ref[s] != block_ref[jnp.maximum(s - 1, 0)])
    window, row = _window(s, start_ref, carried_ref, lo_ref, hi_ref, carry_ref, tile=tile)
    kept = jnp.where(first, 0, _widened(o_ref[...]))
    mine = (row >= lo_row_ref[s]) & (row < hi_row_ref[s])
    _store(o_ref, jnp.where(mine, window, kept))


@functools.partial(jax.jit, static_argnames=("rows", "tile", "interpret"))
def window_rows(
    a: jax.Array,
    block: jax.Array,
    start: jax.Array,
    lo_row: jax.Array,
    hi_row: jax.Array,
    *,
    rows: int,
    tile: int,
    interpret: bool = False,
) -> jax.Array:
    """(rows, C), in blocks of ``tile`` rows: segment s writes rows ``lo_row[s]`` ..
    ``hi_row[s]`` of block ``block[s]`` from the window of ``tile`` rows of the 2-D ``a``
    that starts at row ``start[s]`` (window row r to block row r); rows no segment
    writes are zeros (module docstring).

    ``block`` must be non-decreasing (a block's segments consecutive), and so
    must ``start`` over the segments that write rows, each window within
    ``a``'s rows wherever its segment writes one.
    """
    _check_moved("window_rows", a, tile)
    segs = (block, start, lo_row, hi_row)
    if any(x.shape != block.shape for x in segs) or block.ndim != 1:
        raise ValueError(f"the segments must share one 1-D shape, {[x.shape for x in segs]}")
    n_blocks = cdiv(rows, tile)
    segs = tuple(x.astype(jnp.int32) for x in segs)
    out = _launch(
        functools.partial(_rows_kernel, tile=tile),
        "fp8_window_rows",
        a,
        segs,
        *segs[1:],
        out_block=lambda s, refs: refs[0][s],
        out_rows=n_blocks * tile,
        # A tile read for each block and two more for each further segment (a
        # group's first window: its second tile, and a first tile not carried),
        # each block written once: 2 x segments tiles moved.
        tiles_moved=2 * block.shape[0],
        tile=tile,
        interpret=interpret,
    )
    return out if n_blocks * tile == rows else out[:rows]
