"""Block-scaled FP8 GEMM (DeepSeek-V3 1x128 / 128x128 scaling) as a Pallas TPU (Mosaic) kernel.

The same math as :mod:`fp8jax.kernels.block_gemm` (``c`` runs over the
128-long K runs)::

    out[m, n] = sum_c ( sum_{k in c} a[m, k] * b[k, n] ) * a_scale[m, c] * b_scale[c, n // 128]

Each run's FP8 x FP8 dot is taken on the FP8 codes themselves with a float32
result (``preferred_element_type=float32``), which Mosaic hands to the matrix
unit as FP8 operands on chips that multiply FP8 (Ironwood, tpu7x).  The run's
float32 partial is multiplied by ``fl32(a_scale * b_scale)`` and added to a
float32 accumulator that stays in VMEM for the whole K loop (the promotion
every 128 of DeepSeek-V3, on chip); the accumulator is rounded once to a
bfloat16 ``out_dtype`` when the last K step is done (a float32 output block
is the accumulator itself).

Grid ``(M / bm, N / bn, K / (128 j))``: output tiles, then K steps of ``j``
runs each (at most :data:`RUNS_PER_STEP`, a divisor of K's runs where
that costs less than padding K, :func:`_step_runs`; the runs unrolled
inside a loop over slices of the block's rows, :func:`_accumulate`); the K axis is
"arbitrary" (sequential: the accumulator carries across it), the two
output axes "parallel".  Where all of K fits one step next to a narrower
output block, the plain kernels and the Wgrad that requantizes its A take
it in one (:func:`_resident_a_blocks`; its runs looped in groups of
:data:`RUNS_PER_STEP`): A's block index then stays the same across a row
block's column blocks and A is read from HBM once, not once per column
block (and requantized once).  The kernel copies that A block into one
VMEM buffer itself (the pipeline would hold it twice), which leaves room
for blocks twice as tall, so B is read half as often.  Three orientations,
all read in the layout the operands are stored in (no transposes in HBM):

    "nn" (fprop)  a (M, K) with 1x128 tiles,   b (K, N) with 128x128 blocks
    "nt" (dgrad)  a (M, K) with 1x128 tiles,   b given as (N, K), blocks (N/128, K/128)
    "tn" (wgrad)  a given as (K, M), b (K, N), both with 128x1 tiles along K

Three variants also quantize their A (the quantizer's kernel bodies,
:mod:`fp8jax.kernels.tpu_quantize`, the same bits), so that an operand is
read from HBM once for its quantization and its GEMM:

    "nn" quantizing   x (M, K) in float32 / bfloat16, quantized in 1x128 tiles
                      per block; its codes and scales are outputs too (the
                      Wgrad's FP8 cache)
    "nt" quantizing   dy (M, K) in float32 / bfloat16, quantized in 1x128
                      tiles per block, its codes and scales in VMEM only
    "tn" requant      x's FP8 cache (K, M) in 1x128 tiles along M, dequantized
                      and quantized again in 128-token tiles per block, in VMEM

Inside the kernel the scales take one form: A's as ``(K/128, M)`` (one row of
``bm`` scales per run) and B's as ``(K/128, N)`` (one scale per column per
run; a 128x128 block scale repeated over its 128 columns).  A's row of
scales becomes a column by one small transpose per K step.

Shapes that are not multiples of the blocks are taken in place, the last
blocks running past the operands' edges (:mod:`fp8jax.kernels.tpu_edges`):
an output column (row) is computed from B's column (A's row) alone and its
part past the edge never written back, and a block whose K run crosses K's
edge is zeroed past it before its dots (or its quantization in the
kernel).  Only an A the kernel copies whole itself (one K step) is padded
with zeros, and the scales (small) with ones (inert).  Where the block
sizes exceed a small operand they shrink to it (rounded up to the hardware
tiles).

The grouped kernel (MoE experts) reads the expert-aligned layout the GEMM
core builds (``fp8jax.groups.group_layout``): rows sorted by expert in tiles
of ``tile`` rows, ``tile_group[t]`` the expert of tile t, -1 for a tile of
padding (written as zeros, no matrix-unit work, no reads).
The tile ids reach the kernel as scalar prefetch (SMEM), so each tile's
weight blocks are DMA'd from its own expert.  Its grid is ``(N / bn,
tiles, K steps)`` with all of K in one step where an expert's weight block
fits: an expert's consecutive tiles then share its weight block, read once
per column block.

``interpret=True`` runs the kernel in Pallas' TPU interpret mode (DMAs and
the grid simulated on CPU), the way the tests check it without a TPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8jax import platforms
from fp8jax.formats import IEEE_FP8, KERNEL_FLOATS
from fp8jax.kernels import tpu_edges, tpu_quantize
from fp8jax.kernels.block_gemm import (
    CHUNK,
    _pad_to,
    cdiv,
    check_operands,
    check_tn_operands,
    check_token_tiles,
    expand_b_scale,
    round_up,
)
from fp8jax.kernels.tpu_params import F32_SUBLANES, VMEM_LIMIT, compiler_params

#: The dense kernels' output block (rows x columns).  Each operand is
#: re-read from HBM once per block on the other side (A N/bn times, B M/bm
#: times), so larger blocks move fewer bytes: libtpu's count for
#: deepseek_v3's fwd+bwd at 4096^3 on tpu7x is 699 MiB with 1024 x 1024
#: blocks, 503 MiB with these.  The double-buffered VMEM of a block with 8
#: runs (1024 along K) per step: codes 2 x 2 x 2 MiB, output 2 x 8 MiB in
#: bfloat16 (plus a 16 MiB float32 accumulator) or 2 x 16 MiB in float32 (its
#: own accumulator), and one row slice's float32 partial
#: (:data:`ROWS_PER_DOT`); "tn" holds more besides (57.5 MiB on tpu7x).
DENSE_BLOCK_M = 2048
DENSE_BLOCK_N = 2048
#: The VMEM a plain kernel's codes may take, double-buffered, where all of an
#: unaligned K is one step (:func:`_one_step`): twice that of a step of
#: :data:`RUNS_PER_STEP` runs by DENSE_BLOCK_M x DENSE_BLOCK_N blocks.
ONE_STEP_CODES = 16 << 20
#: The grouped (MoE) kernels' blocks: a tile of rows by BLOCK_N columns, and
#: BLOCK_M x BLOCK_N for the grouped Wgrad.
BLOCK_M = 1024
BLOCK_N = 1024
#: Runs (of 128 along K) per K step.
RUNS_PER_STEP = 8
#: The scoped VMEM a dense kernel whose A block holds all of K may plan for
#: (:func:`_resident_a_blocks`): below :data:`VMEM_LIMIT`, which Mosaic's own
#: buffers share.  A's block counts once (the kernel's own copy,
#: :func:`_copy_row_block`), every pipelined block twice (double-buffered; a
#: ``pl.Buffered(1)`` A block took the VMEM of two all the same).  Planned
#: against used on tpu7x, K 4096 with 4096 x 256 blocks: 28.3 MiB planned,
#: 27.8 MiB used.
RESIDENT_A_VMEM = 48 << 20
#: Output rows per FP8 dot inside a K step: one run's float32 partial is
#: ROWS_PER_DOT x bn (4 MiB at 512 x 2048), not the whole block's.
ROWS_PER_DOT = 512
#: The grouped (MoE) GEMM kernels' scoped VMEM: with them at 60 MiB libtpu
#: gives no time at all for the grouped fwd+bwd (8 x 512 x 7168 x 2048).
GROUPED_VMEM_LIMIT = 48 << 20
#: The double-buffered VMEM an expert's weight block for all of K may take in
#: the grouped Fprop / Dgrad kernel (:func:`_grouped_blocks`): K 7168 by 1024
#: columns of E4M3 is 2 x 7 MiB.
GROUPED_WEIGHT_VMEM = 24 << 20

# Mosaic's native tiles: 8-bit data is tiled (32, 128), float32 (F32_SUBLANES,
# 128); every block's last dimension is a multiple of 128.
_SUBLANE_FP8 = 32
_LANE = 128


def _fit(size: int, block: int, tile: int) -> int:
    """The block along an axis of ``size``: the whole axis (rounded up to ``tile``) when
    it fits in ``block`` and a sixteenth more (2112 columns against 2048: one block of
    2176, where two of 1152 would read the other operand twice), else equal blocks of
    at most ``block`` (multiples of 128), so that the padding stays under one lane
    tile per block (1536 rows: two of 768, not two of 1024)."""
    if round_up(size, tile) <= block + block // 16:
        return round_up(size, tile)
    return round_up(cdiv(size, cdiv(size, block)), _LANE)


def _blocks(m: int, n: int, block_m: int, block_n: int, orient: str, squares=False):
    """A dense kernel's (bm, bn), clipped to the operand (rounded up to the hardware
    tiles); its K step is :func:`_step_runs`'s.
    ``squares``: A is quantized in the kernel, in 128 x 128 squares."""
    # In "tn" A's rows sit on the lanes of its (K, M) blocks.
    m_tile = _LANE if orient == "tn" or squares else _SUBLANE_FP8
    return _fit(m, block_m, m_tile), _fit(n, block_n, _LANE)


def _step_runs(kc: int, runs: int) -> int:
    """The runs per K step of a dense kernel: all ``kc`` of them when they fit one step,
    else the j <= ``runs`` that costs least as padded runs plus half a run per step
    (K 1536: two steps of 6 runs, where steps of 8 would pad K to 2048 and add a
    third of the work; K 7168: steps of 8, as before)."""
    if kc <= runs:
        return kc
    return min(range(1, runs + 1), key=lambda j: (round_up(kc, j) + cdiv(kc, j) / 2, -j))


def _one_step(kc: int, runs: int, bm: int, bn: int, run: int) -> bool:
    """Whether a plain kernel takes all ``kc`` runs in one K step, A through the pipeline:
    where steps of ``runs`` do not divide K (whose steps would pad K, or take fewer
    runs each, and read A once per column block) and the step's codes, A's and B's
    blocks double-buffered, fit :data:`ONE_STEP_CODES`.  A's block index then stays
    the same across a row block's column blocks, so the pipeline reads A once (K
    2112, 17 runs, by 2048-row and 1792-column blocks: 15.9 MiB, where three steps
    of 6 runs read A four times)."""
    return kc > runs and kc % runs != 0 and 2 * (bm + bn) * kc * run <= ONE_STEP_CODES


def _step_rows(j: int, kc: int) -> int:
    """Rows of the scale block of a K step of ``j`` runs (of ``kc`` in all): j where that
    is a legal block (a multiple of the float32 sublane tile, 8, or all the runs), else
    j padded to a whole tile."""
    return j if j % F32_SUBLANES == 0 or j == kc else round_up(j, F32_SUBLANES)


def _step_scales(s: jax.Array, j: int, width: int, col: Callable) -> tuple[jax.Array, Any]:
    """Scales ``s`` (Kc, X), Kc a multiple of ``j``, and the BlockSpec that reads the ``j``
    rows of one K step and ``width`` columns at block ``col(i, jn)``: ``s`` itself, or,
    where j rows are no legal block (:func:`_step_rows`), each step's rows padded with
    unit scales to a whole tile, (Kc / j, rows, X), of which the kernel reads the first j."""
    rows = _step_rows(j, s.shape[0])
    if rows == j:
        return s, pl.BlockSpec((j, width), lambda i, jn, kk: (kk, col(i, jn)))
    steps = s.reshape(s.shape[0] // j, j, s.shape[1])
    spec = pl.BlockSpec((None, rows, width), lambda i, jn, kk: (kk, 0, col(i, jn)))
    return _pad_to(steps, (steps.shape[0], rows, s.shape[1]), 1.0), spec


def _resident_a_blocks(
    m: int,
    n: int,
    kc: int,
    bm: int,
    bn: int,
    orient: str,
    out_dtype,
    run: int,
    runs: int = RUNS_PER_STEP,
    requant: bool = False,
) -> tuple[int, int] | None:
    """(bm, bn) of a dense kernel that takes all ``kc`` runs of K in one step, or None
    where the stepped blocks (``bm`` x ``bn``, :func:`_step_runs`) are kept.

    With one K step A's block index does not change across a row block's column
    blocks, so A is read from HBM once (:func:`cost_estimate`'s ``resident_a``)
    instead of once per column block; B is still read once per row block, so
    taller blocks read B fewer times.  The A block then holds bm x K codes, in
    one VMEM copy the kernel makes itself (:func:`_copy_row_block`): bm from
    half to twice ``bm`` and bn from ``bn`` down to 256 (v6e's matrix units are
    256 wide: 128 columns would leave half of one idle), wherever
    A's copy, the double-buffered B, scale and output blocks, the accumulator
    and the temporaries of one row slice's group of runs fit
    :data:`RESIDENT_A_VMEM`.  Of those, the fewest bytes moved,
    then the widest, the tallest.  Taken only where K has more runs than one
    step of ``runs`` holds and a multiple of :data:`RUNS_PER_STEP` (the
    in-kernel loop's groups), and where it moves fewer bytes than the stepped
    blocks.
    ``requant``: the "tn" kernel that quantizes its A (x's cache) again, whose
    VMEM also holds the cache's tile scales and the requantized codes and scales,
    and whose blocks are no taller than ``bm``.
    """
    if kc <= runs or kc % RUNS_PER_STEP:
        return None
    kp = kc * run
    out_size = jnp.dtype(out_dtype).itemsize
    m_tile = _LANE if orient == "tn" else _SUBLANE_FP8

    def bytes_moved(bm_, bn_, resident):
        mp, np_ = round_up(m, bm_), round_up(n, bn_)
        kcp = kc if resident else round_up(kc, _step_runs(kc, runs))
        est = cost_estimate(mp, np_, kcp * run, bm_, bn_, out_dtype, run, resident_a=resident)
        return est.bytes_accessed

    def vmem(bm_, bn_):
        step_scales = 4 * round_up(kc, F32_SUBLANES)
        # A requantizing kernel's A scales are the cache's, (tiles, tokens).
        a_scales = 4 * round_up(bm_ // _LANE, F32_SUBLANES) * kp if requant else step_scales * bm_
        # A's codes in the kernel's single copy (_copy_row_block); every
        # pipelined input block double-buffered.
        inputs = kp * bm_ + 2 * (kp * bn_ + a_scales + step_scales * bn_)
        out = bm_ * bn_ * (2 * out_size + (0 if out_size == 4 else 4))
        # One row slice's partial and its scaled copy, and its group's scale columns.
        temps = 4 * min(bm_, ROWS_PER_DOT) * (2 * bn_ + _LANE)
        if requant:
            # The requantized codes and scales, and one 128 x 128 group's float32 values.
            inputs += (kp + step_scales) * bm_
            temps += 4 * 4 * _LANE * _LANE
        return inputs + out + temps

    # The requantizing kernel unrolls a row of 128-column tiles per group of tokens:
    # no taller than the stepped block (4096 rows of it overflow tpu7x's VMEM).
    taller = (2 * bm,) if not requant else ()
    tall = {_fit(m, max(c, _LANE), m_tile) for c in (bm // 2, bm, *taller)}
    wide = {_fit(n, c, _LANE) for c in (bn, 1024, 512, 256) if c <= bn}
    fits = [
        (bytes_moved(bm_, bn_, True), -bn_, -bm_, (bm_, bn_))
        for bm_ in tall
        for bn_ in wide
        if vmem(bm_, bn_) <= RESIDENT_A_VMEM
    ]
    if not fits:
        return None
    best = min(fits)
    if best[0] >= bytes_moved(bm, bn, False):
        return None
    return best[-1]


def _check_blocks(block_m: int, block_n: int, runs: int) -> None:
    if block_m < _LANE or block_m % _LANE:
        raise ValueError(f"block_m must be a multiple of 128, got {block_m}")
    if block_n < _LANE or block_n % _LANE:
        raise ValueError(f"block_n must be a multiple of 128, got {block_n}")
    if runs < 8 or runs % 8:
        raise ValueError(f"runs_per_step must be a multiple of 8, got {runs}")


def _run_dot(a, b, orient: str):
    """One run's FP8 x FP8 dot with a float32 result (the matrix unit's FP8 mode)."""
    contract = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}[orient]
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _accumulate(a_ref, sa_ref, b_ref, sb_ref, acc_ref, *, j: int, orient: str, run: int) -> None:
    """Add the ``j`` runs (of ``run`` along K each) of this K step to the float32 accumulator.

    The rows go through in a loop over slices of :data:`ROWS_PER_DOT` rows (a
    shorter last slice after them), so that one run's float32 partial stays
    small next to the accumulator; a slice's runs are unrolled, in a loop over
    groups of :data:`RUNS_PER_STEP` where a step has many (all of K).  The
    kernel's code and VMEM temporaries are then those of one slice's group:
    unrolled over a 2048-row block, libtpu compiled the quantizing Fprop of
    4096^3 three times as long; over a 4096-row block of all of K, Mosaic held
    23 MiB more.  Every output element gets each run's whole 128-long dot, then
    its scale, run by run in K's order.
    """
    bm = acc_ref.shape[0]
    step = min(bm, ROWS_PER_DOT)
    per = RUNS_PER_STEP if j > RUNS_PER_STEP and j % RUNS_PER_STEP == 0 else j

    def group(first):
        def add_slice(rows):
            # This group's rows of the slice's A scales (per, rows), as columns.
            sa_cols = jnp.transpose(sa_ref[pl.ds(first, per), rows])
            for u in range(per):
                ks = pl.ds(_aligned((first + u) * run, run), run)
                sb_row = sb_ref[pl.ds(first + u, 1), :]
                _add_run(a_ref, b_ref, acc_ref, rows, ks, sa_cols[:, u : u + 1], sb_row, orient)

        def full_slice(r, carry):
            add_slice(pl.ds(pl.multiple_of(r * step, step), step))
            return carry

        lax.fori_loop(0, bm // step, full_slice, 0)
        if bm % step:
            add_slice(slice(bm - bm % step, bm))

    if per == j:
        group(0)
        return

    def next_group(g, carry):
        group(pl.multiple_of(g * per, per))
        return carry

    lax.fori_loop(0, j // per, next_group, 0)


def _aligned(index, multiple: int):
    """``index`` (a Python int or a traced one) as known to be a multiple of ``multiple``."""
    return index if isinstance(index, int) else pl.multiple_of(index, multiple)


def _add_run(a_ref, b_ref, acc_ref, rows, ks, sa_col, sb_row, orient: str) -> None:
    """Add one run (K slice ``ks``) of the output rows ``rows`` to the accumulator."""
    a = a_ref[ks, rows] if orient == "tn" else a_ref[rows, ks]
    b = b_ref[:, ks] if orient == "nt" else b_ref[ks, :]
    partial = _run_dot(a, b, orient)
    # Promotion: the run's float32 partial times fl32(a_scale * b_scale).
    acc_ref[rows, :] += partial * (sa_col * sb_row)


def _copy_row_block(a_hbm, a_ref, sem, orient: str) -> None:
    """Copy this row block's A (all of K) from HBM into the VMEM buffer ``a_ref``, and
    wait for it: a one-step kernel's A, fetched by the kernel rather than the pipeline.

    The pipeline would hold A's block twice (double-buffered, also as
    ``pl.Buffered(1)``), though its index changes only once per row block;
    one copy leaves the VMEM for blocks twice as tall, which read B half as
    often.  The copy is a stall of bm x K bytes per row block before its
    first dot."""
    bm = a_ref.shape[1] if orient == "tn" else a_ref.shape[0]
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * bm, bm), bm)
    copy = pltpu.make_async_copy(
        a_hbm.at[:, rows] if orient == "tn" else a_hbm.at[rows, :], a_ref, sem
    )
    copy.start()
    copy.wait()


def _requant_tn_kernel(
    a_ref,
    st_ref,
    flag_ref,
    b_ref,
    sb_ref,
    o_ref,
    q_ref,
    s_ref,
    *scratch,
    j,
    run,
    requant,
    once,
    fetch,
):
    """ "tn" with A the FP8 cache in 1x128 tiles along M: the block's tiles are quantized
    again in 128-token tiles into VMEM (``q_ref`` codes, ``s_ref`` (j, bm) scales: the
    requantizing kernel's body, the same bits), then accumulated as any "tn" block.
    ``once``: all of K is one step, so a row block's A is the same for all its column
    blocks, which run in order (the column axis "arbitrary"): it is quantized at the
    first and the VMEM copies serve the rest.  ``fetch`` (with ``once``): ``a_ref``
    is the cache in HBM, copied into the first of ``scratch`` at the first column
    block (:func:`_copy_row_block`) and quantized from there."""
    acc = scratch[2:] if fetch else scratch

    def requantize(cache_ref):
        tpu_quantize.requantize_block(
            cache_ref,
            st_ref,
            flag_ref,
            q_ref,
            s_ref,
            groups=j,
            col_groups=q_ref.shape[1] // _LANE,
            **requant,
        )

    if fetch:

        @pl.when(pl.program_id(1) == 0)
        def _first():
            _copy_row_block(a_ref, scratch[0], scratch[1], "tn")
            requantize(scratch[0])

    elif once:
        pl.when(pl.program_id(1) == 0)(lambda: requantize(a_ref))
    else:
        requantize(a_ref)
    _dense_kernel(q_ref, s_ref, b_ref, sb_ref, o_ref, *acc, j=j, orient="tn", run=run)


def _fetch_a_kernel(a_hbm, sa_ref, b_ref, sb_ref, o_ref, a_ref, sem, *acc, j, orient, run):
    """A plain kernel whose grid has one K step, with A left in HBM (``a_hbm``): each row
    block's A is copied into ``a_ref`` at its first column block
    (:func:`_copy_row_block`), and the row block's column blocks, in order, read it
    from there."""
    pl.when(pl.program_id(1) == 0)(lambda: _copy_row_block(a_hbm, a_ref, sem, orient))
    _dense_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *acc, j=j, orient=orient, run=run)


def _quantizing_kernel(x_ref, b_ref, sb_ref, o_ref, *refs, j, run, quant, orient, cols=False):
    """ "nn" or "nt" with A unquantized (x, or dy): the block's 1x128 tiles are quantized
    into ``q_ref`` and ``st_ref`` (j, bm) (the quantizer's body, the same bits), output
    blocks (x's codes for the Wgrad's cache) or VMEM scratch, then accumulated from
    them as any block of ``orient``.  ``cols``: the block's 128x1 tiles too (dy's for
    the Wgrad), into the output blocks ``qc_ref`` (bm, bk) and ``sc_ref`` (at least
    bm / 128 rows, bk), the first ``refs``."""
    qc_ref, sc_ref = (refs[0], refs[1]) if cols else (None, None)
    q_ref, st_ref, *acc = refs[2:] if cols else refs
    tpu_quantize.rows_cols_kernel(
        x_ref,
        q_ref,
        st_ref,
        qc_ref,
        sc_ref,
        groups=q_ref.shape[0] // _LANE,
        col_groups=j,
        looped=True,
        **quant,
    )
    _dense_kernel(q_ref, st_ref, b_ref, sb_ref, o_ref, *acc, j=j, orient=orient, run=run)


def _dense_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *scratch, j: int, orient: str, run: int):
    # A float32 output block is its own accumulator (it stays in VMEM across
    # the K steps); any other output gets a float32 scratch accumulator.
    acc_ref = scratch[0] if scratch else o_ref
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    _accumulate(a_ref, sa_ref, b_ref, sb_ref, acc_ref, j=j, orient=orient, run=run)

    if scratch:

        @pl.when(k == pl.num_programs(2) - 1)
        def _write():
            # One rounding of the float32 accumulator to the output dtype.
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def cost_estimate(
    mp: int,
    np_: int,
    kp: int,
    bm: int,
    bn: int,
    out_dtype,
    run: int = CHUNK,
    resident_a: bool = False,
    b_passes: int | None = None,
) -> pl.CostEstimate:
    """What the kernel moves and computes: 2 M N K flops; codes, scales and output bytes.

    Each of the ``N / bn`` output column blocks reads all of A (codes and
    scales) once, each of the ``M / bm`` row blocks all of B; the output is
    written once.  ``resident_a``: the grid has one K step, so A's block index
    stays the same across a row block's column blocks and the pipeline fetches
    it once: all of A is read once.  ``b_passes``: B (one expert's weight, in
    the grouped kernels) is read that many times in all instead.
    """
    n_m, n_n, kc = mp // bm, np_ // bn, kp // run
    a_bytes = (mp * kp + kc * mp * 4) * (1 if resident_a else n_n)
    b_bytes = (kp * np_ + kc * np_ * 4) * (n_m if b_passes is None else b_passes)
    out_bytes = mp * np_ * jnp.dtype(out_dtype).itemsize
    return pl.CostEstimate(
        flops=2 * mp * np_ * kp, transcendentals=0, bytes_accessed=a_bytes + b_bytes + out_bytes
    )


def _compiler_params(
    interpret: bool, n_axes: int = 3, vmem_limit: int = VMEM_LIMIT, parallel: int | None = None
):
    """The axes' semantics: the first ``parallel`` (default: all but the last) "parallel",
    the rest "arbitrary" (sequential)."""
    if interpret:
        return None
    parallel = n_axes - 1 if parallel is None else parallel
    return compiler_params(
        ("parallel",) * parallel + ("arbitrary",) * (n_axes - parallel), vmem_limit
    )


def _interpret(interpret: bool):
    # TPU interpret mode: the grid, DMAs and VMEM simulated on the host.
    return pltpu.InterpretParams() if interpret else False


@functools.partial(
    jax.jit,
    static_argnames=(
        "orient",
        "out_dtype",
        "block_m",
        "block_n",
        "runs",
        "interpret",
        "run",
        "requant",
        "quant",
        "keep_codes",
        "col_codes",
    ),
)
def _dense(
    a,
    sa_t,
    b,
    sb_cols,
    flag=None,
    *,
    orient,
    out_dtype,
    block_m,
    block_n,
    runs,
    interpret,
    run=CHUNK,
    requant=None,
    quant=None,
    keep_codes=True,
    col_codes=False,
):
    """Pad, launch, crop.  ``a``/``b`` as stored (module docstring); ``sa_t`` (Kc, M),
    ``sb_cols`` (Kc, N) with Kc = ceil(K / run).  ``run``: the K run of one scale
    (DeepSeek-V3's 128; another value only for measuring what the promotion costs).

    ``requant`` ("tn" only; a tuple of ``tpu_quantize.requantize_col``'s settings):
    ``a`` (K, M) is an FP8 cache in 1x128 tiles along M, ``sa_t`` its scales
    (K, ceil(M/128)) and ``flag`` whether any of them is subnormal; the kernel
    quantizes each block again in 128-token tiles before its dots.

    ``quant`` ("nn" or "nt"; a tuple of ``tpu_quantize.quantize_2d``'s settings):
    ``a`` (M, K) is x (or dy) in float32 or bfloat16, quantized in 1x128 tiles in
    the kernel; the result is (out, x's codes (M, K), their scales (M, Kc)), or,
    ``keep_codes=False``, out alone (the codes and scales in VMEM only), or,
    ``col_codes`` ("nt", N in one column block), out and ``a``'s 128x1 tiles (along
    M): their codes (M, K) and scales (ceil(M/128), K).
    """
    if orient == "tn":
        k, m = a.shape
    else:
        m, k = a.shape
    n = b.shape[0] if orient == "nt" else b.shape[1]
    kc = cdiv(k, run)
    bm, bn = _blocks(m, n, block_m, block_n, orient, squares=quant is not None)
    j = _step_runs(kc, runs)
    resident = None
    if quant is None:
        resident = _resident_a_blocks(
            m, n, kc, bm, bn, orient, out_dtype, run, runs, requant=requant is not None
        )
    if resident is not None:
        (bm, bn), j = resident, kc
    elif quant is None and requant is None and _one_step(kc, runs, bm, bn, run):
        j = kc
    mp, np_, kcp = round_up(m, bm), round_up(n, bn), round_up(kc, j)
    kp, bk = kcp * run, j * run
    # A kernel that takes all of K in one step where it fits (_resident_a_blocks)
    # leaves A in HBM and copies each row block's into one VMEM buffer itself
    # (_copy_row_block), A padded to whole blocks (zero codes add nothing).  Every
    # other operand, and A otherwise, is taken in place (tpu_edges): the last
    # blocks run past its edges, and the output's part past them is not written
    # back.  Where a reduction crosses an edge the block is zeroed past it first:
    # B's and A's last K step, A before its quantization in the kernel (1x128
    # tiles along K; a requantized cache's 128-token tiles along K too), dy's
    # rows before its 128x1 tiles (``col_codes``).  Scales are small and padded
    # with ones (inert).
    fetch = resident is not None
    ma, ka = (mp, kp) if fetch else (m, k)
    a_p = _pad_to(a, (ka, ma) if orient == "tn" else (ma, ka), 0)
    k_valid = tpu_edges.valid_in_last(k, bk)
    a_edges = []
    if not fetch:
        a_edges.append((2, 0 if orient == "tn" else 1, k_valid))
        if col_codes:
            a_edges.append((0, 0, tpu_edges.valid_in_last(m, bm)))
    sb_p, sb_spec = _step_scales(_pad_to(sb_cols, (kcp, np_), 1.0), j, bn, lambda i, jn: jn)
    one_step = kcp == j and quant is None
    cost = cost_estimate(mp, np_, kp, bm, bn, out_dtype, run, resident_a=one_step)

    if orient == "tn":
        a_spec = pl.BlockSpec((bk, bm), lambda i, jn, kk: (kk, i))
    else:
        a_spec = pl.BlockSpec((bm, bk), lambda i, jn, kk: (i, kk))
    # The copy of a fetched A: the scratch's first two entries.
    a_copy = []
    if fetch:
        a_spec = pl.BlockSpec(memory_space=pl.ANY)
        a_copy = [pltpu.VMEM((bk, bm) if orient == "tn" else (bm, bk), a.dtype)]
        a_copy.append(pltpu.SemaphoreType.DMA)
    if orient == "nt":
        b_spec = pl.BlockSpec((bn, bk), lambda i, jn, kk: (jn, kk))
    else:
        b_spec = pl.BlockSpec((bk, bn), lambda i, jn, kk: (kk, jn))
    acc = [] if out_dtype == jnp.float32 else [pltpu.VMEM((bm, bn), jnp.float32)]
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype)]
    out_specs = [pl.BlockSpec((bm, bn), lambda i, jn, kk: (i, jn))]
    # The work of a quantization in the kernel per element (tpu_quantize.cost_estimate's),
    # redone for each column block, or once where the requantized A stays (one K step).
    a_work = 60 * kp * mp * (1 if one_step and requant is not None else np_ // bn)
    scratch = a_copy + acc
    if quant is not None:
        kernel = functools.partial(
            _quantizing_kernel, j=j, run=run, quant=dict(quant), orient=orient, cols=col_codes
        )
        a_in, a_args = [a_spec], [a_p]
        rows = _step_rows(j, kcp)
        n_m, n_n = mp // bm, np_ // bn
        fmt = dict(quant)["fmt"]
        # A read in its own dtype rather than one byte a code, once per column block.
        a_extra = mp * kp * (jnp.dtype(a.dtype).itemsize - 1) * n_n
        if keep_codes:
            # x's codes and transposed scales are outputs, in the blocks the plain
            # kernel reads them in, written by the first column block.  The later
            # column blocks quantize x again into the row block's last output
            # blocks, where the first left off: an output block is written back
            # when its index changes, so those stay as they are (the row block's
            # last step writes the same bits again), no block is visited again
            # once left, and the codes need no crop (a spare block per row block
            # did: an XLA copy of the codes, 50 MB at 4096^3).
            last = kcp // j - 1

            def codes_at(i, jn, kk):
                return i, jnp.where(jn == 0, kk, last)

            def scales_at(i, jn, kk):
                at = jnp.where(jn == 0, kk, last)
                # Steps whose j rows are padded to a tile: (steps, rows, M) (_step_scales).
                return (at, i) if rows == j else (at, 0, i)

            # The scales as the plain kernel reads them (_step_scales).
            st_shape = (kcp, mp) if rows == j else (kcp // j, rows, mp)
            out_shape += [
                jax.ShapeDtypeStruct((m, k), dict(quant)["fmt"]),
                jax.ShapeDtypeStruct(st_shape, jnp.float32),
            ]
            st_block = (j, bm) if rows == j else (None, rows, bm)
            out_specs += [pl.BlockSpec((bm, bk), codes_at), pl.BlockSpec(st_block, scales_at)]
            # Its codes and scales written once.
            written = mp * kp + 4 * kcp * mp
        else:
            # A's codes and scales for this step's dots only.
            scratch = [pltpu.VMEM((bm, bk), fmt), pltpu.VMEM((rows, bm), jnp.float32), *acc]
            written = 0
        if col_codes:
            if keep_codes or orient != "nt" or n_n > 1:
                raise ValueError("col_codes: the Dgrad kernel, N in one column block")
            # A's 128x1 tiles, written by the one column block: codes in the blocks
            # of A, and each row block's bm / 128 rows of scales padded to the
            # float32 sublane tile (a legal block for any bm), cropped below.
            col_rows = round_up(bm // _LANE, F32_SUBLANES)
            out_shape += [
                jax.ShapeDtypeStruct((m, k), fmt),
                jax.ShapeDtypeStruct((n_m, col_rows, kp), jnp.float32),
            ]
            out_specs += [
                pl.BlockSpec((bm, bk), lambda i, jn, kk: (i, kk)),
                pl.BlockSpec((None, col_rows, bk), lambda i, jn, kk: (i, 0, kk)),
            ]
            written += mp * kp + 4 * n_m * col_rows * kp
            a_work += 60 * kp * mp
        cost = pl.CostEstimate(
            flops=cost.flops + a_work,
            transcendentals=0,
            bytes_accessed=cost.bytes_accessed + a_extra + written,
        )
    elif requant is None:
        kernel = functools.partial(_dense_kernel, j=j, orient=orient, run=run)
        sa_p, sa_spec = _step_scales(_pad_to(sa_t, (kcp, mp), 1.0), j, bm, lambda i, jn: i)
        if fetch:
            kernel = functools.partial(_fetch_a_kernel, j=j, orient=orient, run=run)
        a_in, a_args = [a_spec, sa_spec], [a_p, sa_p]
    else:
        kernel = functools.partial(
            _requant_tn_kernel, j=j, run=run, requant=dict(requant), once=one_step, fetch=fetch
        )
        a_in, a_args = _requant_inputs(a_spec, a_p, sa_t, flag, kp, mp, bk, bm)
        # The block's new codes and scales, in VMEM only.
        codes = dict(requant)["fmt"]
        scratch = [pltpu.VMEM((bk, bm), codes), pltpu.VMEM((_step_rows(j, kcp), bm), jnp.float32)]
        scratch += a_copy + acc
        cost = pl.CostEstimate(
            flops=cost.flops + a_work, transcendentals=0, bytes_accessed=cost.bytes_accessed
        )
    suffix = "_quantizing" if quant else "_requant" if requant else ""
    # B zeroed past K in its last K step too (A's codes there are zero, padded or
    # zeroed): an FP8 code past K may be a NaN, and 0 x NaN is NaN.
    b_edge = (2, 1 if orient == "nt" else 0, k_valid)
    kernel = tpu_edges.zeroing(kernel, b_edge, at=len(a_in))
    outs = pl.pallas_call(
        tpu_edges.zeroing(kernel, *a_edges),
        out_shape=out_shape,
        grid=(mp // bm, np_ // bn, kcp // j),
        in_specs=[*a_in, b_spec, sb_spec],
        out_specs=out_specs,
        scratch_shapes=scratch,
        # A fetched (and requantized) once per row block: its column blocks in
        # order on one core.
        compiler_params=_compiler_params(
            interpret, parallel=1 if fetch or requant and one_step else None
        ),
        cost_estimate=cost,
        interpret=_interpret(interpret),
        name=f"fp8_block_scaled_matmul_{orient}{suffix}",
    )(*a_args, b, sb_p)
    if col_codes:
        scales = outs[2][:, : bm // _LANE].reshape(mp // _LANE, kp)
        return outs[0][:m, :n], outs[1][:m, :k], scales[: cdiv(m, _LANE), :k]
    if quant is None or not keep_codes:
        return outs[0][:m, :n]
    st = outs[2]
    if st.ndim == 3:
        # Each step's j rows of the tile-padded steps (_step_scales).
        st = st[:, :j].reshape(kcp, st.shape[2])
    return outs[0][:m, :n], outs[1][:m, :k], st[:kc, :m].T


def _requant_inputs(a_spec, a_p, scales, flag, kp: int, mp: int, bk: int, bm: int):
    """The requantizing "tn" kernel's A inputs: the cache's codes (``a_spec``), its tile
    scales for each block, and the subnormal flag.

    The scales (K, M/128) of each row block are laid out as the requantizing kernel
    reads them, (tiles, tokens): (M/bm, t8, K) with the block's t = bm/128 tiles
    padded to t8 (a multiple of the float32 sublane tile, 8) with unit scales.
    """
    tiles = bm // _LANE
    st = _pad_to(scales.astype(jnp.float32), (kp, mp // _LANE), 1.0)
    st = jnp.transpose(st.reshape(kp, mp // bm, tiles), (1, 2, 0))
    t8 = round_up(tiles, 8)
    st = _pad_to(st, (mp // bm, t8, kp), 1.0)
    flag = jnp.full((8, _LANE), flag, jnp.int32)
    specs = [
        a_spec,
        pl.BlockSpec((None, t8, bk), lambda i, jn, kk: (i, 0, kk)),
        pl.BlockSpec((8, _LANE), lambda i, jn, kk: (0, 0)),
    ]
    return specs, [a_p, st, flag]


def launch(fn: Callable, *args: jax.Array, interpret: bool | None, **kw) -> jax.Array:
    """``fn(*args, interpret=..., **kw)``; ``interpret=None``: compiled for a TPU lowering,
    TPU interpret mode on every other platform."""
    if interpret is not None:
        return fn(*args, interpret=bool(interpret), **kw)

    def build(compiled: bool):
        if compiled:
            # Mosaic lowers for TPU only: dead zeros in any other branch.
            compiled_fn = functools.partial(fn, interpret=False, **kw)
            return lambda: platforms.only_on(("tpu",), compiled_fn, *args)
        return lambda: fn(*args, interpret=True, **kw)

    return platforms.choose(lambda p: p == "tpu", build)


def _settings(**kw) -> tuple:
    """A quantizer's keywords as a static (hashable) argument of :func:`_dense`."""
    return tuple(sorted(kw.items()))


def _dense_kw(out_dtype, block_m, block_n, runs_per_step):
    _check_blocks(block_m, block_n, runs_per_step)
    return dict(
        out_dtype=jnp.dtype(out_dtype), block_m=block_m, block_n=block_n, runs=runs_per_step
    )


def block_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = DENSE_BLOCK_M,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
) -> jax.Array:
    """Fprop ("nn"): ``a`` (M, K) with ``a_scale`` (M, ceil(K/128)) x ``b`` (K, N) with
    ``b_scale`` (ceil(K/128), ceil(N/128)) -> (M, N) in ``out_dtype``.

    The operands of :func:`fp8jax.kernels.block_gemm.block_scaled_matmul`; the
    math of the module docstring.
    """
    m, k, n = check_operands(a_data, a_scale, b_data, b_scale, out_dtype, b_layout="kn")
    return launch(
        _dense,
        a_data,
        a_scale.T,
        b_data,
        expand_b_scale(b_scale, n),
        orient="nn",
        interpret=interpret,
        **_dense_kw(out_dtype, block_m, block_n, runs_per_step),
    )


def quantizing_reads_less(
    n: int, itemsize: int, block_n: int = DENSE_BLOCK_N, codes_only_here: bool = False
) -> bool:
    """Whether the kernel that quantizes its A moves no more bytes than a row quantizer
    followed by the plain kernel, for N = ``n`` output columns and A of ``itemsize``
    bytes.

    The first reads A once per column block.  The Fprop's second reads x once
    and its codes (a byte each) once per column block, and both write the codes
    (the Wgrad's cache).  Per element of A: ``itemsize * blocks`` against
    ``itemsize + blocks``: true up to two column blocks of bfloat16 x (4096^3),
    one of float32.  ``codes_only_here``: A is read in its own dtype by another
    kernel anyway and its 1x128 codes serve this GEMM only (dy, whose column
    quantizer feeds the Wgrad): the second then costs the codes' write and
    reads, ``1 + blocks``: true for one column block of bfloat16 dy.
    """
    blocks = cdiv(n, _fit(n, block_n, _LANE))
    return itemsize * blocks <= (1 if codes_only_here else itemsize) + blocks


def block_scaled_matmul_quantizing(
    x: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    out_dtype=jnp.bfloat16,
    block_m: int | None = None,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fprop ("nn") of an unquantized ``x`` (M, K), float32 or bfloat16, quantized in
    1x128 tiles inside the kernel: (out (M, N), x's codes (M, K), their float32 scales
    (M, ceil(K/128))).

    The codes and scales are ``tpu_quantize.quantize_2d(x, fmt=fmt, orient="row",
    ...)``'s and ``out`` is :func:`block_scaled_matmul` of them, the same bits: each
    grid step quantizes its (M-block, K-block) of x in VMEM (the quantizer's body)
    and writes the codes and scales as outputs, so x is read once for both (per
    column block: the N / block_n column blocks each quantize it again).
    ``block_m`` None: :data:`DENSE_BLOCK_M` rows for bfloat16 x, half as many
    for float32 (whose double-buffered block of x would overflow tpu7x's VMEM).
    """
    quant = _settings(fmt=jnp.dtype(fmt), pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0)
    blocks = (out_dtype, block_m, block_n, runs_per_step)
    return _launch_quantizing("x", x, b_data, b_scale, "nn", quant, blocks, interpret)


def _launch_quantizing(
    name: str, a, b_data, b_scale, orient: str, quant: tuple, blocks: tuple, interpret, cols=False
):
    """A quantizing kernel of ``orient`` ("nn": the Fprop, b (K, N) and its codes and
    scales kept; "nt": the Dgrad, b (N, K) and its codes in VMEM only, its 128x1 tiles
    written where ``cols``) on ``a`` (M, K), float32 or bfloat16, called ``name`` in
    errors.  ``blocks``: (out_dtype, block_m, block_n, runs_per_step), block_m None as
    :func:`block_scaled_matmul_quantizing` says."""
    if a.ndim != 2 or jnp.dtype(a.dtype) not in KERNEL_FLOATS:
        raise ValueError(f"{name} must be 2-D float32 or bfloat16, got {a.dtype} {a.shape}")
    out_dtype, block_m, block_n, runs_per_step = blocks
    m, k = a.shape
    codes = jax.ShapeDtypeStruct((m, k), dict(quant)["fmt"])
    scales = jax.ShapeDtypeStruct((m, cdiv(k, CHUNK)), jnp.float32)
    b_layout = "kn" if orient == "nn" else "nk"
    _, _, n = check_operands(codes, scales, b_data, b_scale, out_dtype, b_layout=b_layout)
    if block_m is None:
        block_m = DENSE_BLOCK_M * 2 // jnp.dtype(a.dtype).itemsize
    return launch(
        _dense,
        a,
        None,
        b_data,
        expand_b_scale(b_scale if orient == "nn" else b_scale.T, n),
        orient=orient,
        interpret=interpret,
        quant=quant,
        keep_codes=orient == "nn",
        col_codes=cols,
        **_dense_kw(out_dtype, block_m, block_n, runs_per_step),
    )


def block_scaled_matmul_nt(
    a_data: jax.Array,
    a_scale: jax.Array,
    bt_data: jax.Array,
    bt_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = DENSE_BLOCK_M,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
) -> jax.Array:
    """Dgrad ("nt"): ``out = a @ bt.T`` with ``bt`` (N, K), ``bt_scale`` (ceil(N/128),
    ceil(K/128)); in y = x W, ``dx = dy W^T`` is this call with ``bt = W`` as stored."""
    m, k, n = check_operands(a_data, a_scale, bt_data, bt_scale, out_dtype, b_layout="nk")
    return launch(
        _dense,
        a_data,
        a_scale.T,
        bt_data,
        expand_b_scale(bt_scale.T, n),
        orient="nt",
        interpret=interpret,
        **_dense_kw(out_dtype, block_m, block_n, runs_per_step),
    )


def block_scaled_matmul_nt_quantizing(
    a: jax.Array,
    bt_data: jax.Array,
    bt_scale: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    out_dtype=jnp.bfloat16,
    block_m: int | None = None,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
    col_codes: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array]:
    """Dgrad ("nt") of an unquantized ``a`` (M, K), float32 or bfloat16 (dy, K its
    contraction axis), quantized in 1x128 tiles inside the kernel, and ``bt`` (N, K)
    in 128x128 blocks as :func:`block_scaled_matmul_nt` takes it: ``out`` (M, N).

    The same bits as :func:`block_scaled_matmul_nt` of
    ``tpu_quantize.quantize_2d(a, fmt=fmt, orient="row", ...)``: each grid step
    quantizes its (M-block, K-block) of ``a`` in VMEM (the quantizer's body) and
    multiplies those codes; they are not written out, so ``a`` is read once per
    column block and its codes never reach HBM.  ``block_m`` None as in
    :func:`block_scaled_matmul_quantizing`.

    ``col_codes`` (N within one column block of ``block_n``): also ``a``'s 128x1
    tiles from the same read, (out, codes (M, K), scales (ceil(M/128), K)), the
    bits of ``quantize_2d(a, orient="col", ...)`` (dy's Wgrad operand).
    """
    quant = _settings(fmt=jnp.dtype(fmt), pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0)
    blocks = (out_dtype, block_m, block_n, runs_per_step)
    return _launch_quantizing(
        "a", a, bt_data, bt_scale, "nt", quant, blocks, interpret, cols=col_codes
    )


def block_scaled_matmul_tn(
    at_data: jax.Array,
    at_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = DENSE_BLOCK_M,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
) -> jax.Array:
    """Wgrad ("tn", 128x1 tiles on both sides): ``out = at.T @ b``.

    ``at`` (K, M) with ``at_scale`` (ceil(K/128), M), ``b`` (K, N) with
    ``b_scale`` (ceil(K/128), N); K (the tokens in Wgrad) is contracted.
    """
    check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype)
    return launch(
        _dense,
        at_data,
        at_scale,
        b_data,
        b_scale,
        orient="tn",
        interpret=interpret,
        **_dense_kw(out_dtype, block_m, block_n, runs_per_step),
    )


def block_scaled_matmul_tn_requant(
    cache_data: jax.Array,
    cache_scale: jax.Array,
    subnormal: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    out_dtype=jnp.bfloat16,
    block_m: int | None = None,
    block_n: int = DENSE_BLOCK_N,
    runs_per_step: int = RUNS_PER_STEP,
    interpret: bool | None = None,
) -> jax.Array:
    """Wgrad ("tn") whose A is the FP8 cache of the forward pass, requantized in the kernel.

    ``cache_data`` (K, M) FP8 codes in 1x128 tiles along M (the activations as
    cached, K the tokens), ``cache_scale`` float32 (K, ceil(M/128)),
    ``subnormal`` whether any scale of the whole cache is subnormal
    (``tpu_quantize.subnormal_scales``).  The result is
    ``block_scaled_matmul_tn(*tpu_quantize.requantize_col(cache_data, cache_scale,
    subnormal, fmt=fmt, ...), b_data, b_scale)``, the same bits: each grid step
    dequantizes its (K-block, M-block) of the cache to float32 in VMEM and
    quantizes it again in 128-token tiles there (the requantizing kernel's
    body), so the new codes never reach HBM.  The work is redone for each of
    the N / block_n column blocks.  ``block_m`` None: :data:`DENSE_BLOCK_M` rows
    for a bfloat16 result, half as many for float32 (whose double-buffered output
    block, beside the block's new codes, would overflow tpu7x's VMEM).
    """
    if cache_data.ndim != 2 or jnp.dtype(cache_data.dtype) not in IEEE_FP8:
        raise ValueError(
            f"cache_data must be 2-D FP8 codes, got {cache_data.dtype} {cache_data.shape}"
        )
    k, m = cache_data.shape
    if cache_scale.shape != (k, cdiv(m, CHUNK)):
        raise ValueError(
            f"cache_scale must have shape (K, ceil(M/128)) = {(k, cdiv(m, CHUNK))}, "
            f"got {cache_scale.shape}"
        )
    # The requantized operand's shapes, checked as block_scaled_matmul_tn's.
    fmt = jnp.dtype(fmt)
    requantized = jax.ShapeDtypeStruct((k, m), fmt)
    check_tn_operands(
        requantized,
        jax.ShapeDtypeStruct((cdiv(k, CHUNK), m), jnp.float32),
        b_data,
        b_scale,
        out_dtype,
    )
    if block_m is None:
        block_m = DENSE_BLOCK_M * 2 // jnp.dtype(out_dtype).itemsize
    return launch(
        _dense,
        cache_data,
        cache_scale.astype(jnp.float32),
        b_data,
        b_scale,
        jnp.asarray(subnormal, bool),
        orient="tn",
        interpret=interpret,
        requant=_settings(
            fmt_in=jnp.dtype(cache_data.dtype),
            fmt=fmt,
            pow2=pow2,
            amax_floor=amax_floor,
            ue8m0=ue8m0,
        ),
        **_dense_kw(out_dtype, block_m, block_n, runs_per_step),
    )


# ----------------------------------------------------------------------------
# grouped (MoE experts) on the expert-aligned tile layout
# ----------------------------------------------------------------------------


def _grouped_kernel(
    group_ref, src_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, acc_ref, *, j: int, orient: str
):
    del src_ref  # the blocks' indices
    t, k = pl.program_id(1), pl.program_id(2)
    expert = group_ref[t]

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(expert >= 0)
    def _compute():
        _accumulate(a_ref, sa_ref, b_ref, sb_ref, acc_ref, j=j, orient=orient, run=CHUNK)

    @pl.when(k == pl.num_programs(2) - 1)
    def _write():
        # One rounding to the output dtype; a padding tile writes zeros.
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _grouped_blocks(n: int, kc: int, block_n: int, runs: int | None) -> tuple[int, int]:
    """(bn, j) of the grouped kernel: its column block and the runs per K step.

    ``runs`` None: all of K in one step where an expert's (K, bn) weight
    block, double-buffered, fits :data:`GROUPED_WEIGHT_VMEM` (bn narrowed to
    fit, 128 at least) and :func:`_accumulate` loops over K's runs in groups
    (their number at most, or a multiple of, :data:`RUNS_PER_STEP`; others
    would be unrolled whole), else steps of :data:`RUNS_PER_STEP`; an int:
    steps of that many runs (all of K where it has no more).
    """
    if runs is None:
        cap = GROUPED_WEIGHT_VMEM // (2 * kc * CHUNK) // _LANE * _LANE
        if cap >= _LANE and (kc <= RUNS_PER_STEP or kc % RUNS_PER_STEP == 0):
            return _fit(n, min(block_n, cap), _LANE), kc
        runs = RUNS_PER_STEP
    # A step of j runs: its (j, tile) scale block needs j % 8 == 0 or j == all runs.
    return _fit(n, block_n, _LANE), kc if kc <= runs else runs


@functools.partial(jax.jit, static_argnames=("orient", "out_dtype", "block_n", "runs", "interpret"))
def _grouped(a, sa_t, b, sb_cols, tile_group, *, orient, out_dtype, block_n, runs, interpret):
    """``a`` (Mp, K) aligned rows, ``sa_t`` (Kc, Mp), ``b`` (E, K, N) ("nn") or (E, N, K)
    ("nt"), ``sb_cols`` (E, Kc, N), ``tile_group`` (Mp / tile,)."""
    mp, k = a.shape
    num_groups = b.shape[0]
    n = b.shape[1] if orient == "nt" else b.shape[2]
    num_tiles = tile_group.shape[0]
    tile = mp // num_tiles
    kc = cdiv(k, CHUNK)
    bn, j = _grouped_blocks(n, kc, block_n, runs)
    np_, kcp = round_up(n, bn), round_up(kc, j)
    kp, bk = kcp * CHUNK, j * CHUNK
    last_step = kcp // j - 1

    a_p = _pad_to(a, (mp, kp), 0)
    b_p = _pad_to(b, (num_groups, np_, kp) if orient == "nt" else (num_groups, kp, np_), 0)
    sa_p = _pad_to(sa_t, (kcp, mp), 1.0)
    sb_p = _pad_to(sb_cols, (num_groups, kcp, np_), 1.0)

    # Column blocks outermost, the tiles within them: with all of K in one step
    # the weight block's index, (expert, column block), stays put across an
    # expert's consecutive tiles, so the pipeline fetches each expert's weight
    # once per column block, not once per tile (A, whose block index changes
    # with every tile, is read once per column block either way).  A padding
    # tile (expert -1) reads what the last tile with an expert before it read
    # at its last step, so its blocks' indices stay put: no DMA.
    tile_group = tile_group.astype(jnp.int32)
    live = jnp.where(tile_group >= 0, jnp.arange(num_tiles, dtype=jnp.int32), -1)
    last_live = jnp.maximum(lax.cummax(live, axis=0), 0)

    def blocks(t, kk, g, src):
        s = src[t]
        return s, jnp.where(g[t] >= 0, kk, last_step), jnp.maximum(g[s], 0)

    def a_map(jn, t, kk, g, src):
        s, kk, _ = blocks(t, kk, g, src)
        return s, kk

    def sa_map(jn, t, kk, g, src):
        s, kk, _ = blocks(t, kk, g, src)
        return kk, s

    def b_map(jn, t, kk, g, src):
        _, kk, e = blocks(t, kk, g, src)
        return (e, jn, kk) if orient == "nt" else (e, kk, jn)

    def sb_map(jn, t, kk, g, src):
        _, kk, e = blocks(t, kk, g, src)
        return e, kk, jn

    b_block = (None, bn, bk) if orient == "nt" else (None, bk, bn)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(np_ // bn, num_tiles, kcp // j),
        in_specs=[
            pl.BlockSpec((tile, bk), a_map),
            pl.BlockSpec((j, tile), sa_map),
            pl.BlockSpec(b_block, b_map),
            pl.BlockSpec((None, j, bn), sb_map),
        ],
        out_specs=pl.BlockSpec((tile, bn), lambda jn, t, kk, g, src: (t, jn)),
        scratch_shapes=[pltpu.VMEM((tile, bn), jnp.float32)],
    )
    # An expert's weight once per run of its tiles with one K step (at most
    # one run per expert, tiles ascending), else once per tile.
    passes = min(num_tiles, num_groups) if j == kcp else num_tiles
    cost = cost_estimate(mp, np_, kp, tile, bn, out_dtype, b_passes=passes)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, j=j, orient=orient),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(interpret, vmem_limit=GROUPED_VMEM_LIMIT),
        cost_estimate=cost,
        interpret=_interpret(interpret),
        name=f"fp8_grouped_block_scaled_matmul_{orient}",
    )(tile_group, last_live, a_p, sa_p, b_p, sb_p)
    return out[:, :n]


def grouped_block_scaled_matmul_aligned(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    tile_group: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    b_layout: str = "kn",
    block_n: int = BLOCK_N,
    runs_per_step: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped GEMM on expert-aligned rows (the layout of ``fp8jax.groups.group_layout``).

    ``a_data`` (Mp, K) FP8 rows sorted by expert in tiles of ``tile = Mp /
    len(tile_group)`` rows (a multiple of 32; 128 in the GEMM core),
    ``a_scale`` (Mp, ceil(K/128)); ``tile_group`` int (Mp / tile,): the expert
    of each tile, -1 for padding (zeros out, no matrix-unit work; empty
    groups own no tile).  ``b_layout`` "kn": ``b_data`` (E, K, N),
    ``b_scale`` (E, Kc, Nc) (fprop); "nk": (E, N, K), (E, Nc, Kc) (dgrad, the
    weights as stored).  Rows of tile t: ``out = a @ b[tile_group[t]]`` with
    the module docstring's math.  ``runs_per_step`` None: all of K in one
    step where an expert's weight block for it fits VMEM, so that each
    expert's weight is read once per column block rather than once per tile
    (:func:`_grouped_blocks`); the same runs in the same order either way.
    """
    mp, _, n = check_operands(
        a_data, a_scale, b_data, b_scale, out_dtype, b_layout=b_layout, b_batch=True
    )
    if tile_group.ndim != 1 or tile_group.shape[0] == 0 or mp % tile_group.shape[0]:
        raise ValueError(
            f"tile_group must be 1-d with a length dividing M={mp}, got shape {tile_group.shape}"
        )
    tile = mp // tile_group.shape[0]
    if tile % _SUBLANE_FP8 or (tile != mp and tile % _LANE):
        raise ValueError(f"tiles of {tile} rows: a multiple of 128 needed (or all rows)")
    _check_blocks(_LANE, block_n, RUNS_PER_STEP if runs_per_step is None else runs_per_step)
    kn_scale = b_scale if b_layout == "kn" else jnp.swapaxes(b_scale, 1, 2)
    return launch(
        _grouped,
        a_data,
        a_scale.T,
        b_data,
        expand_b_scale(kn_scale, n),
        tile_group,
        orient="nn" if b_layout == "kn" else "nt",
        interpret=interpret,
        out_dtype=jnp.dtype(out_dtype),
        block_n=block_n,
        runs=runs_per_step,
    )


# --------------------------------------------------------------------------
# Grouped Wgrad: dw[e] = sum over the token tiles of expert e
# --------------------------------------------------------------------------


def _grouped_wgrad_kernel(
    tile_ref, group_ref, eff_ref, first_ref, last_ref, a_ref, sa_ref, b_ref, sb_ref, o_ref, acc_ref
):
    del tile_ref, eff_ref  # the blocks' indices
    s = pl.program_id(2)

    @pl.when(first_ref[s] != 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(group_ref[s] >= 0)
    def _compute():
        # One tile is one 128-token run: its float32 partial times
        # fl32(a_scale * b_scale), added to the expert's accumulator.
        _accumulate(a_ref, sa_ref, b_ref, sb_ref, acc_ref, j=1, orient="tn", run=CHUNK)

    @pl.when(last_ref[s] != 0)
    def _write():
        # One rounding of the expert's float32 accumulator to the output dtype.
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _wgrad_steps(tile_group: jax.Array, num_groups: int):
    """The grouped Wgrad's steps: one opening step per expert, then its tiles.

    Returns (tile, group, expert, first, last), each (T + E,): the tile whose
    blocks a step reads, the expert it adds into (-1: nothing to add), the
    expert whose output block it holds, and whether it opens (zeroes the
    accumulator) or closes (writes it) that expert's run of steps.  Every
    expert has a run, so an expert with no tile writes zeros; padding tiles
    close the last expert's run.
    """
    t = tile_group.shape[0]
    group = tile_group.astype(jnp.int32)
    keys = jnp.concatenate(
        [jnp.where(group >= 0, 2 * group + 1, 2 * num_groups), 2 * jnp.arange(num_groups)]
    )
    order = jnp.argsort(keys, stable=True)
    opening = order >= t
    tile = jnp.where(opening, t, order)
    # An opening step reads the blocks of the tile after it (no extra DMA).
    tile = jnp.minimum(lax.cummin(tile, axis=0, reverse=True), t - 1)
    step_group = jnp.where(opening, -1, group[jnp.minimum(order, t - 1)])
    expert = jnp.where(
        opening, order - t, jnp.where(step_group >= 0, step_group, num_groups - 1)
    ).astype(jnp.int32)
    change = (expert[1:] != expert[:-1]).astype(jnp.int32)
    one = jnp.ones((1,), jnp.int32)
    first = jnp.concatenate([one, change])
    last = jnp.concatenate([change, one])
    return tile.astype(jnp.int32), step_group, expert, first, last


@functools.partial(
    jax.jit, static_argnames=("num_groups", "out_dtype", "block_m", "block_n", "interpret")
)
def _grouped_wgrad(a, sa, b, sb, tile_group, *, num_groups, out_dtype, block_m, block_n, interpret):
    """``a`` (T, 128, M), ``sa`` (T, 1, M), ``b`` (T, 128, N), ``sb`` (T, 1, N)."""
    num_tiles, _, m = a.shape
    n = b.shape[2]
    bm, bn = _fit(m, block_m, _LANE), _fit(n, block_n, _LANE)
    mp, np_ = round_up(m, bm), round_up(n, bn)
    a_p = _pad_to(a, (num_tiles, CHUNK, mp), 0)
    b_p = _pad_to(b, (num_tiles, CHUNK, np_), 0)
    sa_p = _pad_to(sa, (num_tiles, 1, mp), 1.0)
    sb_p = _pad_to(sb, (num_tiles, 1, np_), 1.0)
    steps = _wgrad_steps(tile_group, num_groups)

    def a_map(i, j, s, tile, *_):
        return tile[s], 0, i

    def b_map(i, j, s, tile, *_):
        return tile[s], 0, j

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(mp // bm, np_ // bn, num_tiles + num_groups),
        in_specs=[
            pl.BlockSpec((None, CHUNK, bm), a_map),
            pl.BlockSpec((None, 1, bm), a_map),
            pl.BlockSpec((None, CHUNK, bn), b_map),
            pl.BlockSpec((None, 1, bn), b_map),
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s, tile, g, e, *_: (e[s], i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
    )
    # A re-read once per column block, B once per row block, the output written once.
    cost = pl.CostEstimate(
        flops=2 * num_tiles * CHUNK * mp * np_,
        transcendentals=0,
        bytes_accessed=(num_tiles * (CHUNK + 4) * mp) * (np_ // bn)
        + (num_tiles * (CHUNK + 4) * np_) * (mp // bm)
        + num_groups * mp * np_ * jnp.dtype(out_dtype).itemsize,
    )
    out = pl.pallas_call(
        _grouped_wgrad_kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, mp, np_), out_dtype),
        grid_spec=grid_spec,
        compiler_params=_compiler_params(interpret, vmem_limit=GROUPED_VMEM_LIMIT),
        cost_estimate=cost,
        interpret=_interpret(interpret),
        name="fp8_grouped_block_scaled_matmul_wgrad",
    )(*steps, a_p, sa_p, b_p, sb_p)
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
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    interpret: bool | None = None,
) -> jax.Array:
    """The experts' Wgrad over expert-aligned token tiles, (E, M, N) in ``out_dtype``.

    ``a_data`` (T, 128, M) and ``b_data`` (T, 128, N): the FP8 codes of x and
    dy in 128-token tiles (``fp8jax.groups.group_layout``'s), their scales
    ``a_scale`` (T, 1, M) and ``b_scale`` (T, 1, N) (one per tile and
    column); ``tile_group`` (T,) the expert of each tile (ascending), -1 for
    padding.  ``out[e] = sum_{t: tile_group[t] == e} (a[t]^T b[t]) * a_scale[t]^T
    * b_scale[t]``: each tile's float32 partial times fl32(a_scale * b_scale)
    added in tile order to a float32 accumulator in VMEM (each tile is one
    128-long K run of DeepSeek-V3's promotion); an expert with no tile gets
    zeros (each expert's run of grid steps opens with a step that only zeroes
    the accumulator).  No (T, M, N) intermediate reaches HBM.
    """
    check_token_tiles(a_data, a_scale, b_data, b_scale, tile_group, out_dtype)
    _check_blocks(block_m, block_n, RUNS_PER_STEP)
    return launch(
        _grouped_wgrad,
        a_data,
        a_scale.astype(jnp.float32),
        b_data,
        b_scale.astype(jnp.float32),
        tile_group,
        interpret=interpret,
        num_groups=num_groups,
        out_dtype=jnp.dtype(out_dtype),
        block_m=block_m,
        block_n=block_n,
    )
