"""FP8 quantizers as Pallas Triton kernels on an NVIDIA GPU (compute capability >= 9.0).

The TPU quantizers' bodies (:mod:`fp8jax.kernels.tpu_quantize`), one program
per 128 x 128 square:

* :func:`quantize_2d`: 1x128 tiles, 128x1 tiles or 128x128 blocks;
* :func:`quantize_rows_cols`: an output gradient's two layouts from one
  read, Wgrad's 128x1 tiles written token-major;
* :func:`requantize_col_t`: Wgrad's cached x, from its FP8 codes, into
  K-major 128-token tiles.

The numerics are ``quant.quantize``'s on a CPU, operation for operation
(amax on the float32 bit patterns over the finite elements, the scale
guards, the offset division that flush-to-zero cannot change, saturation,
the cast), with three rules where Triton differs from XLA: the divisions are
``div.rn.f32`` (:func:`divide_rn`), only finite lanes are cast and +-Inf /
NaN get their codes by their bits (:func:`cast_with_specials`), and codes
travel as int8.

Why kernels: XLA's GPU compiler quantizes in several passes per operand (an
amax reduction, quantizing transposes, the Inf/NaN masks between them); on
an H200 at 4096^3 the 19 such fusions of deepseek_v3's fwd+bwd took 258 us,
dy's alone about 74 us.  A kernel reads its operand once and writes each
layout's codes and scales once.  These are not fast yet: on the same H200,
at Triton's default of 4 warps, the requantizer took 1.7-3.1 ms and the
two-layout quantizer 0.5-1.7 ms per 4096-row operand; at the warps they now
default to (:data:`NUM_WARPS`), each still takes longer than XLA's fusions
for its outputs (the ``quantizers`` step of :mod:`fp8jax.bench.gpu_check`).

"auto" takes them only where ``FP8JAX_GPU_QUANTIZER=triton`` asks for them
(:func:`kernels`; by default it takes the Mosaic GPU kernels of
:mod:`fp8jax.kernels.mgpu_quantize`, which share this module's cast and its
bit check), and then, where an NVIDIA GPU is attached, only once they have
given the CPU's bits on a test array (:func:`check_error`, asked once);
without one, only for a named CUDA target.
``interpret=True`` runs them in Pallas' interpreter (the tests, on CPU).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from fp8jax import platforms, scaling
from fp8jax.kernels.block_gemm import _pad_to, cdiv, round_up
from fp8jax.kernels.gpu_codes import cast_with_specials, code_values
from fp8jax.kernels.tpu_quantize import (
    GROUP,
    ORIENTS,
    _codes,
    _scale,
    block_kernel,
    check_2d,
    col_kernel,
    crop,
    on_platform,
    row_kernel,
    rows_cols_kernel,
)

#: The oldest CUDA target the kernel is taken for (FP8 conversions in Triton need
#: 8.9; 9.0 is what the GPU check has run it on).
CUDA_TARGET = "9.0"

#: Warps per program. A program holds a 128 x 128 square of float32 and its
#: integer bit patterns: at Triton's default of 4 warps that is 128 values per
#: thread per array, past the registers. On an H200 (4096 x 4096 bfloat16 x,
#: the GPU check's ``quantizers`` step) 16 warps were the fastest of 4, 8 and
#: 16 for the quantizers (1x128 tiles 73 -> 45 us, both layouts 948 -> 146 us)
#: and 8 for the requantizer (1757 -> 119 us; 132 at 16).
NUM_WARPS = 16
REQUANTIZE_WARPS = 8


def _requantize_t_kernel(d_ref, s_ref, qt_ref, st_ref, *, fmt_in, fmt, pow2, amax_floor, ue8m0):
    # One 128 x 128 square of the cache: 128 tokens x one 1x128 tile along K,
    # its codes as int8 bytes (see cast_with_specials).
    d = code_values(d_ref[...], fmt_in)
    s = jnp.broadcast_to(s_ref[...], d.shape)
    # quant.dequantize's value, on the bit patterns: the correctly rounded
    # product with subnormals kept whatever the kernel's flush-to-zero mode.
    x = jnp.transpose(scaling.exact_product(d, s, fmt_in))
    # Now K x tokens: each row is one 128-token tile of Wgrad's operand.
    scale = _scale(scaling._bits_amax(x, 1, True), fmt, pow2, amax_floor, ue8m0)
    qt_ref[...] = _codes(x, scale, fmt, cast_with_specials)
    st_ref[...] = scale


@functools.partial(
    jax.jit, static_argnames=("fmt", "pow2", "amax_floor", "ue8m0", "interpret", "num_warps")
)
def requantize_col_t(
    codes: jax.Array,
    row_scales: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
    num_warps: int = REQUANTIZE_WARPS,
) -> tuple[jax.Array, jax.Array]:
    """FP8 ``codes`` (R, C) in 1x128 tiles (float32 ``row_scales`` (R, ceil(C/128)))
    dequantized and quantized again in 128x1 tiles, written transposed: (codes (C, R),
    float32 scales (C, ceil(R/128))), the transposes of ``quantize_2d(dequantized,
    orient="col")``'s outputs.  The cached activations of DeepSeek-V3's Wgrad, read
    as their FP8 codes; the Wgrad GEMM reads the result K-major."""
    if codes.ndim != 2:
        raise ValueError(f"requantize_col_t takes a 2-D array, got shape {codes.shape}")
    fmt = jnp.dtype(fmt)
    r, c = codes.shape
    rp, cp = round_up(r, GROUP), round_up(c, GROUP)
    # Zero codes with unit scales pad: zeros change no amax; the pad is cropped.
    dp = _pad_to(lax.bitcast_convert_type(codes, jnp.int8), (rp, cp), 0)
    sp = _pad_to(row_scales.astype(jnp.float32), (rp, cp // GROUP), 1.0)
    body = functools.partial(
        _requantize_t_kernel,
        fmt_in=jnp.dtype(codes.dtype),
        fmt=fmt,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
    )

    out_codes, scales = pl.pallas_call(
        _traced(body, interpret),
        out_shape=(
            jax.ShapeDtypeStruct((cp, rp), jnp.int8),
            jax.ShapeDtypeStruct((cp, rp // GROUP), jnp.float32),
        ),
        grid=(rp // GROUP, cp // GROUP),
        in_specs=[
            pl.BlockSpec((GROUP, GROUP), lambda i, j: (i, j)),
            pl.BlockSpec((GROUP, 1), lambda i, j: (i, j)),
        ],
        out_specs=(
            pl.BlockSpec((GROUP, GROUP), lambda i, j: (j, i)),
            pl.BlockSpec((GROUP, 1), lambda i, j: (j, i)),
        ),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps),
        name="fp8_requantize_col_t",
    )(dp, sp)
    return (
        lax.bitcast_convert_type(out_codes[:c, :r], fmt),
        scales[:c, : cdiv(r, GROUP)],
    )


def _traced(body, interpret: bool):
    """``body`` as a Triton kernel: the quantizer's divisions IEEE (:func:`divide_rn`),
    except in the interpreter, which divides as XLA does and runs no PTX."""

    def kernel(*refs):
        if interpret:
            return body(*refs)
        with scaling.ieee_division(divide_rn):
            return body(*refs)

    return kernel


@functools.partial(
    jax.jit,
    static_argnames=("fmt", "orient", "pow2", "amax_floor", "ue8m0", "interpret", "num_warps"),
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
    num_warps: int = NUM_WARPS,
) -> tuple[jax.Array, jax.Array]:
    """(codes, float32 scales) of a 2-D ``x``: ``tpu_quantize.quantize_2d``'s outputs
    for ``orient`` "row" (1x128 tiles), "col" (128x1) or "block" (128x128), the
    same bits; one program per 128 x 128 square."""
    check_2d(x, orient)
    fmt = jnp.dtype(fmt)
    r, c = x.shape
    # Zero padding to whole squares: a zero changes no amax; the pad is cropped.
    rp, cp = round_up(r, GROUP), round_up(c, GROUP)
    xp = _pad_to(x, (rp, cp), 0)
    kw = dict(fmt=fmt, pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0, cast=cast_with_specials)
    square = pl.BlockSpec((GROUP, GROUP), lambda i, j: (i, j))
    if orient == "row":
        body = functools.partial(row_kernel, groups=1, **kw)
        s_shape, s_spec = (rp, cp // GROUP), pl.BlockSpec((GROUP, 1), lambda i, j: (i, j))
    else:
        if orient == "col":
            body = functools.partial(col_kernel, groups=1, **kw)
        else:
            # One scale per block, written over its 128 columns (the first is kept).
            body = functools.partial(block_kernel, groups=1, col_groups=1, **kw)
        s_shape, s_spec = (rp // GROUP, cp), pl.BlockSpec((1, GROUP), lambda i, j: (i, j))
    codes, scales = pl.pallas_call(
        _traced(body, interpret),
        out_shape=(
            jax.ShapeDtypeStruct((rp, cp), jnp.int8),
            jax.ShapeDtypeStruct(s_shape, jnp.float32),
        ),
        grid=(rp // GROUP, cp // GROUP),
        in_specs=[square],
        out_specs=(square, s_spec),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps),
        name=f"fp8_quantize_{orient}",
    )(xp)
    return crop(orient, lax.bitcast_convert_type(codes, fmt), scales, r, c)


@functools.partial(
    jax.jit, static_argnames=("fmt", "pow2", "amax_floor", "ue8m0", "interpret", "num_warps")
)
def quantize_rows_cols(
    x: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
    num_warps: int = NUM_WARPS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(row codes, row scales (R, ceil(C/128)), col codes, col scales (ceil(R/128), C))
    of a 2-D ``x``: ``tpu_quantize.quantize_rows_cols``'s outputs, the same bits."""
    if x.ndim != 2:
        raise ValueError(f"quantize_rows_cols takes a 2-D array, got shape {x.shape}")
    fmt = jnp.dtype(fmt)
    r, c = x.shape
    # Zero padding to whole squares: a zero changes no amax; the pad is cropped.
    rp, cp = round_up(r, GROUP), round_up(c, GROUP)
    xp = _pad_to(x, (rp, cp), 0)
    body = functools.partial(
        rows_cols_kernel,
        groups=1,
        col_groups=1,
        cast=cast_with_specials,
        row_scales_t=False,
        cols_t=True,
        fmt=fmt,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
    )
    square = pl.BlockSpec((GROUP, GROUP), lambda i, j: (i, j))
    row_codes, row_scales, col_codes, col_scales = pl.pallas_call(
        _traced(body, interpret),
        out_shape=(
            jax.ShapeDtypeStruct((rp, cp), jnp.int8),
            # The 1x128 tiles' scales as the caller wants them: (R, C/128).
            jax.ShapeDtypeStruct((rp, cp // GROUP), jnp.float32),
            # Wgrad's 128x1 tiles written transposed, (C, R) and (C, R/128): its
            # GEMM reads them token-major, so no transpose of the codes follows.
            jax.ShapeDtypeStruct((cp, rp), jnp.int8),
            jax.ShapeDtypeStruct((cp, rp // GROUP), jnp.float32),
        ),
        grid=(rp // GROUP, cp // GROUP),
        in_specs=[square],
        out_specs=(
            square,
            pl.BlockSpec((GROUP, 1), lambda i, j: (i, j)),
            pl.BlockSpec((GROUP, GROUP), lambda i, j: (j, i)),
            pl.BlockSpec((GROUP, 1), lambda i, j: (j, i)),
        ),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps),
        name="fp8_quantize_rows_cols",
    )(xp)
    return (
        lax.bitcast_convert_type(row_codes[:r, :c], fmt),
        row_scales[:r, : cdiv(c, GROUP)],
        lax.bitcast_convert_type(col_codes[:c, :r], fmt).T,
        col_scales[:c, : cdiv(r, GROUP)].T,
    )


def divide_rn(num: jax.Array, den: jax.Array) -> jax.Array:
    """float32 ``num / den`` correctly rounded, as PTX ``div.rn.f32`` (Triton's own
    ``/`` is ``div.full.f32``, up to 2 ulp off); subnormals kept (no ``.ftz``)."""
    shape = jnp.broadcast_shapes(jnp.shape(num), jnp.shape(den))

    def bits(v):
        # The asm takes 32-bit registers: the float32 bits as int32.
        v = jnp.broadcast_to(jnp.asarray(v, jnp.float32), shape)
        return lax.bitcast_convert_type(v, jnp.int32)

    (q,) = pl_triton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[bits(num), bits(den)],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)],
    )
    return lax.bitcast_convert_type(q, jnp.float32)


def same_codes(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two arrays of FP8 codes have the same bits, a NaN code counting as
    any NaN code of the same sign (E5M2's NaN payloads are not specified)."""
    got, want = np.asarray(got), np.asarray(want)
    return got.shape == want.shape and not codes_differ(got, want).any()


def codes_differ(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Where two same-shaped arrays of FP8 codes differ, as :func:`same_codes` counts it."""
    g, w = got.view(np.uint8), want.view(np.uint8)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    return (g != w) & ~(both_nan & ((g & 0x80) == (w & 0x80)))


def on_gpu(fn, *arrays: jax.Array):
    """``fn`` over ``arrays`` whose leading axes stack matrices, lowered for CUDA only
    (any other platform of a multi-platform export sees dead zeros)."""
    return on_platform("cuda", fn, *arrays)


#: The environment variable that picks "auto"'s quantizer on a CUDA target, read
#: when a program is traced (set it before the first trace): "mosaic" (the
#: default: :mod:`fp8jax.kernels.mgpu_quantize`), "triton" (this module's
#: kernels) or "xla" (XLA's fusions of ``quant.quantize``).
OPT_IN = "FP8JAX_GPU_QUANTIZER"
CHOICES = ("mosaic", "triton", "xla")


def requested() -> str:
    """The quantizer :data:`OPT_IN` asks for ("mosaic" where it is unset or empty)."""
    value = os.environ.get(OPT_IN, "").strip().lower() or "mosaic"
    if value not in CHOICES:
        raise ValueError(f"{OPT_IN}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


@contextlib.contextmanager
def asking(kind: str) -> Iterator[None]:
    """:data:`OPT_IN` set to ``kind`` inside the block (programs traced there decide by it)."""
    before = os.environ.get(OPT_IN)
    os.environ[OPT_IN] = kind
    requested()  # refuse an unknown kind here
    try:
        yield
    finally:
        if before is None:
            del os.environ[OPT_IN]
        else:
            os.environ[OPT_IN] = before


def module(kind: str):
    """The kernels' module of ``kind`` ("mosaic" or "triton"): the same entry points."""
    if kind == "mosaic":
        from fp8jax.kernels import mgpu_quantize

        return mgpu_quantize
    if kind == "triton":
        from fp8jax.kernels import gpu_quantize

        return gpu_quantize
    raise ValueError(f"no quantizer kernels of kind {kind!r}")


def kernels():
    """The module whose kernels "auto" quantizes with on the CUDA target being lowered
    for, or None (XLA's fusions).

    :func:`requested`'s kind, on a target of compute capability >= 9.0.  Then,
    where a GPU is attached: once :func:`check_error` has found nothing for that
    kind.  Without one: the Mosaic GPU kernels for any CUDA lowering (as the
    block GEMM kernel), the Triton kernels only for a named target
    (:func:`fp8jax.platforms.lowering_for_cuda` or ``cuda_target``), since
    Pallas Triton lowers for a known device only.

    Speed: on an H200 the Triton kernels took longer than XLA's fusions for
    the same outputs at every warp count tried (the ``quantizers`` step of
    :mod:`fp8jax.bench.gpu_check`), so they are no longer the default; the
    Mosaic GPU kernels are priced by the compilers' census (bytes / HBM
    bandwidth) and not yet timed on a GPU.  ``fp8jax.quant.gpu_kernels`` adds
    the run-time question on an attached GPU: no slower than XLA's fusions.
    """
    kind = requested()
    if kind == "xla" or not platforms.cuda_at_least(CUDA_TARGET):
        return None
    if platforms.local_cuda_capability() is None:
        return module(kind) if kind == "mosaic" or platforms.cuda_target_named() else None
    return module(kind) if _passed(kind) else None


@functools.cache
def _passed(kind: str) -> bool:
    """Whether ``kind``'s kernels passed :func:`check_error` (a failure logged once)."""
    error = check_error(kind)
    if error is not None:
        logging.warning(
            "fp8jax: the %s quantizer kernels differ from the CPU's bits, XLA's fusions "
            "quantize instead: %s",
            kind,
            error,
        )
    return error is None


@functools.cache
def check_error(kind: str = "mosaic") -> str | None:
    """None where ``kind``'s compiled kernels give the CPU's bits on the attached GPU,
    else what differs or failed (asked once per kind; see :func:`compare_with_cpu`)."""
    return compare_with_cpu(interpret=False, kind=kind)


def check_array() -> np.ndarray:
    """A 256 x 384 float32 test array: magnitudes 2^-40..2^40 across rows, one row
    near 2^-122 (subnormal scales, subnormal values and products), an all-zero
    square, +-Inf and NaN in some tiles, bfloat16-representable values."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 384)) * np.exp2(rng.uniform(-40, 40, (256, 1)))
    x[11, :] = rng.standard_normal(384) * 2.0**-122
    x[128:, :128] = 0.0
    x[3, 5], x[7, 200], x[9, 9], x[200, 300] = np.inf, -np.inf, np.nan, np.nan
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def compare_with_cpu(interpret: bool, kind: str = "triton") -> str | None:
    """Run every kernel of ``kind`` (:func:`module`) on :func:`check_array` (E4M3 and
    E5M2, bfloat16 and float32 x) and on its 160 x 224 corner (edges inside
    squares; bfloat16 to E4M3, float32 to E5M2) (each orientation, both
    layouts at once, the requantized E4M3 cache of x)
    here and in Pallas' interpreter on the CPU backend, in a thread of its own
    (so that a jit trace asking for it does not stage it); None where every
    code and scale has the same bits (a NaN code as any of its sign,
    :func:`same_codes`), else every output that differs, how many of its codes
    and scales, and its first differing code.

    The interpreter on CPU gives ``fp8jax.quantize``'s CPU bits (the tests
    hold it to that, bit for bit). The reference is the CPU's because XLA's
    GPU path is not it: on an H200 its scales were 1 ulp above the correctly
    rounded amax / 448 in about half the tiles (and 78 of 98,304 codes one
    step off), where this kernel's matched the CPU's at every position
    looked at.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_compare, interpret, module(kind)).result()


def _run_all(kernels, x: jax.Array, fmt, interpret: bool) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Every kernel's (codes, scales) for ``x``, in the layout of ``fp8jax.quantize``."""
    quantize_2d, requantize_col_t = kernels.quantize_2d, kernels.requantize_col_t
    out = {o: quantize_2d(x, fmt=fmt, orient=o, interpret=interpret) for o in ORIENTS}
    rows_cols = kernels.quantize_rows_cols(x, fmt=fmt, interpret=interpret)
    out["rows of both"], out["cols of both"] = rows_cols[:2], rows_cols[2:]
    # Wgrad's cached x: E4M3 1x128 tiles requantized in 128x1 tiles.
    cached, cached_scales = quantize_2d(x, fmt=jnp.float8_e4m3fn, orient="row", interpret=interpret)
    codes_t, scales_t = requantize_col_t(cached, cached_scales, fmt=fmt, interpret=interpret)
    out["requantized"] = (codes_t.T, scales_t.T)
    return out


def _compare(interpret: bool, kernels) -> str | None:
    cpu = jax.devices("cpu")[0]
    found = []
    # The whole array in each type and format, and a corner of it whose edges end
    # inside squares (160 x 224: multiples of 32 that the Mosaic GPU kernels read
    # and write in place) from each type.
    full = check_array()
    corner = full[:160, :224]
    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    cases = [(full, d, f) for d, f in itertools.product((jnp.bfloat16, jnp.float32), (e4m3, e5m2))]
    cases += [(corner, jnp.bfloat16, e4m3), (corner, jnp.float32, e5m2)]
    try:
        for array, dtype, fmt in cases:
            x = jnp.asarray(array, dtype)
            with jax.default_device(cpu):
                want = _run_all(kernels, jax.device_put(x, cpu), fmt, interpret=True)
            got = _run_all(kernels, x, fmt, interpret=interpret)
            kind = f"{jnp.dtype(fmt).name} from {jnp.dtype(dtype).name} {x.shape}"
            for name, outs in got.items():
                diff = _difference(*(np.asarray(v) for v in (*outs, *want[name])))
                if diff:
                    found.append(f"{name} ({kind}) differ from the CPU's: {diff}")
    except Exception as e:  # a lowering / compile / run failure is the answer
        found.append(f"{type(e).__name__}: {str(e)[:300]}")
    return "; ".join(found) or None


def _difference(g_codes, g_scales, w_codes, w_scales) -> str:
    """'' where both (codes, scales) have the same bits (:func:`same_codes`), else how
    many codes and scales differ and the first differing code's position and bytes."""
    if g_codes.shape != w_codes.shape or g_scales.shape != w_scales.shape:
        return (
            f"shapes {g_codes.shape} / {g_scales.shape} against {w_codes.shape} / {w_scales.shape}"
        )
    codes_off = codes_differ(g_codes, w_codes)
    g, w = g_codes.view(np.uint8), w_codes.view(np.uint8)
    scales_off = int(np.sum(g_scales.view(np.uint32) != w_scales.view(np.uint32)))
    if not codes_off.any() and not scales_off:
        return ""
    text = f"{int(codes_off.sum())} codes, {scales_off} scales"
    if codes_off.any():
        at = tuple(int(i) for i in np.argwhere(codes_off)[0])
        text += f" (first {at}: 0x{int(g[at]):02x}, CPU 0x{int(w[at]):02x})"
    return text
