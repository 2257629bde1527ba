"""FP8 quantizers as Mosaic GPU kernels for Hopper: one read of x, every layout written once.

The entry points and outputs are :mod:`fp8jax.kernels.gpu_quantize`'s (and
so :mod:`fp8jax.kernels.tpu_quantize`'s), the same bits:

* :func:`quantize_2d`: 1x128 tiles, 128x1 tiles or 128x128 blocks;
* :func:`quantize_block_both`: 128x128 blocks, the codes written in both
  layouts (a weight's, for the Fprop and the Dgrad);
* :func:`quantize_rows_cols`: an output gradient's two tile layouts from one
  read, Wgrad's 128x1 tiles written token-major (its GEMM reads them K-major);
* :func:`requantize_col_t`: Wgrad's cached x, from its FP8 codes, into
  K-major 128-token tiles.

One CTA (one warpgroup) per 128 x 128 square of x: a TMA copy brings the
square into shared memory, the warpgroup takes it into registers (wgmma's
fragment layout) :data:`ROWS` rows by :data:`COLS` columns at a time, in
loops that hold one copy of the code: each tile's amax chunk by chunk, then
its codes; TMA copies write the codes (as int8 bytes) and the float32 scales
(a 128x128 block's one scale the warpgroup stores itself).  A
square is every tile of its rows and columns, so one read of x serves both
of dy's layouts.

Transposed outputs are read transposed out of shared memory: Mosaic GPU
loads 16-bit data through a transposed view, so bfloat16 x is read as it
is, float32 x as two 16-bit halves of its bit patterns, and FP8 codes as
int16 bytes; every route moves bits, not values, so nothing is rounded.

The numerics are ``quant.quantize``'s on a CPU, operation for operation
(:func:`fp8jax.kernels.tpu_quantize._codes` and ``_scale``: amax on the
float32 bit patterns over the finite elements, the scale guards, the offset
division that flush-to-zero cannot change, saturation), with the cast of
:func:`fp8jax.kernels.gpu_codes.cast_with_specials` (finite lanes cast,
+-Inf and NaN given their codes by their bits) and FP8 codes read back by
:func:`~fp8jax.kernels.gpu_codes.code_values` (a NaN's sign from its byte).
Compiled, the divisions are PTX ``div.rn.f32`` (:func:`divide_rn`; Mosaic
GPU's own ``/`` is ``div.full.f32``) and the requantizer's dequantization
the IEEE product ``mul.rn.f32`` (:func:`dequantized`); the interpreter,
which runs on XLA, divides as XLA does and dequantizes on the bit patterns.

``interpret``: ``False`` compiles the kernels (``mosaic_gpu`` custom calls,
lowered only for CUDA); ``True`` or an ``InterpretGPUParams`` runs Mosaic
GPU's interpreter (shared memory, barriers and TMA simulated) on any
platform: the tests, on CPU.

Speed: priced by the deviceless census at bytes / HBM bandwidth (XLA gives a
custom kernel no estimate); not yet timed on a GPU.  The ``quantizers`` step
of :mod:`fp8jax.bench.gpu_check` times them next to XLA's fusions, and on an
attached GPU "auto" takes them only where they are no slower than those
(``fp8jax.quant.gpu_kernels``).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from fp8jax import scaling
from fp8jax.inline_ops import isfinite
from fp8jax.kernels.block_gemm import _pad_to, cdiv
from fp8jax.kernels.gpu_codes import cast_with_specials, code_values
from fp8jax.kernels.mgpu_block_gemm import edge_dim
from fp8jax.kernels.mgpu_ptxas import ask_ptxas_once
from fp8jax.kernels.tpu_quantize import GROUP, ORIENTS, _codes, _scale, check_2d, crop

__all__ = [
    "ORIENTS",
    "quantize_2d",
    "quantize_block_both",
    "quantize_rows_cols",
    "requantize_col_t",
]

_STATIC = ("fmt", "pow2", "amax_floor", "ue8m0", "interpret")


def _square(ref, i, j):
    """The 128 x 128 square (i, j) of a 2-D global-memory ref."""
    return ref.at[pl.ds(i * GROUP, GROUP), pl.ds(j * GROUP, GROUP)]


#: Rows of a square held in registers at once: wgmma's fragment layout puts a
#: warpgroup's 128 threads on 64 rows (a whole square's values, 128 per thread
#: in float32, spilled to local memory).
ROWS = 64


def _half(h):
    """The rows of half ``h`` (a loop index) of a square."""
    return pl.ds(pl.multiple_of(h * ROWS, ROWS), ROWS)


def _each_half(fn) -> None:
    """``fn(rows)`` for each half of a square, as a loop: one copy of its code.

    Unrolled, the two halves' code (every register's instructions, twice)
    made most of what the kernels cost to lower and compile.
    """

    @pl.loop(0, GROUP // ROWS)
    def _(h):
        fn(_half(h))


#: Columns of a half square computed at once: the per-element code (the
#: division, its guards, the cast) is most of a kernel's instructions, and on
#: a 64 x 32 chunk it is a quarter of the half's (16 values per thread).  Not
#: ROWS: a reduced vector's length tells a row's from a column's (_layout).
COLS = 32


def _chunk(c):
    """The columns of chunk ``c`` (a loop index) of a square."""
    return pl.ds(pl.multiple_of(c * COLS, COLS), COLS)


def _each_chunk(fn) -> None:
    """``fn(cols)`` for each chunk of a square's columns, as a loop: one copy of its code."""

    @pl.loop(0, GROUP // COLS)
    def _(c):
        fn(_chunk(c))


def _each_piece(fn) -> None:
    """``fn(rows, cols)`` for each chunk of each half of a square, as one loop."""
    chunks = GROUP // COLS

    @pl.loop(0, GROUP // ROWS * chunks)
    def _(k):
        fn(_half(k // chunks), _chunk(k % chunks))


def _max_bits(load, n: int, axis: int, init: jax.Array) -> jax.Array:
    """The max of ``init`` and the magnitude bits of ``load(k)`` (k < n, a loop) reduced
    along ``axis``: the finite amax's bit patterns, one chunk at a time."""

    @pl.loop(0, n, init_carry=init)
    def bits(k, acc):
        return jnp.maximum(acc, jnp.max(scaling.finite_magnitude_bits(load(k)), axis=axis))

    return bits


def _scale_of(bits: jax.Array, kw: dict) -> jax.Array:
    """The float32 scales of tiles whose finite amax has the magnitude bits ``bits``."""
    return _scale(scaling.magnitude_bits_value(bits, jnp.float32), **kw)


def _layout(shape: tuple[int, ...]):
    """The register layout of the kernels' arrays of ``shape``: wgmma's fragments for a
    chunk of a half square, and the vectors its reductions leave (per row: 64; per
    column: 32)."""
    if len(shape) == 2:
        return plgpu.Layout.WGMMA
    return plgpu.Layout.WGMMA.reduce(1 if shape == (ROWS,) else 0)


def _ptx(instr: str, a: jax.Array, b) -> jax.Array:
    """The float32 PTX instruction ``instr`` (two operands) on each register of ``a``
    and ``b`` (broadcast together); a constant ``b`` is splat inside, in ``a``'s layout."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    layout = _layout(shape)
    op = mgpu.FragmentedArray._lift_fast_instr(instr)
    out = plgpu.ShapeDtypeStruct(shape, jnp.float32, layout=layout)
    a = jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape)
    if isinstance(b, (float, np.floating)):
        value = float(b)

        @plgpu.inline_mgpu(arg_types=(layout,), return_type=out)
        def by_constant(_, x):
            y = mgpu.FragmentedArray.splat(mgpu.c(value, x.mlir_dtype), x.shape, x.layout)
            return x._pointwise(op, y)

        return by_constant(a)

    @plgpu.inline_mgpu(arg_types=(layout, layout), return_type=out)
    def binary(_, x, y):
        return x._pointwise(op, y)

    return binary(a, jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape))


def divide_rn(num: jax.Array, den) -> jax.Array:
    """float32 ``num / den`` correctly rounded, as PTX ``div.rn.f32``, subnormals kept.

    Mosaic GPU lowers a float32 ``/`` to ``div.full.f32`` (up to 2 ulp off);
    the quantizer's divisions (the scale, x / scale) must be the IEEE ones
    for the CPU's bits.  Inline PTX on each register of the arrays.
    """
    return _ptx("div.rn.f32", num, den)


def multiply_rn(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 ``a * b`` correctly rounded, subnormals kept: PTX ``mul.rn.f32`` (no
    ``.ftz``; the explicit rounding also keeps ptxas from fusing it into an FMA)."""
    return _ptx("mul.rn.f32", a, b)


def dequantized(d: jax.Array, s: jax.Array, fmt, interpret) -> jax.Array:
    """FP8 values ``d`` (float32) times their scales ``s``: quant.dequantize's value, the
    correctly rounded product with subnormals kept; +-Inf and NaN codes as they are.

    Compiled: the IEEE product (:func:`multiply_rn`; the scales are positive
    and finite).  Interpreted: the product on the bit patterns
    (``scaling.exact_product``), since the interpreter's CPU flushes subnormals.
    """
    if interpret:
        return scaling.exact_product(d, s, fmt)
    # Inf * s and NaN * s would lose a NaN's sign: the codes' own values there.
    return jnp.where(isfinite(d), multiply_rn(d, s), d)


def _load(ref, rows, cols=slice(None), transposed: bool = False) -> jax.Array:
    """``rows`` x ``cols`` of a 128 x 128 shared-memory square (of its transpose where
    ``transposed``) in registers, wgmma's fragment layout."""
    if transposed:
        return plgpu.load(ref.at[cols, rows].transpose((1, 0)), layout=plgpu.Layout.WGMMA)
    return plgpu.load(ref.at[rows, cols], layout=plgpu.Layout.WGMMA)


def _f32(ref, rows, cols=slice(None), transposed: bool = False) -> jax.Array:
    # float32: bfloat16 values are exact in it, and the amax of the float32
    # bit patterns is the amax of the values.
    return _load(ref, rows, cols, transposed).astype(jnp.float32)


def _split_f32(x_s, halves) -> None:
    """A float32 square's bit patterns as two int16 squares (high and low halves),
    so that they can be read transposed: Mosaic GPU reads only 16-bit data
    through a transposed view."""
    hi_s, lo_s = halves

    def piece(rows, cols):
        bits = lax.bitcast_convert_type(_load(x_s, rows, cols), jnp.int32)
        hi_s[rows, cols] = (bits >> 16).astype(jnp.int16)
        lo_s[rows, cols] = bits.astype(jnp.int16)

    _each_piece(piece)
    # Other threads' halves are read next: a warpgroup barrier (with the fence).
    plgpu.commit_smem()


def _joined_f32(halves, rows, cols) -> jax.Array:
    """``rows`` x ``cols`` of the transposed square :func:`_split_f32` stored: the same bits."""
    hi_s, lo_s = halves
    hi = _load(hi_s, rows, cols, transposed=True).astype(jnp.int32)
    lo = _load(lo_s, rows, cols, transposed=True).astype(jnp.int32) & 0xFFFF
    return lax.bitcast_convert_type((hi << 16) | lo, jnp.float32)


def _row_tiles(load, rows, q_s, s_s, kw: dict) -> None:
    """The 1x128 tiles of a half square's ``rows``: int8 codes into ``q_s[rows]``,
    float32 scales into ``s_s[rows]``; ``load(rows, cols)`` gives the float32 values.

    Each row's amax over the chunks first (a loop), then each chunk's codes.
    """
    bits = _max_bits(
        lambda c: load(rows, _chunk(c)), GROUP // COLS, 1, jnp.zeros((ROWS,), jnp.int32)
    )
    scale = _scale_of(bits, kw)

    def chunk(cols):
        xs = load(rows, cols)
        s = lax.broadcast_in_dim(scale, xs.shape, (0,))
        q_s[rows, cols] = _codes(xs, s, kw["fmt"], cast_with_specials)

    _each_chunk(chunk)
    s_s[rows] = scale


def _columns(x_s, q_s, s_s, kw: dict, block: bool, transposed=None) -> None:
    """A square's 128x1 tiles (or, where ``block``, the square as one block): int8 codes
    into ``q_s``, float32 scales into ``s_s``: a column's each, or (``block``) the
    block's, written to global memory at the square's place in the grid.

    Each column's amax over both halves first (on the bit patterns, one axis
    at a time: Mosaic GPU reduces one axis per step), then each half's codes,
    a chunk of columns at a time.

    ``transposed``: (an int16 scratch square, the codes' transposed square):
    the codes are also kept as int16 and read back transposed into the second
    (Mosaic GPU reads only 16-bit data through a transposed view): the same
    bytes, moved.
    """
    zeros = jnp.zeros((COLS,), jnp.int32)

    def column_bits(cols, acc):
        return _max_bits(lambda h: _f32(x_s, _half(h), cols), GROUP // ROWS, 0, acc)

    if block:

        @pl.loop(0, GROUP // COLS, init_carry=zeros)
        def bits(c, acc):
            return column_bits(_chunk(c), acc)

        # The block's amax in every lane, as the max of each lane's and the
        # block's: no broadcast of a scalar, which XLA (the interpreter's
        # compiler) would divide by its reciprocal, 1 ulp off the correctly
        # rounded quotient.
        block_scale = _scale_of(jnp.maximum(bits, jnp.max(bits, axis=0)), kw)
        # One float32 per block, stored by the warpgroup itself (TMA moves 16
        # bytes at least): the (R/128, C/128) scales the GEMMs read, no copy
        # spread over the block's columns for XLA to slice.  Every lane holds
        # the same value, so their max is it.
        s_s[lax.axis_index("i"), lax.axis_index("j")] = jnp.max(block_scale, axis=0)

    def chunk(cols):
        scale = block_scale if block else _scale_of(column_bits(cols, zeros), kw)

        def half(rows):
            xs = _f32(x_s, rows, cols)
            s = lax.broadcast_in_dim(scale, xs.shape, (1,))
            codes = _codes(xs, s, kw["fmt"], cast_with_specials)
            q_s[rows, cols] = codes
            if transposed is not None:
                transposed[0][rows, cols] = codes.astype(jnp.int16)

        _each_half(half)
        if not block:
            s_s[cols] = scale

    _each_chunk(chunk)
    if transposed is not None:
        bytes_s, qt_s = transposed
        # Other threads' codes are read next: a warpgroup barrier (with the fence).
        plgpu.commit_smem()

        def piece(rows, cols):
            # int16 -> int8 keeps the low byte: the code, sign-extended before.
            qt_s[rows, cols] = _load(bytes_s, rows, cols, transposed=True).astype(jnp.int8)

        _each_piece(piece)


def _kernel(body, ins, scratch, outs, grid, name: str, interpret):
    """A Mosaic GPU kernel of one warpgroup per grid point (i, j).

    ``ins`` and ``outs``: ``(array or ShapeDtypeStruct, smem shape, where)``,
    ``where(ref, i, j)`` the global window the CTA copies into its shared
    buffer first (ins) or from it last (outs); an output of smem shape None
    has no shared buffer: the body gets its global ref and writes it itself.
    ``scratch``: further ``(shape, dtype)`` shared buffers.  ``body(*in_smem,
    *scratch_smem, *outs)`` fills the outputs.
    """
    n_in, n_scratch = len(ins), len(scratch)
    ask_ptxas_once()

    def kern(*refs):
        in_g, out_g = refs[:n_in], refs[n_in:]
        i, j = lax.axis_index("i"), lax.axis_index("j")

        def scope(*smem):
            *buffers, barrier = smem
            for (_, _, where), g, s in zip(ins, in_g, buffers[:n_in], strict=True):
                plgpu.copy_gmem_to_smem(where(g, i, j), s, barrier)
            plgpu.barrier_wait(barrier)
            staged = iter(buffers[n_in + n_scratch :])
            out_refs = [
                g if shape is None else next(staged) for (_, shape, _), g in zip(outs, out_g)
            ]
            buffers = buffers[: n_in + n_scratch] + out_refs
            if interpret:
                # The interpreter runs on XLA, whose division is already the IEEE one.
                body(*buffers)
            else:
                # The subnormal scale's quotient, corrected by its remainder, may be
                # the approximate one (inline PTX does not lower on its vectors).
                with scaling.ieee_division(
                    divide_rn, corrected=operator.truediv, keeps_subnormals=True
                ):
                    body(*buffers)
            # The registers' stores to shared memory, visible to TMA.
            plgpu.commit_smem()
            for (_, shape, where), g, s in zip(outs, out_g, out_refs, strict=True):
                if shape is not None:
                    plgpu.copy_smem_to_gmem(s, where(g, i, j))
            plgpu.wait_smem_to_gmem(0)

        buffers = [plgpu.SMEM(shape, a.dtype) for a, shape, _ in ins]
        buffers += [plgpu.SMEM(shape, dtype) for shape, dtype in scratch]
        buffers += [plgpu.SMEM(shape, t.dtype) for t, shape, _ in outs if shape is not None]
        buffers.append(plgpu.Barrier(num_arrivals=n_in))
        pl.run_scoped(scope, *buffers)

    kern.__name__ = kern.__qualname__ = name
    call = plgpu.kernel(
        kern,
        out_type=tuple(t for t, _, _ in outs),
        grid=grid,
        grid_names=("i", "j"),
        # True: Mosaic GPU's own interpreter (TMA and barriers simulated).
        interpret=plgpu.InterpretGPUParams() if interpret is True else interpret or None,
    )
    # The name in the op's metadata also where vmap renames the kernel: the
    # compilers' census tells quantizers from GEMMs by it.
    with jax.named_scope(name):
        return call(*(a for a, _, _ in ins))


def _square_in(xp: jax.Array):
    """An input whose square (i, j) each CTA reads."""
    return xp, (GROUP, GROUP), _square


def _padded(x: jax.Array) -> jax.Array:
    """``x`` as the kernel reads it: each dimension as it is where TMA takes its edge
    squares in place (``mgpu_block_gemm.edge_dim``, a multiple of 32: the int8
    codes' rows and, transposed, their columns are then 16-byte multiples, and
    the float32 scales along either dimension whole 128-byte tiles of 32), else
    zero-padded to whole squares (a zero changes no amax; the pad is cropped)."""
    r, c = x.shape
    return _pad_to(x, (edge_dim(r), edge_dim(c)), 0)


def _grid(xp: jax.Array) -> tuple[int, int]:
    return cdiv(xp.shape[0], GROUP), cdiv(xp.shape[1], GROUP)


def _codes_out(rows: int, cols: int, transposed: bool = False):
    """The int8 codes (rows, cols), each CTA writing its square ((j, i) if ``transposed``)."""

    def where(g, i, j):
        return _square(g, j, i) if transposed else _square(g, i, j)

    return jax.ShapeDtypeStruct((rows, cols), jnp.int8), (GROUP, GROUP), where


def _scales_out(rows: int, cols: int, by_j: bool):
    """Float32 scales (rows, cols), each CTA writing 128 of them contiguous: row j, columns
    of square i (``by_j``), or row i, columns of square j."""

    def where(g, i, j):
        return g.at[j, pl.ds(i * GROUP, GROUP)] if by_j else g.at[i, pl.ds(j * GROUP, GROUP)]

    return jax.ShapeDtypeStruct((rows, cols), jnp.float32), (GROUP,), where


def _settings(fmt, pow2, amax_floor, ue8m0) -> dict:
    return dict(fmt=jnp.dtype(fmt), pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0)


@functools.partial(jax.jit, static_argnames=("orient",) + _STATIC)
def quantize_2d(
    x: jax.Array,
    *,
    fmt,
    orient: str,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """(codes, float32 scales) of a 2-D ``x``: ``tpu_quantize.quantize_2d``'s outputs for
    ``orient`` "row" (1x128 tiles), "col" (128x1) or "block" (128x128), the same bits."""
    check_2d(x, orient)
    kw = _settings(fmt, pow2, amax_floor, ue8m0)
    r, c = x.shape
    xp = _padded(x)
    rp, cp = xp.shape
    gi, gj = _grid(xp)

    def body(x_s, q_s, s_s):
        if orient == "row":
            _each_half(lambda rows: _row_tiles(functools.partial(_f32, x_s), rows, q_s, s_s, kw))
        else:
            _columns(x_s, q_s, s_s, kw, block=orient == "block")

    # 1x128 tiles' scales are written transposed, (C/128, R): 128 contiguous
    # per square (the form the GEMM kernel reads); 128x1 tiles' (R/128, C);
    # a block's one per square, (R/128, C/128), stored by the body itself.
    if orient == "row":
        scales = _scales_out(gj, rp, by_j=True)
    elif orient == "col":
        scales = _scales_out(gi, cp, by_j=False)
    else:
        scales = jax.ShapeDtypeStruct((gi, gj), jnp.float32), None, None
    codes, s = _kernel(
        body,
        [_square_in(xp)],
        [],
        [_codes_out(rp, cp), scales],
        (gi, gj),
        f"fp8_quantize_{orient}",
        interpret,
    )
    codes = lax.bitcast_convert_type(codes, kw["fmt"])
    if orient == "block":
        return codes[:r, :c], s[: cdiv(r, GROUP), : cdiv(c, GROUP)]
    return crop(orient, codes, s.T if orient == "row" else s, r, c)


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_block_both(
    x: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(codes, codes transposed, float32 block scales (ceil(R/128), ceil(C/128))) of a
    2-D ``x`` in 128x128 blocks from one read: :func:`quantize_2d`'s "block" outputs,
    the same bits, and the codes' transpose beside them.

    A weight's two layouts for Hopper's FP8 ``wgmma``, which reads both
    operands K-major: the Fprop reads W^T (N, K), the Dgrad W (K, N) as it
    is.  Writing both from the kernel costs one write of the codes; the
    transpose it saves (an XLA pass over the codes) costs a read and a write.
    """
    if x.ndim != 2:
        raise ValueError(f"quantize_block_both takes a 2-D array, got shape {x.shape}")
    kw = _settings(fmt, pow2, amax_floor, ue8m0)
    r, c = x.shape
    xp = _padded(x)
    rp, cp = xp.shape
    gi, gj = _grid(xp)

    def body(x_s, bytes_s, q_s, qt_s, s_g):
        _columns(x_s, q_s, s_g, kw, block=True, transposed=(bytes_s, qt_s))

    codes, codes_t, s = _kernel(
        body,
        [_square_in(xp)],
        [((GROUP, GROUP), jnp.int16)],
        [
            _codes_out(rp, cp),
            _codes_out(cp, rp, transposed=True),
            (jax.ShapeDtypeStruct((gi, gj), jnp.float32), None, None),
        ],
        (gi, gj),
        "fp8_quantize_block_both",
        interpret,
    )
    fmt = kw["fmt"]
    return (
        lax.bitcast_convert_type(codes[:r, :c], fmt),
        lax.bitcast_convert_type(codes_t[:c, :r], fmt),
        s[: cdiv(r, GROUP), : cdiv(c, GROUP)],
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_rows_cols(
    x: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(row codes, row scales (R, ceil(C/128)), col codes, col scales (ceil(R/128), C))
    of a 2-D ``x`` from one read: ``tpu_quantize.quantize_rows_cols``'s outputs, the
    same bits; the 128x1 tiles' codes are written transposed ((C, R), K-major for
    Wgrad) and returned as their transpose."""
    if x.ndim != 2:
        raise ValueError(f"quantize_rows_cols takes a 2-D array, got shape {x.shape}")
    kw = _settings(fmt, pow2, amax_floor, ue8m0)
    r, c = x.shape
    xp = _padded(x)
    rp, cp = xp.shape
    gi, gj = _grid(xp)
    wide = jnp.dtype(x.dtype).itemsize == 4
    scratch = [((GROUP, GROUP), jnp.int16)] * 2 if wide else []

    def body(x_s, *rest):
        halves, (qr_s, sr_s, qc_s, sc_s) = rest[: len(scratch)], rest[len(scratch) :]

        _each_half(lambda rows: _row_tiles(functools.partial(_f32, x_s), rows, qr_s, sr_s, kw))
        # The 128x1 tiles are the rows of the transposed square.
        if wide:
            _split_f32(x_s, halves)

        def transposed(rows, cols):
            if wide:
                return _joined_f32(halves, rows, cols)
            return _f32(x_s, rows, cols, transposed=True)

        _each_half(lambda rows: _row_tiles(transposed, rows, qc_s, sc_s, kw))

    outs = [
        _codes_out(rp, cp),
        _scales_out(gj, rp, by_j=True),
        _codes_out(cp, rp, transposed=True),
        _scales_out(gi, cp, by_j=False),
    ]
    row_codes, row_s, col_codes_t, col_s = _kernel(
        body, [_square_in(xp)], scratch, outs, (gi, gj), "fp8_quantize_rows_cols", interpret
    )
    fmt = kw["fmt"]
    return (
        lax.bitcast_convert_type(row_codes[:r, :c], fmt),
        row_s.T[:r, : cdiv(c, GROUP)],
        lax.bitcast_convert_type(col_codes_t[:c, :r], fmt).T,
        col_s[: cdiv(r, GROUP), :c],
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def requantize_col_t(
    codes: jax.Array,
    row_scales: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret=False,
) -> tuple[jax.Array, jax.Array]:
    """FP8 ``codes`` (R, C) in 1x128 tiles (float32 ``row_scales`` (R, ceil(C/128)))
    dequantized and quantized again in 128x1 tiles, written transposed: (codes (C, R),
    float32 scales (C, ceil(R/128))), ``gpu_quantize.requantize_col_t``'s outputs."""
    if codes.ndim != 2:
        raise ValueError(f"requantize_col_t takes a 2-D array, got shape {codes.shape}")
    kw = _settings(fmt, pow2, amax_floor, ue8m0)
    fmt_in = jnp.dtype(codes.dtype)
    r, c = codes.shape
    # Zero codes with unit scales pad: zeros change no amax; the pad is cropped.
    dp = _padded(lax.bitcast_convert_type(codes, jnp.int8))
    rp, cp = dp.shape
    gi, gj = _grid(dp)
    # The scales transposed, (C/128, R): each square's 128 contiguous, copied
    # in with its codes (past R's edge TMA reads zeros, which scale only the
    # zero codes there).
    st = _pad_to(row_scales.astype(jnp.float32).T, (gj, rp), 1.0)

    def body(d_s, st_s, bytes_s, q_s, s_s):
        # The square's codes as int16 bytes, read back transposed (K x tokens).
        def piece(rows, cols):
            bytes_s[rows, cols] = _load(d_s, rows, cols).astype(jnp.int16)

        _each_piece(piece)
        plgpu.commit_smem()

        def values(rows, cols):
            d = code_values(_load(bytes_s, rows, cols, transposed=True), fmt_in)
            # The square's tokens' scales, along the transposed square's columns.
            s = lax.broadcast_in_dim(st_s[cols], d.shape, (1,))
            return dequantized(d, s, fmt_in, interpret)

        _each_half(lambda rows: _row_tiles(values, rows, q_s, s_s, kw))

    def scale_window(g, i, j):
        return g.at[j, pl.ds(i * GROUP, GROUP)]

    out_codes, scales = _kernel(
        body,
        [_square_in(dp), (st, (GROUP,), scale_window)],
        [((GROUP, GROUP), jnp.int16)],
        [_codes_out(cp, rp, transposed=True), _scales_out(gi, cp, by_j=False)],
        (gi, gj),
        "fp8_requantize_col_t",
        interpret,
    )
    return (
        lax.bitcast_convert_type(out_codes[:c, :r], kw["fmt"]),
        scales.T[:c, : cdiv(r, GROUP)],
    )
