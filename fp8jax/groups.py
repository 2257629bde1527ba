"""Expert groups of a grouped (MoE) GEMM and their expert-aligned row tiles.

The grouped GEMM's rows are routed tokens sorted by expert: group ``e`` is rows
``[off_e, off_e + g_e)`` with ``off_e = sum(g[:e])``; rows past ``sum(g)``
belong to no expert.  :func:`group_layout` places every group at the next
multiple of ``tile`` rows of an aligned buffer (DeepGEMM's "contiguous"
layout with each expert's segment padded to its M block), so that no tile of
``tile`` rows holds two experts' tokens:

* the Fprop / Dgrad GEMMs become batched GEMMs over the tiles, each tile with
  its own expert's weight;
* Wgrad's 128x1 token tiles are the tiles of this buffer, so they never
  straddle two experts, and an expert's weight gradient is the sum of its
  tiles' products.

This is the one group-to-tile layout of the project (the XLA path, the
accumulation emulator and the Pallas grouped kernel all use it).  The buffer
has the static size ``(ceil(M / tile) + E) * tile`` rows, a bound on
``sum_e ceil(g_e / tile)`` tiles.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import platforms
from fp8jax.inline_ops import traced_inline


class GroupLayout(NamedTuple):
    """Mapping between grouped rows (M) and expert-aligned rows (Mp = num_tiles * tile).

    src_row / row_valid (Mp,): which input row fills aligned row r (if valid);
    tile_group (Mp // tile,): expert of each tile, -1 for a tile of padding only;
    dst_row / in_group (M,): where input row m lands (if it belongs to a group);
    group_end / group_shift (E,): where each group's rows end (``sum(g[:e+1])``)
    and how many rows further its aligned rows sit (``dst_row - m`` for its rows).
    """

    src_row: jax.Array
    row_valid: jax.Array
    tile_group: jax.Array
    dst_row: jax.Array
    in_group: jax.Array
    group_end: jax.Array
    group_shift: jax.Array

    @property
    def num_tiles(self) -> int:
        return self.tile_group.shape[0]

    @property
    def tile(self) -> int:
        return self.src_row.shape[0] // self.tile_group.shape[0]


def group_sizes_valid(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """bool scalar: every group size is >= 0 and they sum to at most ``num_rows``.

    Each size is clipped to ``num_rows + 1`` before the int32 sum, so huge
    sizes cannot wrap the sum around to a small total.
    """
    gs = group_sizes.astype(jnp.int32)
    total = jnp.sum(jnp.minimum(gs, num_rows + 1))
    return jnp.all(gs >= 0) & (total <= num_rows)


def check_group_sizes(group_sizes: jax.Array, num_rows: int) -> None:
    """Raise a one-line ValueError for negative sizes or sizes summing past ``num_rows``.

    Only concrete sizes can be checked here; under ``jax.jit`` the sizes are
    traced and the caller decides (:func:`fp8jax.ragged_dot.ragged_dot`
    returns NaN for invalid traced sizes).
    """
    if isinstance(group_sizes, jax.core.Tracer):
        return
    gs = np.asarray(group_sizes).astype(np.int64)
    if (gs < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {gs.tolist()}")
    if gs.sum() > num_rows:
        raise ValueError(
            f"group_sizes sum to {int(gs.sum())}, more than the {num_rows} rows of lhs"
        )


def aligned_rows(num_rows: int, num_groups: int, tile: int) -> int:
    """Static row count of the aligned buffer: (ceil(M / tile) + E) * tile."""
    return (-(-num_rows // tile) + num_groups) * tile


@traced_inline
def group_layout(group_sizes: jax.Array, num_rows: int, tile: int = 128) -> GroupLayout:
    """The expert-aligned tile layout of ``group_sizes`` (traceable in its values).

    Index arithmetic on a few vectors, traced without jax.numpy's per-operator
    jits (:func:`fp8jax.inline_ops.traced_inline`): each would be a call of
    its own in every grouped GEMM's program.  The searches compare every
    boundary at once (``method="compare_all"``, no loop): the same indices.
    """
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must be 1-d (E,), got shape {group_sizes.shape}")
    if tile <= 0:
        raise ValueError(f"tile must be positive, got {tile}")
    num_groups = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    offs = ends - gs
    tiles = (gs + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles)
    aligned_offs = (tile_ends - tiles) * tile
    mp = aligned_rows(num_rows, num_groups, tile)

    # Expert of each tile: the first group whose cumulative tile count exceeds
    # the tile index (empty groups own no tile); beyond all groups: -1.
    t = jnp.arange(mp // tile, dtype=jnp.int32)
    g_tile = _search_right(tile_ends, t)
    tile_group = jnp.where(g_tile < num_groups, g_tile, -1)

    r = jnp.arange(mp, dtype=jnp.int32)
    g_r = jnp.clip(g_tile[r // tile], 0, num_groups - 1)
    pos = r - aligned_offs[g_r]
    row_valid = (g_tile[r // tile] < num_groups) & (pos < gs[g_r])
    src_row = jnp.where(row_valid, offs[g_r] + pos, 0)

    m = jnp.arange(num_rows, dtype=jnp.int32)
    g_m = jnp.clip(_search_right(ends, m), 0, num_groups - 1)
    in_group = m < ends[-1] if num_groups else jnp.zeros((num_rows,), bool)
    dst_row = jnp.where(in_group, aligned_offs[g_m] + (m - offs[g_m]), 0)
    return GroupLayout(src_row, row_valid, tile_group, dst_row, in_group, ends, aligned_offs - offs)


def _search_right(edges: jax.Array, v: jax.Array) -> jax.Array:
    """For each of ``v``: how many of the sorted ``edges`` are <= it (int32)."""
    return jnp.searchsorted(edges, v, side="right", method="compare_all").astype(jnp.int32)


def to_tiles(a: jax.Array, layout: GroupLayout, fill=0) -> jax.Array:
    """(M, ...) rows -> (num_tiles, tile, ...) expert-aligned tiles; padding rows = ``fill``.

    A gather of rows; on a TPU lowering, where the tile length is a multiple
    of 32 rows and ``a``'s elements are 1, 2 or 4 bytes wide, the kernel of
    :mod:`fp8jax.kernels.tpu_tiles` (each tile assembled from the two
    aligned blocks its rows span: libtpu prices a gather of single rows at
    several times its bytes).  The same values either way.
    """
    from fp8jax.kernels import tpu_tiles

    kernel = a.size > 0 and tpu_tiles.moves(a.dtype, layout.tile)
    return platforms.choose(
        lambda p: "tpu kernel" if kernel and p == "tpu" else "rows",
        lambda how: partial(_to_tiles_tpu if how == "tpu kernel" else _to_tile_rows, fill=fill),
        (a, layout),
    )


@traced_inline
def _to_tile_rows(a: jax.Array, layout: GroupLayout, fill=0) -> jax.Array:
    valid = layout.row_valid.reshape((-1,) + (1,) * (a.ndim - 1))
    out = jnp.where(valid, a[layout.src_row], jnp.asarray(fill, a.dtype))
    return out.reshape((layout.num_tiles, layout.tile) + a.shape[1:])


def _to_tiles_kernel(a: jax.Array, layout: GroupLayout, fill=0, interpret: bool = False):
    """:func:`to_tiles` by the Pallas TPU kernel (``interpret``: its interpret mode)."""
    from fp8jax.kernels import tpu_tiles

    tiles = layout.row_valid.reshape(layout.num_tiles, layout.tile)
    # A tile's rows are consecutive input rows from its first one's; its
    # valid rows come first (a padding tile has none).
    start = layout.src_row.reshape(tiles.shape)[:, 0]
    count = jnp.sum(tiles, axis=1, dtype=jnp.int32)
    flat = a.reshape(a.shape[0], -1)
    out = tpu_tiles.window_tiles(
        flat, start, count, tile=layout.tile, fill=fill, interpret=interpret
    )
    return out.reshape((layout.num_tiles, layout.tile) + a.shape[1:])


def _to_tiles_tpu(a: jax.Array, layout: GroupLayout, fill=0) -> jax.Array:
    """:func:`_to_tiles_kernel`, traced and lowered for TPU only."""
    out = jax.ShapeDtypeStruct((layout.num_tiles, layout.tile) + a.shape[1:], a.dtype)
    return platforms.only_on(
        ("tpu",), partial(_to_tiles_kernel, fill=fill), a, layout, out_shape=out
    )


def from_tiles(t: jax.Array, layout: GroupLayout) -> jax.Array:
    """(num_tiles, tile, ...) -> (M, ...) in the caller's row order; rows in no group are 0.

    A gather of rows; on a TPU lowering, where :func:`to_tiles` takes its
    kernel, :func:`fp8jax.kernels.tpu_tiles.window_rows` (each block of
    ``tile`` rows assembled from the windows of its experts' rows).  The same
    values either way.
    """
    from fp8jax.kernels import tpu_tiles

    rows = layout.dst_row.shape[0]
    kernel = t.size > 0 and rows > 0 and tpu_tiles.moves(t.dtype, layout.tile)
    return platforms.choose(
        lambda p: "tpu kernel" if kernel and p == "tpu" else "rows",
        lambda how: _from_tiles_tpu if how == "tpu kernel" else _from_tile_rows,
        (t, layout),
    )


@traced_inline
def _from_tile_rows(t: jax.Array, layout: GroupLayout) -> jax.Array:
    flat = t.reshape((-1,) + t.shape[2:])
    valid = layout.in_group.reshape((-1,) + (1,) * (flat.ndim - 1))
    return jnp.where(valid, flat[layout.dst_row], jnp.zeros((), t.dtype))


@traced_inline
def window_segments(layout: GroupLayout) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(block, start, lo_row, hi_row) of :func:`~fp8jax.kernels.tpu_tiles.window_rows` that
    take the tiles back to the caller's rows: a segment begins at every block of
    ``tile`` rows and at every group's end (where the next group, or the rows of
    none, begin), so ceil(M / tile) + E of them, sorted; a group's rows share
    one shift into the tiles.  A segment of rows in no group (or of none)
    writes none: they stay zeros.  Index arithmetic on those few segments,
    none on the M rows."""
    tile = layout.tile
    rows = layout.dst_row.shape[0]
    n_blocks = -(-rows // tile)
    num_groups = layout.group_end.shape[0]
    blocks = jnp.arange(n_blocks, dtype=jnp.int32) * tile
    begin = jnp.sort(jnp.concatenate([blocks, layout.group_end.astype(jnp.int32)]))
    end = jnp.concatenate([begin[1:], jnp.full((1,), rows, jnp.int32)])
    block = jnp.minimum(begin // tile, n_blocks - 1)
    lo_row = begin - block * tile
    if num_groups == 0:
        return block, jnp.zeros_like(block), lo_row, lo_row
    # The group a segment's rows are in: the first whose end is past its begin.
    group = _search_right(layout.group_end, begin)
    valid = group < num_groups
    shift = layout.group_shift[jnp.minimum(group, num_groups - 1)]
    start = jnp.where(valid, block * tile + shift, 0)
    hi_row = jnp.where(valid, end - block * tile, lo_row)
    return block, start, lo_row, hi_row


def _from_tiles_kernel(t: jax.Array, layout: GroupLayout, interpret: bool = False) -> jax.Array:
    """:func:`from_tiles` by the Pallas TPU kernel (``interpret``: its interpret mode)."""
    from fp8jax.kernels import tpu_tiles

    rows = layout.dst_row.shape[0]
    flat = t.reshape(t.shape[0] * t.shape[1], -1)
    out = tpu_tiles.window_rows(
        flat, *window_segments(layout), rows=rows, tile=layout.tile, interpret=interpret
    )
    return out.reshape((rows,) + t.shape[2:])


def _from_tiles_tpu(t: jax.Array, layout: GroupLayout) -> jax.Array:
    """:func:`_from_tiles_kernel`, traced and lowered for TPU only."""
    out = jax.ShapeDtypeStruct((layout.dst_row.shape[0],) + t.shape[2:], t.dtype)
    return platforms.only_on(("tpu",), _from_tiles_kernel, t, layout, out_shape=out)


def sum_tiles(per_tile: jax.Array, layout: GroupLayout, num_groups: int) -> jax.Array:
    """(num_tiles, ...) -> (E, ...): each expert's sum over its tiles, in tile order.

    A left-to-right float32 sum per expert (tiles of padding add nothing), so
    the result equals adding the tiles' products one after the other, as one
    GEMM over the expert's tokens would add its promoted partial sums.
    """
    seg = jnp.where(layout.tile_group >= 0, layout.tile_group, num_groups)

    def add(acc, xs):
        s, p = xs
        return acc.at[s].add(p, mode="drop"), None

    init = jnp.zeros((num_groups,) + per_tile.shape[1:], per_tile.dtype)
    out, _ = jax.lax.scan(add, init, (seg, per_tile))
    return out
