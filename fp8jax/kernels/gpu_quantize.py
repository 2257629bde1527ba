"""An output gradient's two FP8 tile layouts from one read, as a Pallas Triton kernel
on an NVIDIA GPU (compute capability >= 9.0).

:func:`quantize_rows_cols` gives what ``fp8jax.quant.quantize_rows_and_cols``
gives (Dgrad's 1x128 tiles along the last axis, Wgrad's 128x1 tiles along
the rows), the same bits: its body is the TPU kernel's
(:func:`fp8jax.kernels.tpu_quantize.rows_cols_kernel`), the numerics of
``quant.quantize`` operation for operation (amax on the float32 bit
patterns over the finite elements, the scale guards, the offset division
that flush-to-zero cannot change, saturation, then the cast).

Why a kernel: XLA's GPU compiler makes the same computation five passes
over dy (an amax reduction and a quantizing transpose per layout, and the
Inf/NaN masks between them); measured on an H200 at 4096 x 4096, about
85 us for one dy.  Here one program per 128 x 128 square reads it once and
writes both layouts' codes and scales: 64 MiB of traffic for a 32 MiB dy.

Where an NVIDIA GPU is attached, "auto" takes the kernel only once it has
given the XLA path's bits on a test array with zeros, Inf, NaN and values
spread over 2^-40..2^40 (:func:`check_error`, asked once); a program
lowered for CUDA from a machine without a GPU takes it when its target's
compute capability is >= 9.0.  ``interpret=True`` runs the kernel in
Pallas' interpreter (the tests, on CPU).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from fp8jax import platforms, scaling
from fp8jax.kernels.block_gemm import _pad_to, cdiv, round_up
from fp8jax.kernels.tpu_quantize import GROUP, rows_cols_kernel

#: The oldest CUDA target the kernel is taken for (FP8 conversions in Triton need
#: 8.9; 9.0 is what the GPU check has run it on).
CUDA_TARGET = "9.0"


@functools.partial(jax.jit, static_argnames=("fmt", "pow2", "amax_floor", "ue8m0", "interpret"))
def quantize_rows_cols(
    x: jax.Array,
    *,
    fmt,
    pow2: bool = False,
    amax_floor: float = 0.0,
    ue8m0: bool = False,
    interpret: bool = False,
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
        fmt=fmt,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
    )

    def kernel(*refs):
        if interpret:
            # The interpreter divides as XLA does (IEEE); it runs no PTX.
            return body(*refs)
        with scaling.ieee_division(divide_rn):
            return body(*refs)

    square = pl.BlockSpec((GROUP, GROUP), lambda i, j: (i, j))
    row_codes, row_scales_t, col_codes, col_scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((rp, cp), fmt),
            # The 1x128 tiles' scales transposed: one (1, 128) row per square.
            jax.ShapeDtypeStruct((cp // GROUP, rp), jnp.float32),
            jax.ShapeDtypeStruct((rp, cp), fmt),
            jax.ShapeDtypeStruct((rp // GROUP, cp), jnp.float32),
        ),
        grid=(rp // GROUP, cp // GROUP),
        in_specs=[square],
        out_specs=(
            square,
            pl.BlockSpec((1, GROUP), lambda i, j: (j, i)),
            square,
            pl.BlockSpec((1, GROUP), lambda i, j: (i, j)),
        ),
        interpret=interpret,
        name="fp8_quantize_rows_cols",
    )(xp)
    return (
        row_codes[:r, :c],
        row_scales_t[: cdiv(c, GROUP), :r].T,
        col_codes[:r, :c],
        col_scales[: cdiv(r, GROUP), :c],
    )


#: FP8 codes of +-Inf and NaN as XLA's conversion writes them (ml_dtypes' semantics,
#: the sign bit the input's): E4M3 has no Inf and takes its NaN code.
_SPECIAL_CODES = {
    jnp.dtype(jnp.float8_e4m3fn): (0x7F, 0x7F),
    jnp.dtype(jnp.float8_e5m2): (0x7C, 0x7E),
}


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


def cast_with_specials(xs: jax.Array, y: jax.Array, fmt) -> jax.Array:
    """The saturated quotient ``y`` cast to ``fmt``, +-Inf and NaN of ``xs`` as XLA casts them.

    Triton's float32 -> FP8 conversion saturates (``cvt.rn.satfinite``: +-Inf
    would become +-max), and its min / max ignore NaN (a NaN would saturate):
    finite lanes are cast, the others get :data:`_SPECIAL_CODES` by their bits.
    """
    finite = jnp.abs(xs) < jnp.inf  # False for +-Inf and NaN
    codes = jnp.where(finite, y, jnp.float32(0.0)).astype(fmt)
    code_bits = lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.int32) & 0xFF
    inf_code, nan_code = _SPECIAL_CODES[jnp.dtype(fmt)]
    sign = (lax.bitcast_convert_type(xs, jnp.int32) >> 24) & 0x80
    special = jnp.where(jnp.isinf(xs), jnp.int32(inf_code), jnp.int32(nan_code)) | sign
    # int32 0..255 to int8 wraps modulo 256: the byte itself.
    out = jnp.where(finite, code_bits, special).astype(jnp.int8)
    return lax.bitcast_convert_type(out, fmt)


def on_gpu(fn, *arrays: jax.Array):
    """``fn`` over ``arrays`` whose leading axes stack matrices, lowered for CUDA only
    (any other platform of a multi-platform export sees dead zeros)."""
    for _ in range(arrays[0].ndim - 2):
        fn = jax.vmap(fn)
    return platforms.only_on(("cuda",), fn, *arrays)


def available() -> bool:
    """Whether "auto" quantizes with the kernel on the CUDA target being lowered for."""
    if not platforms.cuda_at_least(CUDA_TARGET):
        return False
    return platforms.local_cuda_capability() is None or check_error() is None


@functools.cache
def check_error() -> str | None:
    """None where the compiled kernel gives the XLA path's bits on the attached GPU,
    else what differs or failed (asked once; see the module docstring)."""
    return compare_with_xla(interpret=False)


def check_array() -> np.ndarray:
    """A 256 x 384 float32 test array: magnitudes 2^-40..2^40 across rows, an
    all-zero square, +-Inf and NaN in some tiles, bfloat16-representable values."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 384)) * np.exp2(rng.uniform(-40, 40, (256, 1)))
    x[128:, :128] = 0.0
    x[3, 5], x[7, 200], x[9, 9], x[200, 300] = np.inf, -np.inf, np.nan, np.nan
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def compare_with_xla(interpret: bool) -> str | None:
    """Run the kernel and ``quant.quantize_rows_and_cols``'s XLA path on :func:`check_array`
    (E4M3, bfloat16 and float32) in a thread of its own (so that a jit trace asking
    for it does not stage it); None where every code and scale has the same bits."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_compare, interpret).result()


def _compare(interpret: bool) -> str | None:
    from fp8jax import quant

    try:
        for dtype in (jnp.bfloat16, jnp.float32):
            x = jnp.asarray(check_array(), dtype)
            got = quantize_rows_cols(x, fmt=jnp.float8_e4m3fn, interpret=interpret)
            # quant.quantize takes no kernel on a GPU: XLA's fusions.
            rows = quant.quantize(x, jnp.float8_e4m3fn, "tile", axis=-1)
            cols = quant.quantize(x, jnp.float8_e4m3fn, "tile", axis=-2)
            want = (rows.data, rows.scale, cols.data, cols.scale)
            names = ("row codes", "row scales", "col codes", "col scales")
            for name, g, w in zip(names, got, want, strict=True):
                g, w = np.asarray(g), np.asarray(w)
                bits = np.uint8 if g.dtype.itemsize == 1 else np.uint32
                if g.shape != w.shape or not np.array_equal(g.view(bits), w.view(bits)):
                    return f"{name} of a {jnp.dtype(dtype).name} x differ from the XLA path's"
    except Exception as e:  # a lowering / compile / run failure is the answer
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None
