"""Block-scaled FP8 GEMM (DeepSeek-V3 / DeepGEMM scaling) as a Mosaic GPU kernel for Hopper.

One kernel body serves the dense GEMMs (a batch of independent products),
the grouped MoE GEMM (row tiles that each pick their expert's weight) and
the grouped Wgrad (each expert's sum over its own K runs).  Both
operands are **K-major** (the contraction axis is the minor one), the only
layout Hopper's FP8 ``wgmma`` reads on jax 0.11 ("Only f16 WGMMA supports
transposes"), which is DeepGEMM's NT-only constraint::

    a   float8 (B, Mp, Kp)   a_scale_t float32 (B, Kc, Mp)     one scale per 1x128 tile
    b   float8 (E, Np, Kp)   b_scale   float32 (E, Kc, Nc)     one per 128x128 block
                             or        float32 (E, Nc, Kc)     the same, "b_scale_nk"
                             or        float32 (E, Kc, Np)     one per 128x1 tile ("columns")

    out[m, n] = sum_c ( sum_{k in c} a[m, k] * b[n, k] ) * a_scale_t[c, m] * s_b(c, n)

with ``s_b(c, n) = b_scale[c, n // 128]`` (blocks), ``b_scale[n // 128, c]``
(blocks, ``b_scale_nk``: Dgrad's weight scales as stored, no transpose) or
``b_scale[c, n]`` (columns).  Mp, Np and Kp are multiples of 128 (the callers
pad: zero codes add nothing, unit scales keep padding inert), or, for the
dense kernel, dimensions :func:`edge_dim` leaves as they are (TMA reads an
edge tile's missing rows and K columns as zeros and drops the output's rows
and columns past the edge: the same products, no padded copy); Kc =
ceil(Kp / 128).
E4M3 and E5M2 operands may be mixed (FP8 ``wgmma`` takes its two types
separately).

Design (read from JAX's ``hopper_matmul_mgpu`` and DeepGEMM's description):

* One CTA computes a 128x128 output tile: two consumer warpgroups of 64 rows
  each and one producer warpgroup that issues the TMA loads
  (``emit_pipeline_warp_specialized``), ``STAGES`` K steps of 128 in flight in
  shared memory (128-byte swizzle, the FP8 rows being 128 bytes).
* Per K step of 128 (= one scale run), each consumer warpgroup runs four
  ``wgmma m64n128k32`` FP8 instructions into a *fresh* FP32 accumulator,
  waits for them, and promotes in registers:
  ``acc += partial * (a_scale[rows, c] * s_b(c, cols))`` (one FFMA per
  element).  The tensor core's limited-precision accumulation therefore
  never spans more than 128 products (DeepSeek-V3's N_C = 128), and the
  main accumulator never leaves the registers (64 + 64 FP32 registers per
  thread for the partial and the main accumulator).
* The epilogue rounds the FP32 accumulator once to the output dtype
  (bfloat16 or float32), stages it in shared memory and stores it with TMA.
* Grouped: the CTA reads its row tile's expert id; a tile tagged -1 is
  padding and is written as zeros without loading or multiplying anything.
* Grouped Wgrad: the CTA reads its expert's first K run and run count and
  pipelines over those runs only (a pipeline length read at run time); an
  expert with no run is written as zeros.

Numerics: FP8 products are exact; the 128 products of a run are summed by
the tensor core (on Hopper with its own ~14-bit-mantissa accumulation; in
interpret mode exactly in FP32); the run's FP32 partial times the FP32
product of the two scales is added with one FFMA; one rounding to the output
dtype at the end.  Power-of-two and UE8M0 scales arrive as float32 values.

``interpret``: ``False`` compiles the kernel (a ``mosaic_gpu`` custom call,
lowered only for CUDA), an ``InterpretGPUParams`` runs Mosaic GPU's
interpreter (shared memory, barriers, TMA and warpgroups simulated, races
detected on request) on any platform.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp8jax.kernels.mgpu_ptxas import ask_ptxas_once

#: K run = scale tile = promotion interval; also the K step of the pipeline.
CHUNK = 128
#: Output tile of one CTA: two consumer warpgroups of 64 rows, 128 columns.
BLOCK_M = 128
BLOCK_N = 128
_WG_ROWS = 64
_CONSUMERS = BLOCK_M // _WG_ROWS
#: K steps in flight in shared memory (33 KiB each).
STAGES = 4
#: The name of the grouped Wgrad kernel (:func:`grouped_wgrad_nt`) in its op's metadata.
K_GROUPED_NAME = "fp8_k_grouped_gemm"
# Registers kept by the producer warpgroup (it only issues TMA copies).
_PRODUCER_REGISTERS = 40


def interpret_params(detect_races: bool = False) -> plgpu.InterpretGPUParams:
    """Mosaic GPU interpret mode on any platform (races raise when ``detect_races``)."""
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def _swizzled(k: int):
    """The shared-memory tiles of the FP8 operands for a contraction of ``k``."""
    # FP8 rows of 128 elements are 128 bytes: the 128-byte swizzle wgmma reads
    # without bank conflicts.  A K that ends inside a run (a multiple of 32,
    # taken in place: edge_dim) needs tiles that do not split its last run:
    # 32-byte ones, 32 FP8 columns each, which wgmma reads as well.
    swizzle = plgpu.find_swizzle(CHUNK * 8) if k % CHUNK == 0 else IN_PLACE
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def _body(
    *refs,
    kc: int,
    b_cols: bool,
    b_scale_nk: bool,
    grouped: bool,
    stages: int,
    out_dtype,
    k_groups: bool = False,
):
    """One CTA: the 128x128 output tile (m, n) of batch b, of row tile m's expert, or
    (``k_groups``) of expert b's sum over its own K steps.

    Refs (global memory): [tile_group,] or [k_start, k_count,] a, a_scale_t, b,
    b_scale, out, as in :func:`matmul_nt` / :func:`grouped_matmul_nt` /
    :func:`grouped_wgrad_nt`.
    """
    i, j = lax.axis_index("m"), lax.axis_index("n")
    # The operands' batch, the output's, the K steps run and (k_groups) the
    # expert's first K run.
    first = None
    if grouped:
        gid_g, a_g, sa_g, b_g, sb_g, o_g = refs
        ab, e = 0, gid_g[i]
        ob, runs = ab, kc
    elif k_groups:
        start_g, count_g, a_g, sa_g, b_g, sb_g, o_g = refs
        ob = lax.axis_index("b")
        ab, e = 0, 0
        first, runs = start_g[ob], count_g[ob]
    else:
        a_g, sa_g, b_g, sb_g, o_g = refs
        ab = lax.axis_index("b")
        e, ob, runs = ab, ab, kc
    wg = lax.axis_index("wg")
    rows = pl.ds(wg * _WG_ROWS, _WG_ROWS)

    def run_of(c):
        """The operands' K run of pipeline step ``c``."""
        return c if first is None else first + c

    # Padding tiles of the grouped layout (expert -1) read expert 0's refs but
    # never run the pipeline.
    b_ref = b_g.at[jnp.maximum(e, 0)]
    sb_ref = sb_g.at[jnp.maximum(e, 0)]

    def step(idx, a_s, b_s, sa_s, *rest):
        (c,) = idx
        *sb_s, acc = rest
        # The scales first: B's block scale is a load from global memory whose
        # latency then overlaps the tensor-core work below.
        if b_cols:
            scale = sa_s[rows][:, None] * sb_s[0][...][None, :]
        else:
            sb = sb_ref[j, run_of(c)] if b_scale_nk else sb_ref[run_of(c), j]
            scale = (sa_s[rows] * sb)[:, None]

        def mma(partial_ref):
            # b_s holds (BLOCK_N, 128) K-major rows; wgmma reads it as (128, BLOCK_N).
            plgpu.wgmma(partial_ref, a_s.at[rows], b_s.transpose((1, 0)))
            return partial_ref[...]

        # A fresh FP32 accumulator per 128-long run: the promotion interval.
        partial = pl.run_scoped(mma, plgpu.ACC((_WG_ROWS, BLOCK_N), jnp.float32))
        return acc + partial * scale

    tiles = _swizzled(a_g.shape[-1])
    in_specs = [
        plgpu.BlockSpec((BLOCK_M, CHUNK), lambda c: (i, run_of(c)), transforms=tiles),
        plgpu.BlockSpec((BLOCK_N, CHUNK), lambda c: (j, run_of(c)), transforms=tiles),
        plgpu.BlockSpec((None, BLOCK_M), lambda c: (run_of(c), i)),
    ]
    if b_cols:
        in_specs.append(plgpu.BlockSpec((None, BLOCK_N), lambda c: (run_of(c), j)))
    operands = (a_g.at[ab], b_ref, sa_g.at[ab]) + ((sb_ref,) if b_cols else ())

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(runs,),
            memory_registers=_PRODUCER_REGISTERS,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=_CONSUMERS,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def ignore(*_, **__):
        return None

    def store(o_s, value):
        o_s[wg] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_s.at[wg],
            o_g.at[ob, pl.ds(i * BLOCK_M + wg * _WG_ROWS, _WG_ROWS), pl.ds(j * BLOCK_N, BLOCK_N)],
        )
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*operands),
        o_s=plgpu.SMEM((_CONSUMERS, _WG_ROWS, BLOCK_N), out_dtype, **_out_tile(o_g)),
        collective_axes="wg",
    )
    def _scope(allocs, o_s):
        def context(run):
            acc = run(jnp.zeros((_WG_ROWS, BLOCK_N), jnp.float32))
            # One rounding of the FP32 accumulator to the output dtype.
            store(o_s, acc.astype(out_dtype))

        def compute():
            pipeline(step, context)(*operands, allocations=allocs)

        if not (grouped or k_groups):
            compute()
            return
        # A padding row tile (expert -1), or an expert that owns no K step:
        # zeros, nothing loaded or multiplied.
        empty = e < 0 if grouped else runs == 0
        pl.when(~empty)(compute)

        @pl.when(empty & (wg < _CONSUMERS))
        def _empty():
            store(o_s, jnp.zeros((_WG_ROWS, BLOCK_N), out_dtype))


def _call(out_shape, grid, names, interpret, *, kp: int, stages: int, **layout):
    """The kernel of :func:`_body` for ``out_shape``, K ``kp`` (a last run may end
    inside its 128: :func:`edge_dim`) and B's ``layout`` (``b_cols``,
    ``b_scale_nk``, ``grouped``, ``k_groups``)."""
    ask_ptxas_once()
    body = functools.partial(
        _body, kc=pl.cdiv(kp, CHUNK), stages=stages, out_dtype=out_shape.dtype, **layout
    )
    return plgpu.kernel(
        body,
        out_type=out_shape,
        grid=grid,
        grid_names=names,
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )


def _batch_call(batch: int, a, b, out_dtype, interpret, stages: int, **layout):
    """The kernel on grid (M tiles, N tiles, ``batch``) writing (batch, Mp, Np) for
    K-major ``a`` (., Mp, Kp) and ``b`` (., Np, Kp): the dense kernel's batch, or the
    grouped Wgrad's experts (``layout`` as in :func:`_call`)."""
    _, mp, kp = a.shape
    np_ = b.shape[1]
    out = jax.ShapeDtypeStruct((batch, mp, np_), out_dtype)
    grid = (pl.cdiv(mp, BLOCK_M), pl.cdiv(np_, BLOCK_N), batch)
    return _call(
        out, grid, ("m", "n", "b"), interpret, kp=kp, stages=stages, grouped=False, **layout
    )


def b_scale_shape(batch: int, n: int, kc: int, *, b_cols: bool, b_scale_nk: bool) -> tuple:
    """The shape of B's scales for ``n`` rows of B (padded or not) and ``kc`` K runs:
    (batch, kc, n) with ``b_cols``, (batch, N blocks, kc) with ``b_scale_nk``, else
    (batch, kc, N blocks)."""
    if b_cols and b_scale_nk:
        raise ValueError("b_cols and b_scale_nk are two layouts of B's scales: pick one")
    if b_cols:
        return batch, kc, n
    blocks = pl.cdiv(n, BLOCK_N)
    return (batch, blocks, kc) if b_scale_nk else (batch, kc, blocks)


def edge_dim(d: int) -> int:
    """A dimension ``d`` as a kernel is given it: as it is where its TMA copies take
    the edge tile in place, at least one tile (128) and a multiple of
    :data:`IN_PLACE`, else zero-padded to a multiple of 128.

    TMA reads the elements of a tile past an array's edge as zeros (codes that
    add nothing, scales that multiply only those zeros) and drops the writes
    past it, so an edge tile computes what a padded one does, without a padded
    copy of the operand or a crop of the result.  The multiple is what the
    copies along ``d`` need: whole 16-byte row strides and whole swizzled
    shared-memory tiles (Mosaic GPU refuses a copy whose global shape splits
    one).
    """
    return d if d >= CHUNK and d % IN_PLACE == 0 else pl.cdiv(d, CHUNK) * CHUNK


#: The multiple of a dimension the dense kernel takes in place (:func:`edge_dim`):
#: the float32 scales along M and N are copied as swizzled 128-byte tiles of
#: 32, the output's columns are staged in tiles of 32 (:func:`_out_tile`), and
#: a K that ends inside a run is read in 32-byte tiles (:func:`_swizzled`).
IN_PLACE = 32


def _out_tile(o_g) -> dict:
    """The output staging buffer's shared-memory tiling: Mosaic GPU's own choice (a
    128-byte swizzle: 64 bfloat16 or 32 float32 columns per tile) where the
    output's columns are a whole number of such tiles, else tiles of 32 columns
    (a 64-byte swizzle for bfloat16), so that a TMA store can take an edge tile
    of any multiple of 32 columns in place."""
    itemsize = jnp.dtype(o_g.dtype).itemsize
    if o_g.shape[-1] % (128 // itemsize) == 0:
        return {}
    return {
        "transforms": (
            plgpu.TilingTransform((8, IN_PLACE)),
            plgpu.SwizzleTransform(IN_PLACE * itemsize),
        )
    }


def check_padded(a, b, a_scale_t, b_scale, *, b_cols: bool, b_scale_nk: bool = False) -> None:
    """The kernel's shape contract (see the module docstring)."""
    for name, x in (("a", a), ("b", b)):
        if x.ndim != 3 or any(edge_dim(d) != d for d in x.shape[1:]):
            raise ValueError(
                f"{name} must be (batch, rows, K), each of rows and K a multiple of 128 or"
                f" of {IN_PLACE} and at least 128, got {x.shape}"
            )
    if a.shape[2] != b.shape[2]:
        raise ValueError(f"contraction mismatch: a {a.shape}, b {b.shape}")
    kc = pl.cdiv(a.shape[2], CHUNK)
    if a_scale_t.shape != (a.shape[0], kc, a.shape[1]):
        raise ValueError(f"a_scale_t must be {(a.shape[0], kc, a.shape[1])}, got {a_scale_t.shape}")
    want = b_scale_shape(b.shape[0], b.shape[1], kc, b_cols=b_cols, b_scale_nk=b_scale_nk)
    if b_scale.shape != want:
        raise ValueError(f"b_scale must be {want}, got {b_scale.shape}")


# A jit per kernel: two calls of one shape and settings share one trace, so the
# program lowers and compiles the kernel once (a new trace is a new kernel).
_STATIC = ("out_dtype", "interpret", "stages")


@functools.partial(jax.jit, static_argnames=("b_cols", "b_scale_nk") + _STATIC)
def matmul_nt(
    a: jax.Array,
    a_scale_t: jax.Array,
    b: jax.Array,
    b_scale: jax.Array,
    *,
    b_cols: bool,
    out_dtype,
    b_scale_nk: bool = False,
    interpret: plgpu.InterpretGPUParams | bool = False,
    stages: int = STAGES,
) -> jax.Array:
    """Batched dense kernel: ``out[i] = A[i] @ B[i]^T`` with block scales, (B, Mp, Np).

    ``a`` (B, Mp, Kp), ``a_scale_t`` (B, Kc, Mp), ``b`` (B, Np, Kp), ``b_scale``
    (B, Kc, ceil(Np / 128)) block scales ((B, ceil(Np / 128), Kc) with
    ``b_scale_nk``) or, with ``b_cols``, (B, Kc, Np) per-row scales of ``b``
    (module docstring); Mp and Np multiples of 128 or as :func:`edge_dim` leaves
    them.
    """
    check_padded(a, b, a_scale_t, b_scale, b_cols=b_cols, b_scale_nk=b_scale_nk)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"batch mismatch: a {a.shape}, b {b.shape}")
    call = _batch_call(
        a.shape[0], a, b, out_dtype, interpret, stages, b_cols=b_cols, b_scale_nk=b_scale_nk
    )
    return call(a, a_scale_t, b, b_scale)


@functools.partial(jax.jit, static_argnames=("b_scale_nk",) + _STATIC)
def grouped_matmul_nt(
    tile_group: jax.Array,
    a: jax.Array,
    a_scale_t: jax.Array,
    b: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype,
    b_scale_nk: bool = False,
    interpret: plgpu.InterpretGPUParams | bool = False,
    stages: int = STAGES,
) -> jax.Array:
    """Grouped kernel: row tile t of ``a`` times its expert's ``b[tile_group[t]]^T``, (Mp, Np).

    ``a`` (Mp, Kp), ``a_scale_t`` (Kc, Mp), ``b`` (E, Np, Kp), ``b_scale``
    (E, Kc, Np // 128) ((E, Np // 128, Kc) with ``b_scale_nk``), ``tile_group``
    int32 (Mp // 128,): expert of each 128-row tile, -1 for padding (written as
    zeros, nothing loaded).
    """
    check_padded(a[None], b, a_scale_t[None], b_scale, b_cols=False, b_scale_nk=b_scale_nk)
    mp, kp = a.shape
    np_ = b.shape[1]
    if tile_group.shape != (mp // BLOCK_M,):
        raise ValueError(f"tile_group must have shape ({mp // BLOCK_M},), got {tile_group.shape}")
    out = jax.ShapeDtypeStruct((1, mp, np_), out_dtype)
    grid = (mp // BLOCK_M, np_ // BLOCK_N)
    call = _call(
        out,
        grid,
        ("m", "n"),
        interpret,
        kp=kp,
        stages=stages,
        b_cols=False,
        b_scale_nk=b_scale_nk,
        grouped=True,
    )
    return call(tile_group.astype(jnp.int32), a[None], a_scale_t[None], b, b_scale)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_wgrad_nt(
    k_start: jax.Array,
    k_count: jax.Array,
    a: jax.Array,
    a_scale_t: jax.Array,
    b: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype,
    interpret: plgpu.InterpretGPUParams | bool = False,
    stages: int = STAGES,
) -> jax.Array:
    """Grouped Wgrad kernel: each expert's sum over its own K runs, (E, Mp, Np).

    ``out[e] = sum_{c in [k_start[e], k_start[e] + k_count[e])} (A_c B_c^T) *
    a_scale_t[c, m] * b_scale[c, n]`` with ``a`` (1, Mp, Kp) and ``b`` (1, Np,
    Kp) K-major (Wgrad's x^T and dy^T, K the tokens), ``a_scale_t`` (1, Kc, Mp)
    and ``b_scale`` (1, Kc, Np) one scale per K run and row (128-token tiles,
    ``b_cols``), ``k_start`` / ``k_count`` int32 (E,) each expert's K runs (its
    token tiles, consecutive).  Each run's FP32 partial is promoted into the
    expert's register accumulator as in :func:`matmul_nt`; an expert with no
    run gets zeros.  No per-run product reaches global memory.
    """
    check_padded(a, b, a_scale_t, b_scale, b_cols=True)
    if a.shape[0] != 1 or b.shape[0] != 1:
        raise ValueError(f"grouped_wgrad_nt takes one A and one B, got {a.shape} and {b.shape}")
    num_groups = k_start.shape[0]
    if k_start.ndim != 1 or k_count.shape != k_start.shape:
        raise ValueError(
            f"k_start and k_count must be two (E,) vectors, got {k_start.shape}, {k_count.shape}"
        )
    call = _batch_call(
        num_groups, a, b, out_dtype, interpret, stages, b_cols=True, b_scale_nk=False, k_groups=True
    )
    # The name in the op's metadata: the compilers' census counts one
    # contraction's FLOPs for it (the groups split K), not one per group.
    with jax.named_scope(K_GROUPED_NAME):
        return call(k_start.astype(jnp.int32), k_count.astype(jnp.int32), a, a_scale_t, b, b_scale)
