"""Per-token quantization error: a token's amax against its scale group's (tiles: 1;
blocks: the largest token of its 128 decides), and per-token errors and flushed shares
against a float64 / ml_dtypes E4M3 reference of the same scale groups."""

import ml_dtypes
import numpy as np
import pytest

from fp8jax.numerics.token_error import group_amax_ratio, token_quant_errors


def _tensor():
    rng = np.random.default_rng(0)
    # 200 tokens x 300 features (odd: padded blocks and tiles), token magnitudes over 24 binades.
    mag = np.exp2(rng.uniform(-24, 0, (200, 1)))
    t = (rng.standard_normal((200, 300)) * mag).astype(np.float32)
    t[7] = 0.0  # a token of zeros
    t[3, 5] = 50.0  # one large value in the first block of tokens
    return t


def _ref_errors(t, gran):
    """E4M3 round-to-nearest of t / s with s = group amax / 448 (float32), float64 errors."""
    t = t.astype(np.float32)
    a = np.abs(t)
    m, n = t.shape
    s = np.zeros_like(t)
    if gran == "tile":
        for j in range(0, n, 128):
            s[:, j : j + 128] = a[:, j : j + 128].max(axis=1, keepdims=True)
    else:
        for i in range(0, m, 128):
            for j in range(0, n, 128):
                s[i : i + 128, j : j + 128] = a[i : i + 128, j : j + 128].max()
    s = np.where(s > 0, s / np.float32(448), np.float32(1))
    deq = (t / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s.astype(np.float64)
    t64 = t.astype(np.float64)
    norm = np.linalg.norm(t64, axis=1)
    rel = np.where(norm > 0, np.linalg.norm(deq - t64, axis=1) / np.where(norm > 0, norm, 1), 0)
    nz = t64 != 0
    flushed = (nz & (deq == 0)).sum(1) / np.maximum(nz.sum(1), 1)
    return rel, flushed


def test_group_amax_ratio():
    t = _tensor()
    np.testing.assert_array_equal(group_amax_ratio(t, "tile")[t.any(1)], 1.0)
    assert group_amax_ratio(t, "tile")[7] == 0.0
    block = group_amax_ratio(t, "block")
    a = np.abs(t.astype(np.float64))
    # Per token, its best-served 128-feature part relative to that part's block.
    want = np.zeros(200)
    for i in range(0, 200, 128):
        for j in range(0, 300, 128):
            blk = a[i : i + 128, j : j + 128]
            want[i : i + 128] = np.maximum(want[i : i + 128], blk.max(1) / blk.max())
    np.testing.assert_allclose(block, want)
    np.testing.assert_allclose(group_amax_ratio(t, "tensor"), a.max(1) / 50.0)
    with pytest.raises(ValueError, match="granularity"):
        group_amax_ratio(t, "column")


@pytest.mark.parametrize("gran", ["tile", "block"])
def test_token_errors_match_reference(gran):
    t = _tensor()
    got = token_quant_errors(t, gran)
    rel, flushed = _ref_errors(t, gran)
    np.testing.assert_allclose(got["rel_err"], rel, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(got["flushed"], flushed)
    assert got["rel_err"][7] == 0.0 and got["flushed"][7] == 0.0


def test_blocks_flush_small_tokens_that_tiles_keep():
    t = _tensor()
    tile, block = token_quant_errors(t, "tile"), token_quant_errors(t, "block")
    tiny = (block["amax_ratio"] < 2.0**-19) & t.any(axis=1)
    assert tiny.sum() > 10
    # Tiles follow each token: a few percent at most, nothing flushed.
    # (Token 3 excepted: its one value of 50 shares a tile with values 2^-24 smaller.)
    others = np.arange(len(t)) != 3
    assert tile["rel_err"].max() < 0.07 and tile["flushed"][others].max() == 0.0
    # Blocks: tokens 2^19 below their block's amax are gone entirely.
    np.testing.assert_array_equal(block["flushed"][tiny], 1.0)
    np.testing.assert_allclose(block["rel_err"][tiny], 1.0)
