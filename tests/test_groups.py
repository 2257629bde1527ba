"""The expert-aligned tile layout of the grouped GEMM, against a Python loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.groups import aligned_rows, from_tiles, group_layout, sum_tiles, to_tiles


def _python_layout(gs, m, tile):
    """Aligned rows built one group at a time."""
    mp = aligned_rows(m, len(gs), tile)
    src = np.full(mp, -1)
    tile_group = np.full(mp // tile, -1)
    row, pos = 0, 0
    for e, g in enumerate(gs):
        for j in range(g):
            src[pos + j] = row + j
        n_tiles = -(-g // tile)
        tile_group[pos // tile : pos // tile + n_tiles] = e
        row += g
        pos += n_tiles * tile
    return src, tile_group


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("gs", [[3, 0, 5, 1], [4, 4], [0, 0, 7], [1, 2, 3, 2]])
def test_layout_matches_python_loop(gs, use_jit):
    m, tile = 12, 4
    fn = jax.jit(group_layout, static_argnums=(1, 2)) if use_jit else group_layout
    lay = jax.tree.map(np.asarray, fn(jnp.asarray(gs, jnp.int32), m, tile))
    src, tile_group = _python_layout(gs, m, tile)
    np.testing.assert_array_equal(lay.tile_group, tile_group)
    np.testing.assert_array_equal(lay.row_valid, src >= 0)
    np.testing.assert_array_equal(lay.src_row[src >= 0], src[src >= 0])
    # Each row's place in the aligned buffer: the inverse of src_row.
    n = sum(gs)
    dst = np.zeros(m, np.int64)
    dst[src[src >= 0]] = np.flatnonzero(src >= 0)
    np.testing.assert_array_equal(lay.in_group, np.arange(m) < n)
    np.testing.assert_array_equal(lay.dst_row[:n], dst[:n])
    assert np.all(lay.dst_row[n:] == 0)
    # Round trip: rows -> tiles -> rows; rows past sum(gs) come back as 0.
    a = np.arange(m * 2, dtype=np.float32).reshape(m, 2) + 1
    back = np.asarray(from_tiles(to_tiles(jnp.asarray(a), fn(jnp.asarray(gs), m, tile)), lay))
    np.testing.assert_array_equal(back[:n], a[:n])
    assert np.all(back[n:] == 0)
    # No tile holds two experts' rows.
    owner = np.full(lay.src_row.shape, -1)
    starts = np.cumsum([0] + list(gs))
    for r, (ok, s) in enumerate(zip(lay.row_valid, lay.src_row)):
        if ok:
            owner[r] = np.searchsorted(starts, s, side="right") - 1
    for t in range(lay.tile_group.shape[0]):
        vals = set(owner[t * tile : (t + 1) * tile]) - {-1}
        assert len(vals) <= 1


def test_layout_is_traced_as_primitives_without_a_loop():
    # No jit of a jax.numpy operator (a call XLA inlines per grouped GEMM)
    # and no search loop: the index arithmetic as plain primitives.
    jaxpr = jax.make_jaxpr(lambda g: group_layout(g, 40, 8))(jnp.asarray([3, 0, 5, 1]))
    names = {e.primitive.name for e in jaxpr.eqns}
    assert not names & {"pjit", "jit", "scan", "while"}, names


def test_sum_tiles_adds_each_experts_tiles_in_order():
    gs = jnp.asarray([5, 0, 2], jnp.int32)
    lay = group_layout(gs, 8, 2)
    per_tile = jnp.arange(lay.num_tiles, dtype=jnp.float32)[:, None] + 1
    out = np.asarray(sum_tiles(per_tile, lay, 3))
    tg = np.asarray(lay.tile_group)
    want = [per_tile[tg == e].sum() for e in range(3)]
    np.testing.assert_array_equal(out[:, 0], want)
    assert out[1, 0] == 0
