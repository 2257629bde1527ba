"""Quantize / dequantize at tensor, row, tile and block granularity.

``quantize(x, fmt, granularity, axis, tile)`` returns a :class:`QTensor` with
``x ~= dequantize(q) = data * expand(scale)``:

* ``"tensor"``: one scale, shape ();
* ``"row"``: one scale per slice along ``axis`` (reduced over ``axis``); scale
  has ``x``'s shape with ``axis`` of size 1;
* ``"tile"``: one scale per 1 x ``tile`` run along ``axis``; scale has
  ``x``'s shape with ``axis`` of size ceil(n / tile).  With tile 128, E4M3 and
  ``axis=-1`` this is DeepSeek-V3's ``act_quant``: scale = amax / 448 in
  float32 (correctly rounded), data = e4m3(x / scale) (correctly rounded
  division, then round-to-nearest-even with saturation);
* ``"block"``: one scale per ``tile`` x ``tile`` block over the last two
  axes; scale shape (..., ceil(R / tile), ceil(C / tile)).

Lengths that are not multiples of the tile are zero-padded for the amax (zeros
never raise an amax) and cropped afterwards: a partial tile at the edge gets
the scale of its own elements.  ``data`` always has ``x``'s shape.  Zero-size
arrays quantize to empty data with scale 1 for any empty scale group.

"Bit for bit DeepSeek's act_quant" holds for tiles of finite values whose
length along ``axis`` is a multiple of 128 (act_quant requires that length).
Which act_quant: with ``amax_floor=0`` (the default, every training preset)
DeepSeek-V3's 2024 code, amax / 448 with no floor; with ``amax_floor=
fp8jax.scaling.DEEPSEEK_AMAX_FLOOR`` (1e-4) its code since 2025-08-27
(V3.2-Exp; ``amax.clamp(1e-4)``, also DeepGEMM's ``per_token_cast_to_fp8``),
with ``pow2`` as well for its ``scale_fmt="ue8m0"``.  The two agree on every
tile whose amax is at least 1e-4.  Elsewhere the results differ on purpose:

* an all-zero tile gets scale 1 and zero data (act_quant: 0 / 0 gives a NaN
  scale and NaN data);
* a tile holding NaN or +-Inf takes its scale from its finite elements, and
  its NaN / Inf elements become the format's NaN (or Inf) code (act_quant: an
  Inf amax gives scale Inf and zeros or NaN for the whole tile, a NaN amax a
  NaN tile);
* a tile whose amax is tiny (a float32 subnormal, or amax / 448 below
  float32's normal range) follows the same formula with a subnormal scale,
  computed exactly on the bit patterns, on CPU (where XLA flushes subnormal
  arithmetic to zero) as on GPU;
* a scale is capped so that ``448 * scale`` is finite: values within an ulp of
  float32's max saturate (see :mod:`fp8jax.scaling`).

Scale formats (``scale_fmt``): "float32" stores each scale as a float32;
"ue8m0" (DeepSeek-V3.1's name for OCP E8M0) stores power-of-two scales as
one exponent byte each, ``float8_e8m0fnu`` (2^(c - 127)), bit-exact to the
float32 power-of-two scales they replace: codes, values and every product
with them are the same.  "ue8m0" needs ``pow2=True``; the one difference is
below E8M0's range: a tile whose power-of-two scale would be under 2^-127
(amax below 448 * 2^-127, about 2.6e-36) gets 2^-127.  A given scale that is
not a power of two is refused (:func:`fp8jax.formats.encode_e8m0`), never
rounded.  Whatever multiplies by the scales reads them as float32
(:func:`scale_values`, :func:`float32_scales`: exact).

Non-finite inputs propagate: NaN stays NaN and +-Inf becomes Inf or the NaN
code (E4M3 has no Inf), so a GEMM on the result is non-finite as in bf16;
finite values above the range saturate at +-fmt_max * scale.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import operator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

from fp8jax import platforms
from fp8jax.formats import (
    E4M3,
    E8M0,
    IEEE_FP8,
    KERNEL_FLOATS,
    SCALE_FMTS,
    as_format,
    check_scale_fmt,
    decode_e8m0,
    encode_e8m0,
    floor_e8m0,
    saturating_cast,
)
from fp8jax.inline_ops import traced_inline, where
from fp8jax.layout import Layout, pad_zeros
from fp8jax.scaling import (
    divide_offset,
    exact_product,
    exact_product_float64,
    finite_amax,
    scale_from_amax,
)


@dataclass(frozen=True)
class QTensor:
    """A quantized operand of any format: codes, scales and their layout.

    ``data`` holds the codes (the element format, x's shape), ``scale`` the
    scales in the :class:`fp8jax.layout.Layout` ``layout`` describes
    (granularity, axis, tile; the block formats use "tile" for 1 x block runs
    and "block" for block x block squares), ``tensor_scale`` a second-level
    float32 scale or None.  ``scheme`` names the format family whose rules
    made the codes ("fp8": float32 scales; "mx": E8M0 scales, "nvfp4": E4M3
    scales and a tensor scale, the block formats of
    :mod:`fp8jax.microscaling`); :mod:`fp8jax.schemes` maps it to
    the family's quantizer, dequantizer and per-element scales.  ``layout``
    and ``scheme`` are static metadata (not pytree leaves).  An "fp8"
    operand's scales are float32, or E8M0 bytes (``scale_fmt`` "ue8m0", one
    byte per scale instead of four, the same power-of-two values).

    How the scales follow the data when it moves: :meth:`swapaxes`,
    :meth:`take`, :meth:`batched` (each asks the layout).

    ``source``: the high-precision values the codes were made from, in the
    codes' shape, where a caller keeps them (a weight quantized once per
    step, :mod:`fp8jax.train.weight_codes`) for what must see the values
    themselves (telemetry, a rescaled weight:
    :func:`fp8jax.operands.source_values`); no GEMM reads them.  None
    elsewhere.  They move with the data.
    """

    data: jax.Array
    scale: jax.Array
    layout: Layout = Layout()
    tensor_scale: jax.Array | None = None
    scheme: str = "fp8"
    source: jax.Array | None = None

    @property
    def granularity(self) -> str:
        return self.layout.granularity

    @property
    def axis(self) -> int:
        return self.layout.axis

    @property
    def tile(self) -> int:
        return self.layout.tile

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> Any:
        return self.data.dtype

    @property
    def scale_fmt(self) -> str:
        """How the scales are stored: "ue8m0" (E8M0 bytes) or "float32" (scheme "fp8")."""
        return "ue8m0" if self.scale.dtype == E8M0 else "float32"

    @property
    def nbytes(self) -> int:
        """Storage in bytes: codes packed (E2M1: two per byte), scales, tensor scale."""
        bits = int(ml_dtypes.finfo(self.data.dtype).bits)
        extra = 0 if self.tensor_scale is None else self.tensor_scale.size * 4
        return int(
            -(-self.data.size * bits // 8) + self.scale.size * self.scale.dtype.itemsize + extra
        )

    def swapaxes(self, i: int, j: int) -> QTensor:
        """Data axes ``i`` and ``j`` (non-negative) swapped, scales and layout with them."""
        layout, scale = self.layout.swap(self.scale, i, j)
        moved = replace(self, data=jnp.swapaxes(self.data, i, j), scale=scale, layout=layout)
        return moved._with_source(lambda v: jnp.swapaxes(v, i, j))

    def take(self, index: jax.Array) -> QTensor:
        """Batch elements ``index`` (an index array into the leading axis), scales with them."""
        moved = replace(self, data=self.data[index], scale=self.layout.take(self.scale, index))
        return moved._with_source(lambda v: v[index])

    def batched(self, shape: tuple[int, ...]) -> QTensor:
        """A leading batch axis of size 1: data reshaped to ``shape``, scales and layout with it."""
        layout, scale = self.layout.batched(self.scale)
        moved = replace(self, data=self.data.reshape(shape), scale=scale, layout=layout)
        return moved._with_source(lambda v: v.reshape(shape))

    def _with_source(self, move) -> QTensor:
        # The source values follow the codes through the same move.
        return self if self.source is None else replace(self, source=move(self.source))


# Static fields are not leaves of the pytree.
jax.tree_util.register_dataclass(
    QTensor,
    data_fields=["data", "scale", "tensor_scale", "source"],
    meta_fields=["layout", "scheme"],
)


def is_quantized(op: Any) -> bool:
    """True for a :class:`QTensor` (an operand of any scheme), False for a plain array."""
    return isinstance(op, QTensor)


def scale_values(q: QTensor) -> jax.Array:
    """The scales of an "fp8" operand as float32 values (E8M0 bytes decoded, exact)."""
    if q.scale.dtype == E8M0:
        return decode_e8m0(q.scale)
    return q.scale.astype(jnp.float32)


def float32_scales(op: Any) -> Any:
    """``op`` with float32 scales: an "fp8" QTensor whose scales are E8M0 bytes decoded
    (exact); anything else (arrays, float32 scales, the block formats' own scales) as is.

    What a GEMM multiplies by: a UE8M0 operand's products are those of the
    float32 power-of-two scales it stores, bit for bit.
    """
    if is_quantized(op) and op.scheme == "fp8" and op.scale.dtype == E8M0:
        return replace(op, scale=decode_e8m0(op.scale))
    return op


def ue8m0_scales(op: Any) -> Any:
    """``op`` with its float32 power-of-two scales stored as E8M0 bytes (exact).

    Scales that are not powers of two in [2^-127, 2^127] are refused
    (:func:`fp8jax.formats.encode_e8m0`: a ValueError, or NaN under jit),
    never rounded.  Arrays and operands already in E8M0 pass through.
    """
    if not (is_quantized(op) and op.scale.dtype != E8M0):
        return op
    if op.scheme != "fp8":
        raise ValueError(f"UE8M0 scales apply to scheme 'fp8' operands, got {op.scheme!r}")
    return replace(op, scale=encode_e8m0(op.scale.astype(jnp.float32)), tensor_scale=None)


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-d tensor")
    return axis % ndim


def _bits(x: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF


def divide_by_scale(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """x / scale in float32 (broadcasting): the quotient the quantizer casts.

    Scales are positive.  Correctly rounded wherever |x / scale| >= 2^-30
    (and +-Inf where x is); a smaller quotient, code 0 in every FP8 format,
    may come out as zero.  On CPUs and TPUs, whose float32 arithmetic
    flushes subnormals to zero, a group whose scale is below 2^-96 (a
    subnormal scale among them) is divided as (x * 2^64) / (scale * 2^64),
    both factors formed exactly on the bit patterns, which gives the same
    quotient; above that scale only an x below 2^-126 is flushed, whose
    quotient is below 2^-30.  +-Inf elements stay +-Inf (the exact division
    trick alone would turn them into NaN), so the cast maps them to the
    format's code.  Telemetry asks this same quotient whether an element
    was clipped.
    """
    return platforms.choose(
        lambda p: "ieee" if p == "cuda" else "offset",
        lambda how: _divide_ieee if how == "ieee" else divide_offset,
        (x, scale),
    )


@traced_inline
def _divide_ieee(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """:func:`divide_by_scale` where float32 arithmetic keeps subnormals (CUDA GPUs, XLA's default):
    the IEEE division is exact for them, no offset needed, and +-Inf / scale is +-Inf."""
    # The plain division: XLA's GPU compiler keeps x / broadcast(scale) a
    # division (the reciprocal rewrite that exact_div defeats is the CPU
    # simplifier's), so no x * 0 term, and no isinf mask to keep Inf out of
    # it, which XLA materialized as a pred array next to each transposing
    # quantization.
    return x / scale


def expand_scale(scale: jnp.ndarray, shape, granularity: str, axis: int, tile: int):
    """Broadcast a scale layout back to ``shape`` (repeat tiles, crop edges)."""
    return Layout(granularity, axis, tile).expand(scale, shape)


def compute_scale(
    x: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
) -> jnp.ndarray:
    """The online scale layout of ``x`` (see module docstring for shapes)."""
    amax = group_amax(x, granularity, axis, tile)
    return scale_from_amax(amax, fmt, pow2=pow2, amax_floor=amax_floor)


def group_amax(x: jnp.ndarray, granularity: str, axis: int = -1, tile: int = 128) -> jnp.ndarray:
    """max |x| per scale group (the scale layout's shape), float32.

    NaN / Inf elements are ignored and subnormals read exactly
    (:func:`fp8jax.scaling.finite_amax`).
    """
    axis = _norm_axis(axis, x.ndim) if x.ndim else 0
    return layout_amax(x, Layout(granularity, axis, tile))


def layout_amax(x: jnp.ndarray, layout: Layout) -> jnp.ndarray:
    """max |x| per scale group of ``layout`` (axis normalized), float32: :func:`group_amax`."""
    return layout.reduce_groups(x, finite_amax)


def quantize_with_scale(
    x: jnp.ndarray,
    scale: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    scale_fmt: str = "float32",
) -> QTensor:
    """Quantize with a given scale layout (delayed scaling passes its own).

    Scales must be positive and finite.  ``scale_fmt="ue8m0"``: the scales (float32 or E8M0) are stored as E8M0
    bytes; a float32 scale that is not a power of two in [2^-127, 2^127] is
    refused (ValueError; under jit its code is NaN and so are its elements).
    """
    fmt = as_format(fmt)
    axis = _norm_axis(axis, x.ndim) if x.ndim else 0
    # Compute in float32 (bf16/f16 inputs are exact in it).
    xf = x.astype(jnp.float32)
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    codes = None
    if scale_fmt == "ue8m0":
        # The bytes first: the division then uses exactly the values they hold
        # (a refused scale decodes to NaN, so its elements are NaN, not rounded).
        codes = scale if scale.dtype == E8M0 else encode_e8m0(scale.astype(jnp.float32))
        scale = decode_e8m0(codes)
    # E8M0 bytes given with scale_fmt="float32": their values, stored as float32.
    scale = decode_e8m0(scale) if scale.dtype == E8M0 else scale.astype(jnp.float32)
    layout = Layout(granularity, axis, tile)
    # Saturate: values past the range clip to +-max instead of NaN/Inf.  Cast
    # where the quotient is formed, so that a compiler fuses the division and
    # the cast into one pass (no float32 quotient in memory).
    data = layout.map_groups(
        xf,
        scale,
        lambda xg, sg: saturating_cast(divide_by_scale(xg, sg), fmt),
    )
    return QTensor(data, scale if codes is None else codes, layout)


def quantize(
    x: jnp.ndarray,
    fmt,
    granularity: str = "tile",
    axis: int = -1,
    tile: int = 128,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
    scale_fmt: str = "float32",
) -> QTensor:
    """Online-scaled quantization of ``x`` to ``fmt`` (see module docstring).

    ``scale_fmt="ue8m0"`` (needs ``pow2``): the same codes, the scales as E8M0
    bytes (floored at 2^-127, E8M0's smallest value).
    """
    check_scale_fmt(scale_fmt, pow2)
    if x.ndim == 0:
        raise ValueError("quantize needs at least a 1-d tensor")
    if tile <= 0:
        raise ValueError("tile must be positive")
    # An unknown granularity is refused here, before any tracing.
    Layout(granularity, axis, tile)
    return _quantize_online(
        x, as_format(fmt), granularity, axis, tile, pow2, float(amax_floor), scale_fmt
    )


# Traced once per input shape, dtype and settings, then reused: a model quantizes
# many operands of the same shapes, and tracing the quantizer's every path (its
# branches, and each platform's) is most of what compiling an FP8 program costs
# in Python.  Inside another jit the call is inlined when lowered: same program.
@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _quantize_online(x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt) -> QTensor:
    args = (x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt)
    # Where no kernel takes x, every guard is an elementwise select in the one
    # pass that reads x: a branch would read x once more to decide, and the
    # compiler keeps both branches' code and buffers.  The kernels give the
    # same codes and scales, bit for bit.

    kernel = tpu_quantizer_orient(x, fmt, granularity, axis, tile)
    ways = {
        "one pass": _quantize_one_pass,
        "group rows": _quantize_as_group_rows,
        "tpu kernel": partial(_quantize_kernel, orient=kernel, platform="tpu"),
        "gpu kernel": partial(_quantize_kernel, orient=kernel, platform="cuda"),
    }
    settings = args[1:]
    rows = _group_rows_fit(x, granularity)

    def decide(p: str) -> str:
        if kernel and p == "tpu":
            return "tpu kernel"
        if kernel and p == "cuda" and gpu_kernels() is not None:
            return "gpu kernel"
        return "group rows" if rows and p == "cpu" else "one pass"

    return platforms.choose(decide, lambda how: lambda x: ways[how](x, *settings), (x,))


def tpu_quantizer_orient(x, fmt, granularity, axis, tile) -> str | None:
    """The orientation of :mod:`fp8jax.kernels.tpu_quantize` that quantizes ``x``, or None.

    128-long tiles along the last axis (any leading axes, as rows), 128-long
    tiles along the second-to-last, 128x128 blocks of the last two (leading
    axes stack matrices); IEEE FP8 formats; float32 / bfloat16 inputs.
    """
    if tile != 128 or as_format(fmt) not in IEEE_FP8 or x.size == 0:
        return None
    if jnp.dtype(x.dtype) not in KERNEL_FLOATS:
        return None
    ax = _norm_axis(axis, x.ndim)
    if granularity == "tile" and ax == x.ndim - 1:
        return "row"
    if x.ndim >= 2 and granularity == "tile" and ax == x.ndim - 2:
        return "col"
    if x.ndim >= 2 and granularity == "block":
        return "block"
    return None


def _quantizer_kernels(platform: str):
    """(the quantizer kernels' module, its ``on_*`` runner) for ``platform``:
    :mod:`fp8jax.kernels.tpu_quantize` on "tpu", on "cuda" the module
    :func:`gpu_kernels` chose (:mod:`~fp8jax.kernels.mgpu_quantize` by default;
    the same entry points and outputs)."""
    from fp8jax.kernels import gpu_quantize, tpu_quantize

    if platform == "tpu":
        return tpu_quantize, tpu_quantize.on_tpu
    return gpu_kernels(), gpu_quantize.on_gpu


def gpu_kernels():
    """The GPU quantizer kernels' module "auto" takes on the CUDA target being lowered
    for, or None (XLA's fusions): ``gpu_quantize.kernels()``'s choice, and where a
    GPU is attached, only if they are no slower there than XLA's fusions for the
    same outputs (:func:`gpu_kernels_time`, measured once per kind and logged)."""
    from fp8jax.kernels import gpu_quantize

    module = gpu_quantize.kernels()
    if module is None or platforms.local_cuda_capability() is None:
        return module
    return module if _gpu_kernels_faster(gpu_quantize.requested()) else None


@functools.cache
def _gpu_kernels_faster(kind: str) -> bool:
    # A thread of its own: asked from inside a jit trace, the timing must not be staged.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        times = pool.submit(gpu_kernels_time, kind).result()
    faster = times["kernels_us"] <= times["xla_us"]
    logging.warning(
        "fp8jax: %s quantizer kernels %.1f us, XLA's fusions %.1f us (x's tiles, W's "
        "blocks, dy's two layouts; %dx%d bfloat16 operands): %s quantize",
        kind,
        times["kernels_us"],
        times["xla_us"],
        times["n"],
        times["n"],
        "the kernels" if faster else "XLA's fusions",
    )
    return faster


def gpu_kernels_time(kind: str, n: int = 4096, interpret=False, iters: int = 5) -> dict:
    """Median wall time (us) of ``kind``'s quantizer kernels and of XLA's one-pass
    fusions for the same outputs (x's 1x128 tiles, W's 128x128 blocks, and dy's two
    tile layouts, each an ``n`` x ``n`` bfloat16 operand, to E4M3), timed round-robin
    on the default device (``interpret``: the kernels in their interpreter, for the
    tests)."""
    from fp8jax.kernels import gpu_quantize
    from fp8jax.wall_time import time_calls

    kernels = gpu_quantize.module(kind)
    # Three operands, as in a GEMM's fwd+bwd: with one, XLA would compute x's and
    # dy's identical 1x128 tiles once (common subexpressions) and be timed for less.
    x, w, dy = jax.random.normal(jax.random.key(0), (3, n, n), jnp.bfloat16)
    kw = dict(fmt=E4M3, interpret=interpret)

    def by_kernels(x, w, dy):
        return (
            kernels.quantize_2d(x, orient="row", **kw),
            kernels.quantize_2d(w, orient="block", **kw),
            kernels.quantize_rows_cols(dy, **kw),
        )

    def by_xla(x, w, dy):
        one = partial(_quantize_one_pass, fmt=E4M3, tile=128, pow2=False, amax_floor=0.0)
        return (
            one(x, granularity="tile", axis=1, scale_fmt="float32"),
            one(w, granularity="block", axis=1, scale_fmt="float32"),
            one(dy, granularity="tile", axis=1, scale_fmt="float32"),
            one(dy, granularity="tile", axis=0, scale_fmt="float32"),
        )

    args = (x, w, dy)
    cases = {"kernels": (jax.jit(by_kernels), args), "xla": (jax.jit(by_xla), args)}
    t = time_calls(cases, warmup=1, iters=iters)
    return {
        "n": n,
        "kernels_us": t["kernels"]["median_s"] * 1e6,
        "xla_us": t["xla"]["median_s"] * 1e6,
    }


def _quantize_kernel(
    x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt, *, orient, platform
) -> QTensor:
    """:func:`quantize` by a Pallas kernel on ``platform`` ("tpu": Mosaic TPU, "cuda":
    Mosaic GPU or Triton; one read of x, the same codes and scales)."""
    module, on = _quantizer_kernels(platform)
    ue8m0 = scale_fmt == "ue8m0"
    # Tiles along the last axis: a 2-D view whose rows hold whole tiles, as x
    # lies in a TPU's tiled layout (_row_view).
    x2 = x.reshape(_row_view(x.shape, tile)) if orient == "row" else x
    run = partial(
        module.quantize_2d,
        fmt=as_format(fmt),
        orient=orient,
        pow2=pow2,
        amax_floor=amax_floor,
        ue8m0=ue8m0,
    )
    data, scale = on(run, x2)
    if orient == "row":
        data = data.reshape(x.shape)
        scale = scale.reshape(x.shape[:-1] + (-(-x.shape[-1] // tile),))
    layout = Layout(granularity, _norm_axis(axis, x.ndim), tile)
    # UE8M0: the kernel's scales are the powers of two the bytes hold.
    return QTensor(data, encode_e8m0(scale) if ue8m0 else scale, layout)


def _row_view(shape: tuple[int, ...], tile: int) -> tuple[int, int]:
    """The 2-D (rows, columns) a row kernel quantizes an array of ``shape`` as, in
    1 x ``tile`` tiles along its last axis: the leading axes as rows, or, where the
    second-to-last axis is a short one (fewer than 8: a split such as SwiGLU's
    gate and up, (..., 2, F)) and the last a whole number of tiles, those two
    axes as one row.  The tiles are the same either way; the second keeps the
    (..., 2F) array such a split was made from as it lies in a TPU's tiled
    layout, which (..., 2, F) as 2 x ... rows of F does not (a copy of x)."""
    if len(shape) >= 3 and shape[-2] < 8 and shape[-1] % tile == 0:
        return math.prod(shape[:-2]), shape[-2] * shape[-1]
    return math.prod(shape[:-1]), shape[-1]


def quantize_rows_and_cols(
    x: jnp.ndarray,
    fmt,
    tile: int = 128,
    *,
    pow2: bool = False,
    amax_floor: float = 0.0,
    scale_fmt: str = "float32",
) -> tuple[QTensor, QTensor]:
    """``quantize(x, fmt, "tile", axis=-1, ...)`` and ``quantize(x, fmt, "tile", axis=-2,
    ...)``: the same two operands, bit for bit (an output gradient's 1x128 tiles for
    Dgrad and 128-token tiles for Wgrad).

    On a TPU (:mod:`fp8jax.kernels.tpu_quantize`) and an NVIDIA GPU of compute
    capability >= 9.0 (:mod:`fp8jax.kernels.gpu_quantize`), where the kernels
    take the tiles (128 long, IEEE FP8, float32 / bfloat16 x), one kernel
    reads x once for both.
    """
    check_scale_fmt(scale_fmt, pow2)
    if x.ndim < 2:
        raise ValueError(f"quantize_rows_and_cols needs at least a 2-d tensor, got shape {x.shape}")
    if tile <= 0:
        raise ValueError("tile must be positive")
    return _rows_and_cols_online(x, as_format(fmt), tile, pow2, float(amax_floor), scale_fmt)


@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _rows_and_cols_online(x, fmt, tile, pow2, amax_floor, scale_fmt) -> tuple[QTensor, QTensor]:
    def separately(x):
        return tuple(
            _quantize_online(x, fmt, "tile", axis, tile, pow2, amax_floor, scale_fmt)
            for axis in (x.ndim - 1, x.ndim - 2)
        )

    # The kernels take 128-long tiles of IEEE FP8 from float32 / bfloat16 x.
    fits = tpu_quantizer_orient(x, fmt, "tile", -1, tile) == "row"
    settings = dict(fmt=fmt, pow2=pow2, amax_floor=amax_floor, scale_fmt=scale_fmt)
    ways = {
        "separately": separately,
        "tpu kernel": partial(_rows_and_cols_kernel, **settings, platform="tpu"),
        "gpu kernel": partial(_rows_and_cols_kernel, **settings, platform="cuda"),
    }

    def decide(p: str) -> str:
        if fits and p == "tpu":
            return "tpu kernel"
        if fits and p == "cuda" and gpu_kernels() is not None:
            return "gpu kernel"
        return "separately"

    return platforms.choose(decide, ways.__getitem__, (x,))


def _rows_and_cols_kernel(x, fmt, pow2, amax_floor, scale_fmt, platform) -> tuple[QTensor, QTensor]:
    """:func:`quantize_rows_and_cols` by one Pallas kernel on ``platform`` ("tpu": Mosaic
    TPU, "cuda": Mosaic GPU or Triton; leading axes stack matrices)."""
    ue8m0 = scale_fmt == "ue8m0"
    module, on = _quantizer_kernels(platform)
    run = partial(module.quantize_rows_cols, fmt=fmt, pow2=pow2, amax_floor=amax_floor, ue8m0=ue8m0)
    row_data, row_scale, col_data, col_scale = on(run, x)

    def operand(data, scale, axis):
        # UE8M0: the kernel's scales are the powers of two the bytes hold.
        return QTensor(data, encode_e8m0(scale) if ue8m0 else scale, Layout("tile", axis, 128))

    return operand(row_data, row_scale, x.ndim - 1), operand(col_data, col_scale, x.ndim - 2)


def _online_scale(x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt) -> jnp.ndarray:
    """The online scales of ``x``: exact amax over its finite elements, every guard."""
    amax = group_amax(x, granularity, axis, tile)
    return _scale_of_amax(amax, fmt, pow2, amax_floor, scale_fmt)


def _scale_of_amax(amax, fmt, pow2, amax_floor, scale_fmt) -> jnp.ndarray:
    """:func:`_online_scale` of given (finite) group amaxes."""
    scale = scale_from_amax(amax, fmt, pow2=pow2, amax_floor=amax_floor)
    if scale_fmt == "ue8m0":
        # E8M0 holds no power of two below 2^-127: such tiles get 2^-127.
        scale = floor_e8m0(scale)
    return scale


def _quantize_one_pass(x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt) -> QTensor:
    """:func:`quantize` with no branch: non-finite, zero and tiny groups by selects.

    The scales are made before the pass over x, behind an optimization
    barrier: XLA would otherwise fuse their guards (the subnormal quotient,
    the caps, the power of two) into every kernel that reads them, so into
    the pass over x, where the CPU compiler compiles them a second time and
    recomputes them for each element.  As a kernel of their own they are
    a (rows, groups) pass; the element pass reads them.
    """
    scale = _online_scale(x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt)
    scale = lax.optimization_barrier(scale)
    return quantize_with_scale(x, scale, fmt, granularity, axis, tile, scale_fmt=scale_fmt)


def _group_rows_fit(x, granularity: str) -> bool:
    """Whether :func:`_quantize_as_group_rows` takes ``x``: tiles along any axis, or
    blocks over the last two; not an empty x."""
    return x.size > 0 and (granularity == "tile" or (granularity == "block" and x.ndim >= 2))


def group_rows_bucket(n: int) -> int:
    """The rows a CPU quantizes ``n`` groups in: the smallest 2^k * {5, 6, 7, 8} / 8
    (k >= 3) that holds them, so at most a quarter more than ``n`` (5 for n < 5)."""
    top = 1 << max(n - 1, 7).bit_length()
    return next(top // 8 * f for f in (5, 6, 7, 8) if top // 8 * f >= n)


def _quantize_as_group_rows(
    x, fmt, granularity, axis, tile, pow2, amax_floor, scale_fmt
) -> QTensor:
    """:func:`_quantize_one_pass` with x's groups laid out as the rows of a matrix:
    the same codes and scales, from kernels a program compiles once per bucket.

    XLA's CPU compiler compiles a kernel per distinct shape, and an FP8
    train step quantizes operands of dozens of shapes, each through the same
    exact arithmetic (amax on the bit patterns, the correctly rounded scale,
    the offset division, the codes): most of what the step costs to compile
    over bf16.  Here every tile (zero-padded at an edge: zeros raise no
    amax) or block becomes one row, the rows are padded with zero groups up
    to :func:`group_rows_bucket`, and those rows are quantized one group
    per row (a block as a tile x tile matrix); operands whose groups fall in the same
    bucket share its kernels.  The layout moves (a transpose for tiles along
    another axis than the last, blocks gathered into rows) and the padding
    are copies, of the bit patterns (XLA's CPU moves bfloat16 through
    float32 arithmetic, which would flush its subnormals); every group's
    arithmetic is the one pass's, so the result is the same bits.
    """
    ax = _norm_axis(axis, x.ndim)
    dtype = jnp.dtype(x.dtype)
    x = lax.bitcast_convert_type(x, _BITS[dtype.itemsize])
    if granularity == "tile":
        xt = jnp.moveaxis(x, ax, -1)
        k = xt.shape[-1]
        kp = -(-k // tile) * tile
        flat = pad_zeros(xt.reshape(-1, k), ((0, 0), (0, kp - k))).reshape(-1, tile)
        data, scale = _quantize_rows_padded(flat, dtype, fmt, pow2, amax_floor, scale_fmt)
        data = data.reshape(-1, kp)[:, :k].reshape(xt.shape)
        scale = scale.reshape(xt.shape[:-1] + (kp // tile,))
        data, scale = jnp.moveaxis(data, -1, ax), jnp.moveaxis(scale, -1, ax)
    else:
        lead, (r, c) = x.shape[:-2], x.shape[-2:]
        rp, cp = -(-r // tile) * tile, -(-c // tile) * tile
        xp = pad_zeros(x, [(0, 0)] * len(lead) + [(0, rp - r), (0, cp - c)])
        blocks = xp.reshape(lead + (rp // tile, tile, cp // tile, tile))
        flat = jnp.moveaxis(blocks, -3, -2).reshape(-1, tile, tile)
        data, scale = _quantize_rows_padded(flat, dtype, fmt, pow2, amax_floor, scale_fmt)
        data = data.reshape(lead + (rp // tile, cp // tile, tile, tile))
        data = jnp.moveaxis(data, -2, -3).reshape(lead + (rp, cp))[..., :r, :c]
        scale = scale.reshape(lead + (rp // tile, cp // tile))
    return QTensor(data, scale, Layout(granularity, ax, tile))


# Unsigned integers of each width: the bit patterns a layout move copies.
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _quantize_rows_padded(flat, dtype, fmt, pow2, amax_floor, scale_fmt):
    """(codes, one scale per group) of ``flat``, the bit patterns of ``dtype`` values: its
    rows (n, tile) or blocks (n, tile, tile) each a group, quantized through a bucket."""
    n = flat.shape[0]
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        # bfloat16 groups as the float32 values they are: a bfloat16 is the top
        # half of its float32 (exact, subnormals too), widened here on the bit
        # patterns.  The same values give the same codes and scales, and
        # bfloat16 and float32 operands share the float32 buckets' kernels.
        flat, dtype = flat.astype(jnp.uint32) << 16, jnp.dtype(jnp.float32)
    # The barriers keep the layout moves and the padding out of the bucket's
    # kernels, which would otherwise be fused into them and differ per shape.
    pad = [(0, group_rows_bucket(n) - n)] + [(0, 0)] * (flat.ndim - 1)
    padded = lax.optimization_barrier(pad_zeros(flat, pad))
    data, scale = lax.optimization_barrier(
        _quantize_bucket(padded, dtype, fmt, pow2, amax_floor, scale_fmt)
    )
    return data[:n], scale.reshape(-1)[:n]


# One trace per bucket shape and settings: operands in one bucket share it.
@partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize_bucket(bits, dtype, fmt, pow2, amax_floor, scale_fmt):
    groups = lax.bitcast_convert_type(bits, dtype)
    # A block stays two axes of the tile: one reduction over both, as the
    # one pass makes for any block (a 16384-long row would be split by XLA).
    granularity = "tile" if groups.ndim == 2 else "block"
    tile = groups.shape[1]
    q = _quantize_one_pass(groups, fmt, granularity, 1, tile, pow2, amax_floor, scale_fmt)
    return q.data, q.scale


def dequantize(q: QTensor, dtype=jnp.float32) -> jnp.ndarray:
    """data * scale, computed in float32, returned as ``dtype`` (scheme "fp8").

    Operands of any scheme: :func:`fp8jax.schemes.dequantize` (``fp8jax.dequantize``).

    The product is rounded once to float32.  When a scale is a float32
    subnormal (tiles of tiny values) the product is formed on the bit
    patterns, so flush-to-zero on CPU does not zero it.
    """
    if q.scheme != "fp8":
        raise ValueError(
            f"quant.dequantize takes scheme 'fp8', got {q.scheme!r}: use fp8jax.dequantize"
        )
    # UE8M0 scales: their float32 values (exact), then the same products.
    q = float32_scales(q)
    fmt = q.data.dtype

    def scaled(product):
        # The codes times their scales by ``product`` of float32 operands.
        @traced_inline
        def run(data, scale):
            s = q.layout.expand(scale, data.shape)
            # FP8 -> float32 is exact; every product is rounded once to float32.
            return product(data.astype(jnp.float32), s.astype(jnp.float32)).astype(dtype)

        return run

    plain = scaled(operator.mul)
    exact = scaled(partial(exact_product, fmt=fmt))
    # The same bits as ``exact`` by float64 arithmetic.
    exact_float64 = scaled(exact_product_float64)

    if int(ml_dtypes.finfo(fmt).nmant) > 6:
        # Not an FP8 payload: the plain product.
        return plain(q.data, q.scale)

    def subnormal(scale):
        return jnp.any(_bits(scale) < 0x00800000)

    def branches(data, scale):
        # The branches take the compact codes and scales, so that each one is
        # a single fused pass over the data (no full-size operand between them).
        # The exact product by float64 arithmetic: the same bits as the
        # integer one, a third of its operations for the CPU's compiler.
        return lax.cond(subnormal(scale), exact_float64, plain, data, scale)

    def one_pass(data, scale):
        # TPU (and ROCm): both products in the one pass over the codes, one kept.
        return where(subnormal(scale), exact(data, scale), plain(data, scale))

    # A CUDA GPU does not flush subnormal float32 products (XLA's default):
    # the plain product is the exact one.
    ways = {"branches": branches, "one pass": one_pass, "plain": plain}
    return platforms.choose(
        lambda p: {"cpu": "branches", "cuda": "plain"}.get(p, "one pass"),
        ways.__getitem__,
        (q.data, q.scale),
    )
