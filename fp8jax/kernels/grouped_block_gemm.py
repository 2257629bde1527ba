"""Grouped block-scaled FP8 GEMM for MoE experts, DeepGEMM's "contiguous" layout.

Rows of A are grouped by expert: rows ``[off_e, off_e + group_sizes[e])`` (with
``off_e = sum(group_sizes[:e])``) use expert ``e``'s weight ``b_data[e]``;
rows past ``sum(group_sizes)`` belong to no expert and come out as zeros::

    a_data  float8 (M, K)          a_scale float32 (M, ceil(K/128))          1x128 tiles
    b_data  float8 (E, K, N)       b_scale float32 (E, ceil(K/128), ceil(N/128))  128x128 blocks
    group_sizes int32 (E,), sum(group_sizes) <= M

    out[m, n] = sum_c (sum_{k in c} a[m, k] b[e(m), k, n]) * a_scale[m, c] * b_scale[e(m), c, n // 128]

with the same FP32 two-level accumulation as ``block_gemm`` (see there).

**Alignment.**  The kernel (:mod:`fp8jax.kernels.mgpu_block_gemm`) needs
every 128-row tile to belong to one expert (DeepGEMM requires each expert's
segment to be padded to its M block size).  ``grouped_block_scaled_matmul``
accepts any ``group_sizes`` (empty groups, boundaries anywhere) and builds
that layout itself: ``fp8jax.groups.group_layout`` places group ``e`` at the
next multiple of 128, padding rows get zero data and unit scales, tiles that
hold only padding are tagged -1 and skipped (written as zeros, nothing
loaded).  The aligned buffer has the static size ``(ceil(M / 128) + E) * 128``
rows (an upper bound on sum_e ceil(g_e / 128) tiles), so the gather costs one
extra pass over A, and at most ``E`` tiles of wasted MMA work.  Callers that
already produce aligned groups (a dispatcher that pads each expert's segment)
call ``grouped_block_scaled_matmul_aligned`` with one expert id per row tile.

**Wgrad.**  ``grouped_wgrad`` takes the experts' x and dy in the same
expert-aligned 128-token tiles and sums each expert's tiles in one kernel
(``mgpu_block_gemm.grouped_wgrad_nt``): no (tiles, K, N) float32 products.

**Weight layout.**  FP8 ``wgmma`` reads K-major operands only: with "nk"
weights (E, N, K) (Dgrad's W as stored) nothing moves; "kn" weights (E, K, N)
(Fprop's W) are transposed once in XLA (FP8 codes, exact), which a quantizer
that writes W^T alongside W saves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.groups import group_layout
from fp8jax.kernels import mgpu_block_gemm as mgpu
from fp8jax.kernels.block_gemm import (
    CHUNK,
    _pad_to,
    block_scaled_matmul_reference,
    check_operands,
    check_token_tiles,
    launch,
    round_up,
)
from fp8jax.kernels.mgpu_block_gemm import BLOCK_M


def _check_group_sizes(group_sizes, num_groups):
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"group_sizes must have shape (E,) = ({num_groups},), got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got {group_sizes.dtype}")


# ----------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------


def grouped_block_scaled_matmul_reference(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """Same math in plain jnp: one ``block_scaled_matmul_reference`` per expert, rows masked.

    Costs E dense GEMMs (fine for tests and small CPU runs).  Each row's FP32
    result comes from exactly one expert, so masking adds exact zeros.
    """
    m, _, n = check_operands(a_data, a_scale, b_data, b_scale, out_dtype, b_batch=True)
    num_groups = b_data.shape[0]
    _check_group_sizes(group_sizes, num_groups)
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")

    def step(acc, xs):
        e, b_e, s_e = xs
        y_e = block_scaled_matmul_reference(a_data, a_scale, b_e, s_e, out_dtype=jnp.float32)
        return acc + jnp.where((row_group == e)[:, None], y_e, 0.0), None

    acc0 = jnp.zeros((m, n), jnp.float32)
    acc, _ = lax.scan(step, acc0, (jnp.arange(num_groups), b_data, b_scale))
    # Rows past sum(group_sizes) have row_group == E and stay zero.
    return acc.astype(out_dtype)


# ----------------------------------------------------------------------------
# kernel
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("out_dtype", "b_layout", "interpret", "stages"))
def _grouped_aligned(
    a_data, a_scale, b_data, b_scale, block_group, *, out_dtype, b_layout, interpret, stages
):
    """Pad K and N to the kernel's tiles, bring B to (E, N, K), run the kernel, crop."""
    mp, k = a_data.shape
    # "nk": B (E, N, K) and its block scales (E, Nc, Kc) are read as given.
    nk = b_layout != "kn"
    if not nk:
        # FP8 wgmma reads K-major B only: transpose the codes once in XLA (exact).
        b_data = jnp.swapaxes(b_data, 1, 2)
    num_groups, n, _ = b_data.shape
    kp, np_ = round_up(k, CHUNK), round_up(n, CHUNK)
    kc = kp // CHUNK
    # Zero data padding adds exact zeros; unit scale padding keeps it inert.
    a_p = _pad_to(a_data, (mp, kp), 0)
    b_p = _pad_to(b_data, (num_groups, np_, kp), 0)
    # A's scales as (Kc, Mp): each K step loads one contiguous row of 128.
    sa_t = _pad_to(a_scale, (mp, kc), 1.0).T
    sb = _pad_to(b_scale, mgpu.b_scale_shape(num_groups, np_, kc, b_cols=False, b_scale_nk=nk), 1.0)
    out = mgpu.grouped_matmul_nt(
        block_group,
        a_p,
        sa_t,
        b_p,
        sb,
        out_dtype=out_dtype,
        b_scale_nk=nk,
        interpret=interpret,
        stages=stages,
    )
    return out[:, :n]


def grouped_block_scaled_matmul_aligned(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    block_group: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    b_layout: str = "kn",
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """Grouped GEMM on rows already aligned to 128-row tiles.

    ``a_data`` (Mp, K) with Mp a multiple of 128; ``block_group`` int32
    (Mp // 128,): expert of each row tile, -1 for a tile of padding (output
    zeros, no loads, no MMA work).  ``b_layout`` "kn": b_data (E, K, N),
    b_scale (E, Kc, Nc), transposed once in XLA to the kernel's K-major
    layout; "nk": b_data (E, N, K), b_scale (E, Nc, Kc), the kernel's own
    layout (Dgrad's weight as stored).  ``interpret``: see
    :func:`fp8jax.kernels.block_gemm.launch`.
    """
    mp, _, _ = check_operands(
        a_data, a_scale, b_data, b_scale, out_dtype, b_layout=b_layout, b_batch=True
    )
    if mp % BLOCK_M:
        raise ValueError(f"aligned rows: M={mp} must be a multiple of {BLOCK_M}")
    if block_group.shape != (mp // BLOCK_M,):
        raise ValueError(f"block_group must have shape ({mp // BLOCK_M},), got {block_group.shape}")
    return launch(
        _grouped_aligned,
        a_data,
        a_scale,
        b_data,
        b_scale,
        block_group.astype(jnp.int32),
        interpret=interpret,
        out_dtype=jnp.dtype(out_dtype),
        b_layout=b_layout,
        stages=stages,
    )


def grouped_block_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    b_layout: str = "kn",
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """MoE grouped GEMM, contiguous layout, any ``group_sizes`` (see module docstring).

    Gathers the rows into the ``block_m``-aligned layout, runs the kernel, and
    gathers the result back; rows past ``sum(group_sizes)`` come out as zeros.
    """
    m, _, n = check_operands(
        a_data, a_scale, b_data, b_scale, out_dtype, b_layout=b_layout, b_batch=True
    )
    _check_group_sizes(group_sizes, b_data.shape[0])
    layout = group_layout(group_sizes, m, BLOCK_M)
    valid = layout.row_valid[:, None]
    # Padding rows: zero data (adds nothing) and unit scales (inert).
    a_al = jnp.where(valid, a_data[layout.src_row], jnp.zeros((), a_data.dtype))
    sa_al = jnp.where(valid, a_scale[layout.src_row], 1.0)
    y_al = grouped_block_scaled_matmul_aligned(
        a_al,
        sa_al,
        b_data,
        b_scale,
        layout.tile_group,
        out_dtype=out_dtype,
        b_layout=b_layout,
        interpret=interpret,
        stages=stages,
    )
    return jnp.where(layout.in_group[:, None], y_al[layout.dst_row], jnp.zeros((), y_al.dtype))


# ----------------------------------------------------------------------------
# Wgrad over expert-aligned token tiles
# ----------------------------------------------------------------------------


def expert_runs(tile_group: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """(first tile, tile count) of each expert, int32 (E,), from the expert of each tile
    (ascending, -1 for padding): an expert's tiles are consecutive."""
    tg = tile_group.astype(jnp.int32)
    experts = jnp.arange(num_groups, dtype=jnp.int32)[:, None]
    # Both as sums over the tiles, which XLA fuses into one kernel (a
    # cumulative sum of the counts would be a kernel of its own, one more in
    # the H100 census): an expert's tiles follow all lower experts'.
    start = jnp.sum((tg[None, :] >= 0) & (tg[None, :] < experts), axis=1, dtype=jnp.int32)
    count = jnp.sum(tg[None, :] == experts, axis=1, dtype=jnp.int32)
    return start, count


@functools.partial(jax.jit, static_argnames=("num_groups", "out_dtype", "interpret", "stages"))
def _grouped_wgrad(
    a_data, a_scale, b_data, b_scale, tile_group, *, num_groups, out_dtype, interpret, stages
):
    """Lay the tiles out K-major (tokens minor), pad M and N to the kernel's tiles, run
    it, crop."""
    t, _, m = a_data.shape
    n = b_data.shape[2]
    mp, np_ = round_up(m, CHUNK), round_up(n, CHUNK)

    def k_major(data, scale, cols):
        # FP8 wgmma reads K-major operands only: the codes of all tiles as one
        # (C, T * 128) matrix (a transpose in XLA, exact, which cancels where a
        # requantizer wrote the codes K-major); each tile's column scales are
        # already one row (T, C) per K run.  Zero codes and unit scales pad the
        # columns.
        codes = _pad_to(data.reshape(t * CHUNK, -1).T, (cols, t * CHUNK), 0)
        return codes[None], _pad_to(scale.reshape(t, -1), (t, cols), 1.0)[None]

    a_t, sa_t = k_major(a_data, a_scale, mp)
    b_t, sb = k_major(b_data, b_scale, np_)
    start, count = expert_runs(tile_group, num_groups)
    out = mgpu.grouped_wgrad_nt(
        start, count, a_t, sa_t, b_t, sb, out_dtype=out_dtype, interpret=interpret, stages=stages
    )
    return out[:, :m, :n]


def grouped_wgrad(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    tile_group: jax.Array,
    num_groups: int,
    *,
    out_dtype=jnp.float32,
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """``tpu_block_gemm.grouped_wgrad``'s experts' Wgrad, (E, M, N), on a Hopper GPU.

    The same operands (x and dy in expert-aligned 128-token tiles, one
    scale per tile and column, each tile's expert) and the same sums: each
    tile one 128-long K run, its float32 partial times fl32(a_scale *
    b_scale) added in tile order to the expert's float32 accumulator, here
    in registers (:func:`fp8jax.kernels.mgpu_block_gemm.grouped_wgrad_nt`).
    An expert with no tile gets zeros; no (T, M, N) intermediate reaches
    HBM.  ``interpret``: see :func:`fp8jax.kernels.block_gemm.launch`.
    """
    check_token_tiles(a_data, a_scale, b_data, b_scale, tile_group, out_dtype)
    return launch(
        _grouped_wgrad,
        a_data,
        a_scale.astype(jnp.float32),
        b_data,
        b_scale.astype(jnp.float32),
        tile_group.astype(jnp.int32),
        interpret=interpret,
        num_groups=num_groups,
        out_dtype=jnp.dtype(out_dtype),
        stages=stages,
    )
