"""Grouped block-scaled FP8 GEMM for MoE experts, DeepGEMM's "contiguous" layout.

Rows of A are grouped by expert: rows ``[off_e, off_e + group_sizes[e])`` (with
``off_e = sum(group_sizes[:e])``) use expert ``e``'s weight ``b_data[e]``;
rows past ``sum(group_sizes)`` belong to no expert and come out as zeros::

    a_data  float8 (M, K)          a_scale float32 (M, ceil(K/128))          1x128 tiles
    b_data  float8 (E, K, N)       b_scale float32 (E, ceil(K/128), ceil(N/128))  128x128 blocks
    group_sizes int32 (E,), sum(group_sizes) <= M

    out[m, n] = sum_c (sum_{k in c} a[m, k] b[e(m), k, n]) * a_scale[m, c] * b_scale[e(m), c, n // 128]

with the same FP32 two-level accumulation as ``block_gemm`` (see there).

**Alignment.**  The kernel needs every ``block_m``-row tile to belong to one
expert (DeepGEMM requires each expert's segment to be padded to its M block
size).  ``grouped_block_scaled_matmul`` accepts any ``group_sizes`` and builds
that layout itself: ``fp8jax.groups.group_layout`` places group ``e`` at the next
multiple of ``block_m``, padding rows get zero data and unit scales, tiles
that hold only padding are tagged -1 and skipped (written as zeros).  The
aligned buffer has the static size ``(ceil(M / block_m) + E) * block_m`` rows
(an upper bound on sum_e ceil(g_e / block_m) tiles), so the gather costs one
extra pass over A, and at most ``E`` tiles of wasted MMA work.  Callers that
already produce aligned groups (a dispatcher that pads each expert's segment)
call ``grouped_block_scaled_matmul_aligned`` with one expert id per row tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8jax.groups import group_layout
from fp8jax.kernels.block_gemm import (
    CHUNK,
    _compiler_params,
    _launch_args,
    _pad_to,
    block_scaled_matmul_reference,
    check_blocks,
    check_int32_offsets,
    check_operands,
    chunk_loop,
    launch,
    round_up,
    tile_ij,
)


def _check_group_sizes(group_sizes, num_groups):
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"group_sizes must have shape (E,) = ({num_groups},), got {group_sizes.shape}"
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must be an integer array, got {group_sizes.dtype}")


def _to_kn_scales(b_scale, b_layout):
    return b_scale if b_layout == "kn" else jnp.swapaxes(b_scale, 1, 2)


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


def _grouped_kernel(
    gid_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, *, n_k, bm, bn, n_m, n_n, group_m, trans_b
):
    e = gid_ref[0]
    _, j = tile_ij(pl.program_id(0), n_m, n_n, group_m)
    n0 = pl.multiple_of(j * bn, bn)
    sb_col = lax.div(j * bn, CHUNK)

    @pl.when(e >= 0)
    def _compute():
        def load_a(c):
            return a_ref[:, pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]

        def load_b(c):
            ks = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
            ns = pl.ds(n0, bn)
            return b_ref[e, ns, ks] if trans_b else b_ref[e, ks, ns]

        acc = chunk_loop(
            load_a,
            load_b,
            lambda c: sa_ref[c, :],
            lambda c: sb_ref[e, c, sb_col],
            n_k,
            bm,
            bn,
            trans_b=trans_b,
        )
        # Single rounding of the FP32 accumulator to the output dtype.
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(e < 0)
    def _padding_tile():
        o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype",
        "block_m",
        "block_n",
        "b_layout",
        "group_m",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _grouped_aligned(
    a_data,
    a_scale,
    b_data,
    b_scale_kn,
    block_group,
    *,
    out_dtype,
    block_m,
    block_n,
    b_layout,
    group_m,
    num_warps,
    num_stages,
    interpret,
):
    trans_b = b_layout == "nk"
    mp, k = a_data.shape
    num_groups = b_data.shape[0]
    n = b_data.shape[1] if trans_b else b_data.shape[2]
    bm, bn = block_m, block_n
    kp, np_ = round_up(k, CHUNK), round_up(n, CHUNK)
    kc, nc = kp // CHUNK, np_ // CHUNK
    n_m, n_n = mp // bm, np_ // bn

    # Zero data padding adds exact zeros; unit scale padding keeps it inert.
    a_p = _pad_to(a_data, (mp, kp), 0)
    b_p = _pad_to(b_data, (num_groups, np_, kp) if trans_b else (num_groups, kp, np_), 0)
    # A's scales transposed to (Kc, Mp): one contiguous row of bm scales per chunk.
    sa_t = _pad_to(a_scale, (mp, kc), 1.0).T
    sb = _pad_to(b_scale_kn, (num_groups, kc, nc), 1.0)

    def ij(pid):
        return tile_ij(pid, n_m, n_n, group_m)

    kernel = functools.partial(
        _grouped_kernel,
        n_k=kc,
        bm=bm,
        bn=bn,
        n_m=n_m,
        n_n=n_n,
        group_m=group_m,
        trans_b=trans_b,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(n_m * n_n,),
        in_specs=[
            pl.BlockSpec((1,), lambda pid: (ij(pid)[0],)),
            pl.BlockSpec((bm, kp), lambda pid: (ij(pid)[0], 0)),
            pl.BlockSpec((kc, bm), lambda pid: (0, ij(pid)[0])),
            # Whole weight stack: the expert is chosen inside the kernel from
            # the tile's group id (the Triton lowering has no scalar prefetch).
            pl.BlockSpec(b_p.shape, lambda pid: (0, 0, 0)),
            pl.BlockSpec(sb.shape, lambda pid: (0, 0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda pid: ij(pid)),
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="fp8_grouped_block_scaled_matmul",
    )(block_group.astype(jnp.int32), a_p, sa_t, b_p, sb)
    return out[:, :n]


def grouped_block_scaled_matmul_aligned(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    block_group: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    b_layout: str = "kn",
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int = 8,
) -> jax.Array:
    """Grouped GEMM on rows already aligned to ``block_m``.

    ``a_data`` (Mp, K) with Mp a multiple of ``block_m``; ``block_group`` int32
    (Mp // block_m,): expert of each row tile, -1 for a tile of padding (output
    zeros, no MMA work).  ``b_layout`` "kn": b_data (E, K, N), b_scale
    (E, Kc, Nc); "nk": b_data (E, N, K), b_scale (E, Nc, Kc).
    """
    mp, _, _ = check_operands(
        a_data, a_scale, b_data, b_scale, out_dtype, b_layout=b_layout, b_batch=True
    )
    check_blocks(block_m, block_n)
    check_int32_offsets(a_data, b_data)
    if mp % block_m:
        raise ValueError(f"aligned rows: M={mp} must be a multiple of block_m={block_m}")
    if block_group.shape != (mp // block_m,):
        raise ValueError(f"block_group must have shape ({mp // block_m},), got {block_group.shape}")
    return launch(
        _grouped_aligned,
        a_data,
        a_scale,
        b_data,
        _to_kn_scales(b_scale, b_layout),
        block_group,
        **_launch_args(
            out_dtype, block_m, block_n, b_layout, group_m, num_warps, num_stages, interpret
        ),
    )


def grouped_block_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    b_layout: str = "kn",
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int = 8,
) -> jax.Array:
    """MoE grouped GEMM, contiguous layout, any ``group_sizes`` (see module docstring).

    Gathers the rows into the ``block_m``-aligned layout, runs the kernel, and
    gathers the result back; rows past ``sum(group_sizes)`` come out as zeros.
    """
    m, _, n = check_operands(
        a_data, a_scale, b_data, b_scale, out_dtype, b_layout=b_layout, b_batch=True
    )
    check_blocks(block_m, block_n)
    _check_group_sizes(group_sizes, b_data.shape[0])
    layout = group_layout(group_sizes, m, block_m)
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
        block_m=block_m,
        block_n=block_n,
        b_layout=b_layout,
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
        group_m=group_m,
    )
    return jnp.where(layout.in_group[:, None], y_al[layout.dst_row], jnp.zeros((), y_al.dtype))
