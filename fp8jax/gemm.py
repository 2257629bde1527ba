"""The GEMM core: one place that runs one GEMM of two operands, dense or grouped.

Every quantized GEMM of the project (the three GEMMs of ``fp8jax.dot_general``
and of the grouped expert GEMM, in every format) runs through :func:`gemm`
(dense) or :func:`grouped_gemm` (which lays the expert groups out as tiles
and calls :func:`gemm`), and :func:`select_impl` decides in one place how it
runs, from one table (:data:`fp8jax.recipes.IMPLS`, :data:`AUTO`) over formats and
backends.

Canonical dense layouts (B = batch; the custom VJPs bring every GEMM here)::

    fprop  a = x  (B, M, K)   b = w  (B, K, N)   -> (B, M, N)   contract K
    dgrad  a = dy (B, M, N)   b = w  (B, K, N)   -> (B, M, K)   contract N
    wgrad  a = x  (B, M, K)   b = dy (B, M, N)   -> (B, K, N)   contract M

Operands are :class:`~fp8jax.quant.QTensor` of any scheme (quantized along
the GEMM's contraction axis, or per tensor / per block) or plain arrays (the
recipe's compute dtype).  The result is float32.

Implementations (``Recipe.impl``, see :class:`~fp8jax.recipes.Recipe` for
their numerics): "xla" (dequantize, one dot; every scheme), "chunked"
(per-run dots of the FP8 codes in bfloat16, scales applied at promotion),
"fp8" / "fp8_fast" (the same with hardware FP8 dots), "pallas" (the FP8
block-scaled kernel), "scaled_matmul" (the native MXFP8 / NVFP4 GEMM of
:mod:`fp8jax.blockscaled`), and the accumulation emulator whenever
``recipe.accumulation`` is set.  Every dot
names its algorithm (``lax.DotAlgorithmPreset``), so a recipe computes the
same thing on every backend instead of the backend's default precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import accumulate, blockscaled, host_cpu, path_record, platforms, quant
from fp8jax.formats import IEEE_FP8, KERNEL_FLOATS
from fp8jax.groups import GroupLayout, from_tiles, sum_tiles, to_tiles
from fp8jax.inline_ops import traced_inline
from fp8jax.kernels import gpu_quantize, tpu_block_gemm, tpu_quantize
from fp8jax.kernels.availability import kernel_available
from fp8jax.kernels.block_gemm import CHUNK, batched_matmul_nt
from fp8jax.kernels.grouped_block_gemm import grouped_block_scaled_matmul_aligned, grouped_wgrad
from fp8jax.layout import Layout, pad_axis, repeat_crop
from fp8jax.operands import Requantizable, kernel_settings, kernel_tiles, materialize
from fp8jax.quant import QTensor, is_quantized
from fp8jax.recipes import IMPLS, QuantSpec, Recipe

KINDS = ("fprop", "dgrad", "wgrad")
DIMS = {
    "fprop": (((2,), (1,)), ((0,), (0,))),  # (B,M,K) x (B,K,N) -> (B,M,N)
    "dgrad": (((2,), (2,)), ((0,), (0,))),  # (B,M,N) x (B,K,N) -> (B,M,K)
    "wgrad": (((1,), (1,)), ((0,), (0,))),  # (B,M,K) x (B,M,N) -> (B,K,N)
}
_ALG = lax.DotAlgorithmPreset


# --------------------------------------------------------------------------
# Which implementation runs (the one place that decides)
# --------------------------------------------------------------------------


# The one table of implementations: for each scheme of the two operands,
# the implementations a recipe may name (``fp8jax.recipes.IMPLS``, where a
# Recipe checks its ``impl``), and what "auto" runs on each platform a
# program is lowered for (the first entry that is available there).  On a CUDA GPU: "pallas" (the
# Mosaic GPU kernel) where the operands have its layouts and the target is a Hopper or later GPU, else "chunked";
# the block formats take "scaled_matmul" on a Blackwell target (>= 10.0).
# Hardware FP8 dots ("fp8", "fp8_fast") are named, never chosen: their
# named FP8 dot algorithms lie past the StableHLO version that ``jax.export``
# serializes to (4 weeks back), so a program with them does not export.  On a CPU:
# "chunked" where the host has bfloat16 dot instructions or none are known,
# else "xla".  "chunked" dots the FP8 codes as bfloat16, which is fast where
# the hardware multiplies bfloat16; a CPU without it computes every 128-long
# run's dot in float32 arithmetic, and there one float32 dot of the operands
# dequantized to float32 ("xla") is expected to be cheaper (not measured on
# such a CPU).  On a TPU: "pallas" where the layouts fit, as the Mosaic
# TPU kernel (``fp8jax.kernels.tpu_block_gemm``: FP8 codes to the matrix
# unit on Ironwood, widened to bfloat16 on the way in on v5e / v6e, the
# float32 accumulator in VMEM), else "chunked".  On a ROCm GPU: "chunked"
# (bfloat16 matrix units; "fp8" may be named).
# The paths differ in the last bits (their numerics: ``recipes.Recipe``,
# docs/model.md); each run records the path it resolved.  The block formats
# run "xla" off the native GEMM (their dequantized values are exact in
# float32).  Measured ratios: ``experiments/bench.py
# --config=configs/bench/core.py`` and docs/benchmarks.md.
AUTO: dict[tuple[str, str], tuple[str, ...]] = {
    ("fp8", "cuda"): ("pallas", "chunked"),
    ("fp8", "rocm"): ("chunked",),
    ("fp8", "cpu"): ("chunked", "xla"),
    ("fp8", "tpu"): ("pallas", "chunked"),
    ("mx", "cuda"): ("scaled_matmul", "xla"),
    ("mx", "rocm"): ("xla",),
    ("mx", "cpu"): ("xla",),
    ("mx", "tpu"): ("xla",),
    ("nvfp4", "cuda"): ("scaled_matmul", "xla"),
    ("nvfp4", "rocm"): ("xla",),
    ("nvfp4", "cpu"): ("xla",),
    ("nvfp4", "tpu"): ("xla",),
}
# Compute capabilities the CUDA paths need: FP8 tensor cores (Ada / Hopper),
# the Mosaic GPU kernel's FP8 wgmma (Hopper), native MXFP8 / NVFP4 (Blackwell).
_CUDA_FP8 = "8.9"
_CUDA_KERNEL = "9.0"
_CUDA_BLOCK_FORMATS = "10.0"


def auto_impl(scheme: str, platform: str, a=None, b=None, kind: str = "fprop") -> str:
    """What ``impl="auto"`` runs for operands of ``scheme`` on ``platform`` (see AUTO).

    ``platform``: a lowering platform ("cpu", "cuda", "rocm", "tpu"; "gpu"
    means "cuda").  ``a``, ``b``, ``kind``: the GEMM's operands, which decide
    whether the Pallas kernel's layouts fit (without them it is taken not to).
    """
    platform = "cuda" if platform == "gpu" else platform
    try:
        candidates = AUTO[scheme, platform]
    except KeyError:
        raise ValueError(
            f"no implementation for scheme {scheme!r} on platform {platform!r}"
        ) from None
    for impl in candidates:
        if _auto_available(impl, platform, a, b, kind):
            return impl
    raise ValueError(f"no available implementation for scheme {scheme!r} on {platform!r}")


def _auto_available(impl: str, platform: str, a, b, kind: str) -> bool:
    """Whether "auto" may take ``impl`` on ``platform`` for these operands."""
    if impl == "pallas":
        if a is None or not _kernel_layout_fits(a, b, kind) or not _compiled_kernel(platform):
            return False
        # Mixed E4M3 x E5M2 operands: FP8 wgmma takes them; the TPU kernel
        # is taken for one format at a time.
        return platform != "tpu" or a.data.dtype == b.data.dtype
    if impl == "scaled_matmul":
        capability = platforms.cuda_capability() if platform == "cuda" else None
        return blockscaled.native_block_gemm_available(platform, capability)
    if impl == "chunked" and platform == "cpu":
        # Unknown hardware (no /proc/cpuinfo) keeps "chunked".
        return host_cpu.has_bf16_dot() is not False
    return True


def _compiled_kernel(platform: str) -> bool:
    """Whether the Pallas kernel runs compiled (not interpreted) on ``platform``.

    On a TPU (the Mosaic kernel) and on a CUDA target of compute capability
    >= 9.0 (the Triton kernel; where such a GPU is attached, only if it
    passes the kernel's self-check, asked once, there).
    """
    if platform == "tpu":
        return True
    if platform != "cuda" or not platforms.cuda_at_least(_CUDA_KERNEL):
        return False
    return platforms.local_cuda_capability() is None or kernel_available()


def unsupported(impl: str, platform: str) -> str | None:
    """Why ``platform`` cannot run ``impl`` (a named, not an "auto" choice), or None."""
    if impl in ("fp8", "fp8_fast"):
        if platform == "cpu":
            return (
                f"impl={impl!r} (hardware FP8 dots) needs a GPU or TPU with FP8 matrix units; "
                "XLA on cpu has none (use 'chunked', the same products in bfloat16)"
            )
        if platform == "cuda" and not platforms.cuda_at_least(_CUDA_FP8):
            return (
                f"impl={impl!r} needs FP8 tensor cores (compute capability >= {_CUDA_FP8}); "
                f"the CUDA target is {platforms.cuda_capability()}"
            )
    if impl == "scaled_matmul" and not _auto_available(impl, platform, None, None, "fprop"):
        return (
            "the native MXFP8 / NVFP4 GEMM (jax.nn.scaled_matmul) needs a CUDA GPU of compute "
            f"capability >= {_CUDA_BLOCK_FORMATS}; not available on {platform}"
        )
    return None


def _kernel_layout_fits(a, b, kind: str) -> bool:
    """Both operands have the kernel's layouts (128-wide tiles/blocks, E4M3/E5M2, mixed or not)."""

    def q(op, fits_layout):
        return (
            is_quantized(op)
            and op.scheme == "fp8"
            and fits_layout(op.layout)
            and jnp.dtype(op.data.dtype) in IEEE_FP8
            and op.data.ndim == 3
        )

    def tiles_along(axis):
        return lambda lay: lay == Layout("tile", axis, CHUNK)

    def blocks(lay):
        return lay.blocked and lay.tile == CHUNK

    if kind in ("fprop", "dgrad"):
        fits = q(a, tiles_along(2)) and q(b, blocks)
    else:
        fits = q(a, tiles_along(1)) and q(b, tiles_along(1))
    return fits


def select_impl(recipe: Recipe, a, b, kind: str, platform: str | None = None) -> str:
    """How this GEMM runs on ``platform``: "plain", "emulate", "pallas", "xla", "chunked",
    "fp8", "fp8_fast" or "scaled_matmul" (the one place that decides, from IMPLS and AUTO).

    ``platform``: the lowering platform ("cpu", "cuda", "rocm", "tpu"); None
    means the default device's (what a program run here is lowered for).
    :func:`gemm` asks once per platform and lets the lowering keep the one
    it lowers for.  "plain": an operand is not quantized (the high-precision
    baseline, or a recipe that quantizes one side only): both are cast to a
    common dtype.  "emulate": the FP8 accumulation emulator, whenever
    ``recipe.accumulation`` is set.  A named implementation that the
    platform cannot run is returned all the same; :func:`unsupported` says
    why, and the program fails when it is lowered for that platform.
    """
    platform = platforms.local_platform() if platform is None else platform
    platform = "cuda" if platform == "gpu" else platform
    if not (is_quantized(a) and is_quantized(b)):
        return "plain"
    if a.scheme != b.scheme:
        raise ValueError(
            f"recipe {recipe.name!r}: a {kind} GEMM mixes schemes {a.scheme!r} and {b.scheme!r}"
        )
    scheme = a.scheme
    if recipe.accumulation is not None:
        if scheme != "fp8":
            raise ValueError("the accumulation emulator models FP8 (Hopper) tensor cores only")
        return "emulate"
    impl = recipe.impl
    if impl == "auto":
        return auto_impl(scheme, platform, a, b, kind)
    if impl not in IMPLS[scheme]:
        raise ValueError(
            f"recipe {recipe.name!r}: {scheme} operands run with impl 'auto' or one of "
            f"{IMPLS[scheme]}, not {impl!r}"
        )
    if impl == "pallas" and not _kernel_layout_fits(a, b, kind):
        raise ValueError(
            f"recipe {recipe.name!r} asks for impl='pallas' but the Pallas FP8 kernel does not "
            f"apply to this {kind} GEMM (it needs E4M3/E5M2 operands with 128-wide tiles along "
            "the contraction axis and 128x128 weight blocks)"
        )
    return impl


def _decision(recipe: Recipe, a, b, kind: str, platform: str) -> tuple[str, str]:
    """(impl, how) on ``platform``: how = "compiled" (Triton, CUDA) / "mosaic" (TPU) /
    "interpret" for "pallas",
    the refusal message for an implementation the platform cannot run, else ""."""
    impl = select_impl(recipe, a, b, kind, platform)
    why = unsupported(impl, platform)
    if why is not None:
        return impl, f"unsupported: {why}"
    if impl == "pallas":
        if not _compiled_kernel(platform):
            return impl, "interpret"
        return impl, "mosaic" if platform == "tpu" else "compiled"
    if impl in ("fp8", "fp8_fast"):
        return impl, platform
    return impl, ""


def describe_path(impl: str, recipe: Recipe, a, b, how: str = "") -> str:
    """What :func:`gemm` runs for ``impl``, in words that name its numerics.

    "plain <dtype>" (one ``lax.dot_general`` of unquantized operands),
    "xla dequant <dtype>" (codes x scale rounded to that dtype, one dot),
    "chunked" (FP8 codes per run of constant scales, exact products,
    float32 sums in XLA's order, promotion fused by XLA into one FMA), "fp8" / "fp8_fast" (the same with hardware FP8 dots),
    "pallas" (or "pallas tpu", the Mosaic TPU kernel, or "pallas interpret",
    the Mosaic GPU kernel in its interpreter),
    "scaled_matmul" (the native block-format GEMM), or "emulate" with the
    accumulation model's parameters; "unsupported <impl>" where the platform
    cannot run it.  Block formats (MXFP8, NVFP4) are prefixed with their
    scheme ("nvfp4:xla dequant float32").
    """
    if how.startswith("unsupported"):
        return f"unsupported {impl}"
    if impl == "plain":
        if is_quantized(a) or is_quantized(b):
            return "plain float32 (one side quantized)"
        return f"plain {jnp.promote_types(a.dtype, b.dtype).name}"
    prefix = "" if a.scheme == "fp8" else f"{a.scheme}:"
    if impl == "xla":
        return f"{prefix}xla dequant {recipe.dequant_dtype}"
    if impl == "emulate":
        acc = recipe.accumulation
        return (
            f"emulate block {acc.block}, {acc.frac_bits} bits, promote every "
            f"{acc.promote_every}, {acc.promote_rounding}"
        )
    if impl == "pallas" and how in ("interpret", "mosaic"):
        return "pallas interpret" if how == "interpret" else "pallas tpu"
    return prefix + impl


def dot_algorithm(dtype, platform: str | None = None) -> lax.DotAlgorithmPreset | lax.Precision:
    """The named algorithm of a dot whose operands are ``dtype``, float32 accumulation.

    ``platform``: the lowering platform (None: the default device's).
    float32: ``F32_F32_F32`` (IEEE float32 products and sums), except on TPU,
    whose compiler rejects that preset: there ``Precision.HIGHEST``, float32
    carried as several bfloat16 passes (about float32's accuracy, not its
    exact roundings: the nearest a TPU runs).  bfloat16: ``BF16_BF16_F32``,
    except on XLA CPU, whose elemental dot emitter (small dots such as
    matrix-vector products) rejects that preset: there ``Precision.HIGHEST``,
    which XLA CPU computes the same way (exact bfloat16 products, float32
    accumulation).  float16 / float64: ``Precision.HIGHEST`` (no preset on
    every backend).
    """
    platform = platforms.local_platform() if platform is None else platform
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return lax.Precision.HIGHEST if platform == "tpu" else _ALG.F32_F32_F32
    if dtype == jnp.bfloat16 and platform != "cpu":
        return _ALG.BF16_BF16_F32
    return lax.Precision.HIGHEST


def with_dot_algorithm(dtype, op: Callable[[Any], jax.Array]) -> jax.Array:
    """``op(algorithm)`` with each lowering platform's :func:`dot_algorithm` for ``dtype``.

    ``op`` builds one standard dot (``lax.dot_general``, ``lax.ragged_dot``)
    from its ``precision``; one branch per distinct algorithm, kept at lowering.
    """
    return platforms.choose(lambda p: dot_algorithm(dtype, p), lambda alg: lambda: op(alg))


def dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
    """``lax.dot_general`` with float32 accumulation and each platform's named algorithm."""
    return with_dot_algorithm(
        a.dtype,
        lambda alg: lax.dot_general(a, b, dims, precision=alg, preferred_element_type=jnp.float32),
    )


def hardware_fp8_dot(a: jax.Array, b: jax.Array, dims, *, fast: bool, platform: str):
    """FP8 x FP8 -> float32 on the platform's FP8 matrix units.

    CUDA / ROCm: the named ``ANY_F8_ANY_F8_F32`` algorithm (``..._FAST_ACCUM``
    with ``fast``: the tensor core's own accumulation, no promotion), lowered
    only for that platform (JAX's CPU lowering refuses the preset, and a
    multi-platform export lowers every branch for every platform).  TPU: the
    FP8 operands with default precision, which the compiler maps to FP8
    matrix units where the chip has them (the named presets are rejected).
    """
    if platform == "tpu":
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    alg = _ALG.ANY_F8_ANY_F8_F32_FAST_ACCUM if fast else _ALG.ANY_F8_ANY_F8_F32
    fn = partial(
        lax.dot_general, dimension_numbers=dims, precision=alg, preferred_element_type=jnp.float32
    )
    return platforms.only_on((platform,), fn, a, b)


# --------------------------------------------------------------------------
# Dense GEMM
# --------------------------------------------------------------------------


# Implementations that take a run of K at a time, so an indexed ``b`` is
# gathered one run at a time inside their loop.
_RUN_IMPLS = ("chunked", "fp8", "fp8_fast")


def gemm(
    a,
    b,
    kind: str,
    recipe: Recipe,
    b_index: jax.Array | None = None,
    out_dtype: Any = jnp.float32,
    a_source: Requantizable | None = None,
    b_codes_t: jax.Array | None = None,
) -> jax.Array:
    """One dense GEMM of the canonical layouts (module docstring), as ``out_dtype``.

    The float32 result rounded once to ``out_dtype``: the Pallas kernel
    writes it from its float32 accumulator (no float32 copy in memory), the
    other paths cast their float32 result; the values are the same.

    ``b_index`` (int (B,)): ``b`` holds E matrices and batch element i of the
    product uses ``b[b_index[i]]`` (each expert-aligned tile its expert's
    weight).  The run-wise implementations gather one run of K at a time;
    the others gather the whole (B, ., .) operand first.  Both give the same
    products and runs; XLA may sum a run's products in another float32 order.

    ``a_source``: where ``a`` is a Wgrad's x requantized from its FP8 cache
    (``fp8jax.operands.requantizable``), that cache; the Mosaic TPU kernel
    then requantizes it itself (the same codes, never written to HBM), and
    ``a`` is left unused there.

    ``b_codes_t``: an Fprop's weight codes with their last two axes swapped
    (B, N, K), where its quantizer wrote them beside ``b``'s
    (:func:`weight_both_layouts`); the Mosaic GPU kernel, which reads the
    weight K-major, takes them instead of transposing ``b``'s.  The same
    codes: nothing else reads them.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if b_codes_t is not None:
        want = tuple(b.shape[:-2]) + (b.shape[-1], b.shape[-2])
        if kind != "fprop" or b_index is not None or tuple(b_codes_t.shape) != want:
            raise ValueError(
                f"b_codes_t: an Fprop's weight codes transposed, {want}, without b_index; "
                f"got {tuple(b_codes_t.shape)} for {kind!r}"
            )
    # One decision per platform; the lowering keeps the one it lowers for.
    decisions = {p: _decision(recipe, a, b, kind, p) for p in platforms.PLATFORMS}
    path_record.note(
        kind, {p: describe_path(i, recipe, a, b, h) for p, (i, h) in decisions.items()}
    )
    out_dtype = jnp.dtype(out_dtype)
    return platforms.choose(
        decisions.__getitem__,
        lambda d: lambda: _run(d, a, b, kind, recipe, b_index, out_dtype, a_source, b_codes_t),
    )


def fprop_quantizing(
    x: jax.Array,
    b,
    spec: QuantSpec,
    recipe: Recipe,
    take: Callable[..., tuple[Any, Any]],
    out_dtype: Any = jnp.float32,
    dstate: Any = None,
    b_codes_t: jax.Array | None = None,
) -> tuple[jax.Array, Any, Any]:
    """The Fprop of ``x`` (B, M, K) and ``b``: (y as ``out_dtype``, x's operand, its
    updated delayed state), where ``take(x, dstate=dstate)`` = (operand, state) quantizes
    x as ``spec`` says along K (or takes it as it comes, quantized).  ``b_codes_t``:
    as for :func:`gemm` (given only where a CUDA target is lowered for).

    On a TPU where that is the quantizer's 1x128-tile kernel and the GEMM the
    Mosaic kernel, one kernel does both
    (``tpu_block_gemm.block_scaled_matmul_quantizing``: x read once per column
    block, its codes and scales written for the Wgrad's cache; the same bits as
    ``take`` then :func:`gemm`) where that moves fewer bytes
    (``tpu_block_gemm.quantizing_reads_less``: N up to two column blocks);
    elsewhere ``take`` then :func:`gemm`.
    """
    out_dtype = jnp.dtype(out_dtype)

    def separate(x, b, dstate):
        qx, new = take(x, dstate=dstate)
        return gemm(qx, b, "fprop", recipe, out_dtype=out_dtype, b_codes_t=b_codes_t), qx, new

    # x's operand as take gives it (shapes and layout only), asked once.
    abstract_qx = cache(lambda: jax.eval_shape(partial(take, dstate=None), x)[0])

    def decide(p: str) -> str:
        # Wide N: x read once per column block costs more than its codes read so.
        fewer = partial(tpu_block_gemm.quantizing_reads_less, b.shape[-1])
        fits = _tpu_quantizing_fits(p, x, b, spec, recipe, abstract_qx, "fprop", out_dtype, fewer)
        return "kernel" if fits else "separate"

    def build(d: str) -> Callable:
        if d == "separate":
            return separate
        return partial(
            _tpu_fprop_quantizing, spec=spec, recipe=recipe, qx=abstract_qx(), out_dtype=out_dtype
        )

    return platforms.choose(decide, build, (x, b, dstate))


def _tpu_quantizing_fits(
    p: str, t, b, spec: QuantSpec, recipe: Recipe, abstract_q, kind: str, out_dtype, fewer
) -> bool:
    """Whether, lowered for ``p``, the Mosaic TPU kernel of ``kind`` quantizes ``t``
    (B, M, K), float32 or bfloat16, in ``spec``'s 1x128 tiles itself: a TPU, where
    ``spec``'s quantizer is the row kernel and the GEMM the Mosaic kernel (on
    ``abstract_q()``, t's operand), and where ``fewer(itemsize)`` says the kernel
    moves no more bytes."""
    if p != "tpu" or is_quantized(t) or out_dtype not in KERNEL_FLOATS:
        return False
    if not kernel_tiles(spec) or t.ndim != 3 or jnp.dtype(t.dtype) not in KERNEL_FLOATS:
        return False
    row_kernel = quant.tpu_quantizer_orient(t, spec.fmt, "tile", 2, 128) == "row"
    mosaic = _decision(recipe, abstract_q(), b, kind, p) == ("pallas", "mosaic")
    return row_kernel and mosaic and fewer(jnp.dtype(t.dtype).itemsize)


def _tpu_fprop_quantizing(
    x, b: QTensor, dstate, *, spec: QuantSpec, recipe: Recipe, qx: QTensor, out_dtype
):
    """The Mosaic TPU Fprop kernel that quantizes x (B, M, K) itself, w (B, K, N) blocks
    (an online spec: no delayed state to update); ``qx``: x's operand, abstract."""
    del dstate
    fn = tpu_block_gemm.block_scaled_matmul_quantizing
    run = _tpu_quantizing_kernel("fprop", fn, spec, recipe, qx, b, out_dtype)
    y = jax.ShapeDtypeStruct(_out_shape(x, b, "fprop"), out_dtype)
    shapes = (y, jax.ShapeDtypeStruct(qx.data.shape, qx.data.dtype), qx.scale)
    y, codes, scales = _on_kernel_platform("mosaic", run, x, b.data, b.scale, out_shape=shapes)
    return y, dataclasses.replace(qx, data=codes, scale=scales), None


def _tpu_quantizing_kernel(
    kind: str, fn: Callable, spec: QuantSpec, recipe: Recipe, q: QTensor, b, out_dtype
) -> Callable:
    """The quantizing kernel ``fn`` of ``kind`` over stacked matrices, with ``spec``'s
    settings; its path recorded as the Mosaic kernel's on ``q`` (abstract) and ``b``."""
    path_record.note(kind, {"tpu": describe_path("pallas", recipe, q, b, "mosaic")})
    return _per_matrix(partial(fn, **kernel_settings(spec), out_dtype=out_dtype, interpret=False))


def fprop_with_weight(
    x: jax.Array,
    w,
    recipe: Recipe,
    take: Callable[..., tuple[Any, Any]],
    take_w: Callable[..., tuple[Any, Any]],
    out_dtype: Any = jnp.float32,
    dstate: Any = None,
    w_dstate: Any = None,
) -> tuple[jax.Array, Any, Any, Any, Any]:
    """The Fprop of ``x`` (B, M, K) and the weight ``w`` (B, K, N) with w's quantization:
    (y as ``out_dtype``, x's operand, its updated state, w's operand, its updated state),
    where ``take_w(w, dstate=w_dstate)`` = (operand, state) quantizes w as
    ``recipe.fprop.rhs`` says and ``take`` x as for :func:`fprop_quantizing`; w's
    codes in both layouts where :func:`weight_both_layouts` says, else ``take_w``
    then :func:`fprop_quantizing`.
    """
    out_dtype = jnp.dtype(out_dtype)
    # x's operand as take gives it (shapes and layout only), asked once.
    abstract_qx = cache(lambda: jax.eval_shape(partial(take, dstate=None), x)[0])

    def fprop(qw, codes_t, x, dstate):
        spec = recipe.fprop.lhs
        return fprop_quantizing(x, qw, spec, recipe, take, out_dtype, dstate, b_codes_t=codes_t)

    def kernel_reads(p: str, qw: QTensor) -> bool:
        return _decision(recipe, abstract_qx(), qw, "fprop", p) == ("pallas", "compiled")

    (y, qx, new), qw, new_w = weight_both_layouts(
        w, recipe, take_w, w_dstate, fprop, (x, dstate), kernel_reads
    )
    return y, qx, new, qw, new_w


def weight_both_layouts(
    w,
    recipe: Recipe,
    take_w: Callable[..., tuple[Any, Any]],
    w_dstate: Any,
    fprop: Callable[..., Any],
    operands: tuple[Any, ...],
    kernel_reads: Callable[[str, QTensor], bool],
) -> tuple[Any, Any, Any]:
    """(``fprop(qw, codes_t, *operands)``, w's operand qw, its updated state), where
    ``take_w(w, dstate=w_dstate)`` = (qw, state) quantizes the weight ``w`` (E, K, N)
    as ``recipe.fprop.rhs`` says and ``codes_t`` is None or qw's codes transposed
    (E, N, K).

    On a Hopper CUDA target whose quantizers are the Mosaic GPU ones, where
    ``recipe.fprop.rhs`` quantizes w (a bfloat16 / float32 array) online in
    128x128 blocks and ``kernel_reads(p, qw)`` says a Mosaic GPU GEMM reads
    qw there, one kernel writes w's codes in both layouts
    (``mgpu_quantize.quantize_block_both``): the Fprop reads the transposed
    ones (K-major, the only layout of FP8 ``wgmma``), the Dgrad the returned
    operand's as stored.  The same codes and scales as ``take_w``'s, and no
    transpose of them in XLA.  Elsewhere ``take_w``, and codes_t None.
    """

    def separate(w, w_dstate, *operands):
        qw, new_w = take_w(w, dstate=w_dstate)
        return fprop(qw, None, *operands), qw, new_w

    # w's operand as take_w gives it (shapes and layout only), asked once.
    abstract_qw = cache(lambda: jax.eval_shape(partial(take_w, dstate=None), w)[0])

    def both_layouts(w, w_dstate, *operands):
        del w_dstate  # an online spec: no state
        run = partial(quant.gpu_kernels().quantize_block_both, **kernel_settings(recipe.fprop.rhs))
        codes, codes_t, scales = gpu_quantize.on_gpu(run, w)
        # take_w's operand (its layout and metadata), with the kernel's codes and scales.
        qw = dataclasses.replace(abstract_qw(), data=codes, scale=scales)
        return fprop(qw, codes_t, *operands), qw, None

    def decide(p: str) -> str:
        fits = _both_layouts_fit(p, w, recipe.fprop.rhs, abstract_qw)
        return "both layouts" if fits and kernel_reads(p, abstract_qw()) else "separate"

    build = {"separate": separate, "both layouts": both_layouts}.__getitem__
    return platforms.choose(decide, build, (w, w_dstate) + tuple(operands))


def _both_layouts_fit(p: str, w, spec: QuantSpec, abstract_qw) -> bool:
    """Whether, lowered for ``p``, one Mosaic GPU kernel quantizes ``w`` (E, K, N) as
    ``spec`` says in both layouts: a CUDA target whose quantizers are the Mosaic GPU
    ones (the Triton ones write one layout), w a bfloat16 / float32 array that
    ``spec`` quantizes online in the block kernel's 128x128 blocks into float32 scales."""
    if p != "cuda" or is_quantized(w) or w.ndim != 3 or not kernel_tiles(spec, "block"):
        return False
    if quant.tpu_quantizer_orient(w, spec.fmt, "block", 1, spec.tile) != "block":
        return False
    if getattr(quant.gpu_kernels(), "quantize_block_both", None) is None:
        return False
    qw = abstract_qw()
    return isinstance(qw, QTensor) and qw.tensor_scale is None and qw.scale.dtype == jnp.float32


def dgrad_quantizing(
    dy: jax.Array,
    b,
    spec: QuantSpec,
    recipe: Recipe,
    take_both: Callable[..., tuple[Any, Any, Any]],
    take_wgrad: Callable[..., tuple[Any, Any]],
    out_dtype: Any = jnp.float32,
    dstate: Any = None,
    wgrad_spec: QuantSpec | None = None,
) -> tuple[jax.Array, Any, Any]:
    """The Dgrad of ``dy`` (B, M, N) and ``b`` (w, (B, K, N)), with dy's Wgrad operand:
    (dx as ``out_dtype``, dy's Wgrad operand, dy's updated delayed state).

    ``take_both(dy, dstate=dstate)`` = (Dgrad operand, Wgrad operand, state)
    quantizes dy for both GEMMs (``spec`` along N for the Dgrad), and
    ``take_wgrad(dy)`` = (Wgrad operand, _) for the Wgrad alone.  On a TPU
    where the Dgrad operand is 1x128 tiles and the GEMM the Mosaic kernel,
    and dx has one column block of ``tpu_block_gemm.DENSE_BLOCK_N`` (bfloat16
    dy; ``tpu_block_gemm.quantizing_reads_less`` with ``codes_only_here``),
    the Dgrad kernel quantizes dy's tiles itself
    (``tpu_block_gemm.block_scaled_matmul_nt_quantizing``, the same bits) and
    only the Wgrad's 128-token tiles are written: one pass over dy fewer, the
    same bytes.  Where ``wgrad_spec`` (what ``take_wgrad`` quantizes with) has the
    Dgrad spec's settings, the kernel writes those 128-token tiles too, from
    its own read of dy (``col_codes``): dy is read once in all.  Elsewhere
    ``take_both`` then :func:`gemm`.
    """
    out_dtype = jnp.dtype(out_dtype)

    def separate(dy, b, dstate):
        qdy_d, qdy_w, new = take_both(dy, dstate=dstate)
        return gemm(qdy_d, b, "dgrad", recipe, out_dtype=out_dtype), qdy_w, new

    # dy's Dgrad operand as take_both gives it (shapes and layout only), asked once.
    abstract_qdy = cache(lambda: jax.eval_shape(partial(take_both, dstate=None), dy)[0])

    def decide(p: str) -> str:
        # dx's columns are w's K; dy's own read is its column quantizer's.
        fewer = partial(tpu_block_gemm.quantizing_reads_less, b.shape[1], codes_only_here=True)
        fits = _tpu_quantizing_fits(p, dy, b, spec, recipe, abstract_qdy, "dgrad", out_dtype, fewer)
        return "kernel" if fits else "separate"

    def build(d: str) -> Callable:
        if d == "separate":
            return separate
        return partial(
            _tpu_dgrad_quantizing,
            spec=spec,
            recipe=recipe,
            qdy=abstract_qdy(),
            take_wgrad=take_wgrad,
            out_dtype=out_dtype,
            wgrad_spec=wgrad_spec,
        )

    return platforms.choose(decide, build, (dy, b, dstate))


def _tpu_dgrad_quantizing(
    dy,
    b: QTensor,
    dstate,
    *,
    spec: QuantSpec,
    recipe: Recipe,
    qdy: QTensor,
    take_wgrad,
    out_dtype,
    wgrad_spec: QuantSpec | None,
):
    """The Mosaic TPU Dgrad kernel that quantizes dy (B, M, N) itself against w (B, K, N)
    blocks, and dy's Wgrad operand (an online spec: no delayed state to update):
    the kernel's own 128-token tiles where :func:`_dgrad_writes_wgrad_tiles`, else
    from ``take_wgrad``; ``qdy``: dy's Dgrad operand, abstract."""
    del dstate
    fn = tpu_block_gemm.block_scaled_matmul_nt_quantizing
    out = jax.ShapeDtypeStruct(_out_shape(dy, b, "dgrad"), out_dtype)
    qdy_w = jax.eval_shape(take_wgrad, dy)[0]
    if not _dgrad_writes_wgrad_tiles(dy, spec, wgrad_spec, qdy_w):
        run = _tpu_quantizing_kernel("dgrad", fn, spec, recipe, qdy, b, out_dtype)
        dx = _on_kernel_platform("mosaic", run, dy, b.data, b.scale, out_shape=out)
        return dx, take_wgrad(dy)[0], None
    fn = partial(fn, col_codes=True)
    run = _tpu_quantizing_kernel("dgrad", fn, spec, recipe, qdy, b, out_dtype)
    shapes = (out, qdy_w.data, qdy_w.scale)
    dx, codes, scales = _on_kernel_platform("mosaic", run, dy, b.data, b.scale, out_shape=shapes)
    return dx, dataclasses.replace(qdy_w, data=codes, scale=scales), None


def _dgrad_writes_wgrad_tiles(dy, spec: QuantSpec, wgrad_spec, qdy_w) -> bool:
    """Whether the quantizing Dgrad kernel's 128-token tiles of ``dy`` (B, M, N)
    (``col_codes``) are dy's Wgrad operand ``qdy_w`` (abstract): ``wgrad_spec`` an
    online FP8 spec of 128-long tiles with the Dgrad ``spec``'s settings, and
    ``qdy_w`` those tiles along M in the column quantizer's form (codes as dy,
    float32 scales (B, ceil(M/128), N))."""
    if wgrad_spec is None or not kernel_tiles(wgrad_spec):
        return False
    if kernel_settings(wgrad_spec) != kernel_settings(spec) or not isinstance(qdy_w, QTensor):
        return False
    b, m, n = dy.shape
    return (
        qdy_w.layout == Layout("tile", 1, 128)
        and qdy_w.tensor_scale is None
        and qdy_w.data.shape == dy.shape
        and qdy_w.data.dtype == kernel_settings(spec)["fmt"]
        and qdy_w.scale.shape == (b, -(-m // 128), n)
        and qdy_w.scale.dtype == jnp.float32
    )


def _out_shape(a, b, kind: str) -> tuple[int, int, int]:
    """(B, rows, cols) of a canonical GEMM's result (module docstring)."""
    if kind == "fprop":
        return a.shape[0], a.shape[1], b.shape[2]
    if kind == "dgrad":
        return a.shape[0], a.shape[1], b.shape[1]
    return a.shape[0], a.shape[2], b.shape[2]


def _run(
    decision: tuple[str, str],
    a,
    b,
    kind: str,
    recipe: Recipe,
    b_index,
    out_dtype,
    a_source=None,
    b_codes_t=None,
) -> jax.Array:
    """The GEMM as ``decision`` = (impl, how) of :func:`_decision` runs it, as ``out_dtype``."""
    impl, how = decision
    if how.startswith("unsupported: "):
        return platforms.refuse(
            f"recipe {recipe.name!r}: {how[len('unsupported: ') :]}",
            _out_shape(a, b, kind),
            out_dtype,
        )
    if b_index is not None and impl not in _RUN_IMPLS:
        b, b_index = take_batch(b, b_index), None
    if impl == "pallas" and out_dtype in KERNEL_FLOATS:
        # The kernel rounds its float32 accumulator to the caller's dtype itself.
        return _pallas(
            a, b, kind, how=how, out_dtype=out_dtype, a_source=a_source, b_codes_t=b_codes_t
        )
    return _run_float32(impl, how, a, b, kind, recipe, b_index, a_source, b_codes_t).astype(
        out_dtype
    )


def _run_float32(
    impl: str, how: str, a, b, kind: str, recipe: Recipe, b_index, a_source=None, b_codes_t=None
) -> jax.Array:
    """The GEMM on ``impl`` with its float32 result (``b`` already gathered where
    ``impl`` does not gather a run at a time)."""
    if impl == "plain":
        if is_quantized(a) or is_quantized(b):
            # One side quantized: dequantize it to float32 and dot in float32.
            dt = jnp.float32
        else:
            dt = jnp.promote_types(a.dtype, b.dtype)
        return dot(materialize(a, dt), materialize(b, dt), DIMS[kind])
    if impl == "xla":
        dt = jnp.dtype(recipe.dequant_dtype)
        return dot(materialize(a, dt), materialize(b, dt), DIMS[kind])
    if impl == "pallas":
        return _pallas(a, b, kind, how=how, a_source=a_source, b_codes_t=b_codes_t)
    if impl == "scaled_matmul":
        lhs, rhs = _orient(a, b, kind)
        # The native block GEMM takes both operands with the contraction last.
        return blockscaled.scaled_matmul(lhs, _swap12(rhs))
    lhs, rhs = _orient(a, b, kind)
    k = lhs.data.shape[2]
    a_codes, a_s, ga = _k_runs(lhs, 2)
    b_codes, b_s, gb = _k_runs(rhs, 1)
    group, a_s, b_s = _common_groups(k, ga, a_s, gb, b_s)
    if impl == "emulate":
        return accumulate.emulated_gemm(
            a_codes, a_s, b_codes, b_s, group=group, acc=recipe.accumulation
        )
    return _chunked(a_codes, a_s, b_codes, b_s, group, impl, b_index, platform=how)


def _swap12(op):
    """Swap axes 1 and 2 of a 3-d operand, scales and layout metadata included."""
    return op.swapaxes(1, 2) if is_quantized(op) else jnp.swapaxes(op, 1, 2)


def _orient(a, b, kind: str):
    """(lhs (B, M', C), rhs (B, C, N')) with the contraction last in lhs, middle in rhs."""
    if kind == "fprop":
        return a, b
    if kind == "dgrad":
        return a, _swap12(b)
    return _swap12(a), b


def _k_runs(q: QTensor, k_axis: int):
    """(codes, scales, run length g) of a 3-d operand contracted along ``k_axis`` (1 or 2).

    The scales come out with ``k_axis`` of size ceil(K / g) and the other
    axes at full size: each scale covers g consecutive elements along K.
    """
    scales, g = q.layout.k_runs(q.scale, q.data.shape, k_axis)
    return q.data, scales, g


def _common_groups(k: int, ga: int, a_s, gb: int, b_s):
    """Re-express both operands' scales on one run length along K."""
    if ga >= k and gb >= k:
        return k, a_s, b_s
    if ga == gb:
        return ga, a_s, b_s
    if ga >= k:
        return gb, jnp.repeat(a_s, b_s.shape[1], axis=2), b_s
    if gb >= k:
        return ga, a_s, jnp.repeat(b_s, a_s.shape[2], axis=1)
    g = math.gcd(ga, gb)
    runs = -(-k // g)
    return g, repeat_crop(a_s, 2, ga // g, runs), repeat_crop(b_s, 1, gb // g, runs)


def _chunked(
    a_codes, a_s, b_codes, b_s, group: int, impl: str, b_index=None, platform: str = ""
) -> jax.Array:
    """Runs of ``group`` along K: dot of the codes, times both scales, summed in float32.

    ``b_index``: the b side holds E matrices, batch element i uses b[b_index[i]].

    "chunked": codes in bfloat16 (every E4M3/E5M2 code is exact in it) with
    ``BF16_BF16_F32``; "fp8" / "fp8_fast": the FP8 codes with the hardware
    FP8 algorithm (with / without the tensor core's promotion) of ``platform``
    (:func:`hardware_fp8_dot`).
    """
    runs = -(-a_codes.shape[2] // group)

    def whole_runs(a, b):
        # Zero codes past K add nothing to any run.  Padded after the widening
        # where there is one: XLA's CPU compiler moves FP8 through float16, so
        # a pad of the codes themselves is two conversions more.
        return pad_axis(a, 2, group), pad_axis(b, 1, group)

    dims = (((2,), (1,)), ((0,), (0,)))
    if impl == "chunked":
        dot_fn = partial(dot, dims=dims)
    else:
        dot_fn = partial(hardware_fp8_dot, dims=dims, fast=impl == "fp8_fast", platform=platform)

    def codes(c):
        # "chunked": every E4M3 / E5M2 code is exact in bfloat16.
        return c.astype(jnp.bfloat16) if impl == "chunked" else c

    def per_batch(t):
        return t if b_index is None else t[b_index]

    # fl32(s_a * s_b) of the first run: the whole scale of a one-run GEMM.
    first_scale = a_s[:, :, 0:1] * per_batch(b_s[:, 0:1, :])
    if runs == 1:
        # One run (per-tensor or per-row scales): one dot, scaled once.
        return dot_fn(*whole_runs(codes(a_codes), codes(per_batch(b_codes)))) * first_scale
    # The loop widens one run at a time: the codes are padded as they are, so
    # that one run's operands are live at a time, not a widened copy of all.
    a_codes, b_codes = whole_runs(a_codes, b_codes)

    @traced_inline
    def run(r):
        # The run is sliced (gathered per batch element, widened) inside the
        # loop, so one run's operands are live at a time, not a widened copy
        # of all of them.
        ar = codes(lax.dynamic_slice_in_dim(a_codes, r * group, group, axis=2))
        br = codes(per_batch(lax.dynamic_slice_in_dim(b_codes, r * group, group, axis=1)))
        sar = lax.dynamic_slice_in_dim(a_s, r, 1, axis=2)  # (B, M, 1)
        sbr = per_batch(lax.dynamic_slice_in_dim(b_s, r, 1, axis=1))  # (B, 1, N)
        # The run's float32 partial sum times fl32(s_a * s_b).
        return dot_fn(ar, br) * (sar * sbr)

    # The zero carry is computed from this GEMM's scales (min(s_a s_b, 0) is
    # +0 for every scale >= 0, NaN only where the product would be NaN
    # anyway): a constant zero carry is one XLA materializes ahead of time,
    # every GEMM's at once, and keeps alive until its loop runs.
    zero = jnp.minimum(first_scale, 0.0)
    acc, _ = lax.scan(lambda acc, r: (acc + run(r), None), zero, jnp.arange(runs))
    return acc


# The dense Mosaic TPU kernels per GEMM kind.
_MOSAIC_KERNELS = {
    "fprop": tpu_block_gemm.block_scaled_matmul,
    "dgrad": tpu_block_gemm.block_scaled_matmul_nt,
    "wgrad": tpu_block_gemm.block_scaled_matmul_tn,
}


def _pallas(
    a: QTensor,
    b: QTensor,
    kind: str,
    *,
    how: str,
    out_dtype=jnp.float32,
    a_source: Requantizable | None = None,
    b_codes_t: jax.Array | None = None,
) -> jax.Array:
    """The block-scaled Pallas kernel, writing ``out_dtype`` from its float32 accumulator:
    the Mosaic GPU kernel compiled for a CUDA target (how "compiled") or in its
    interpreter elsewhere (how "interpret", for tests), the Mosaic TPU kernel on a
    TPU (how "mosaic").

    The Mosaic GPU kernel reads both operands K-major (the contraction axis
    minor), the only layout of Hopper's FP8 ``wgmma``: Dgrad's weight is that
    as stored; Fprop's weight (unless its quantizer wrote ``b_codes_t``, the
    codes transposed) and Wgrad's two token-tiled operands are transposed in
    XLA first (FP8 codes, exact; their scales only change places).
    """
    # The result's shape: the kernel is traced only when a program is lowered
    # for its platform (fp8jax.platforms.only_on).
    out = jax.ShapeDtypeStruct(_result_shape(a.data.shape, b.data.shape, kind), out_dtype)
    if how == "mosaic":
        if kind == "wgrad" and a_source is not None:
            return _tpu_wgrad_from_cache(a_source, b, out_dtype, out)
        return _tpu_pallas(a, b, kind, out_dtype, out)
    if kind == "fprop":
        # x (B, M, K) 1x128 tiles; w (B, K, N) 128x128 blocks -> w^T (B, N, K).
        w_t = _swap12(b.data) if b_codes_t is None else b_codes_t
        args = (a.data, a.scale, w_t, b.scale)
    elif kind == "dgrad":
        # dy (B, M, N) tiles along N; w (B, K, N) is K-major for a contraction over N,
        # and the kernel reads its block scales (B, K/128, N/128) as stored (b_scale_nk).
        args = (a.data, a.scale, b.data, b.scale)
    else:
        # x (B, T, K) and dy (B, T, N) in 128x1 tiles along the tokens T:
        # x^T (B, K, T) and dy^T (B, N, T), the tile scales per column of each.
        args = (_swap12(a.data), _swap12(a.scale), _swap12(b.data), b.scale)
    run = partial(
        batched_matmul_nt,
        b_cols=kind == "wgrad",
        b_scale_nk=kind == "dgrad",
        out_dtype=out_dtype,
        interpret=how == "interpret",
    )
    return _on_kernel_platform(how, run, *args, out_shape=out)


def _result_shape(a: tuple[int, ...], b: tuple[int, ...], kind: str) -> tuple[int, int, int]:
    """The (B, rows, cols) a GEMM of ``kind`` writes from canonical operands of shapes
    ``a`` and ``b`` (module docstring)."""
    if kind == "fprop":
        return a[0], a[1], b[2]
    if kind == "dgrad":
        return a[0], a[1], b[1]
    return a[0], a[2], b[2]


def _tpu_pallas(a: QTensor, b: QTensor, kind: str, out_dtype, out) -> jax.Array:
    """The Mosaic TPU kernel of ``kind`` on the canonical operands as stored."""
    # fprop: (B, M, K) tiles along K x (B, K, N) blocks; dgrad: dy (B, M, N) x
    # w (B, K, N) contracted over N (w is the kernels' "nt" operand as stored);
    # wgrad: x (B, M, K) and dy (B, M, N), both in 128x1 tiles along the tokens M.
    fn = partial(_MOSAIC_KERNELS[kind], out_dtype=out_dtype, interpret=False)
    run = _per_matrix(fn)
    return _on_kernel_platform("mosaic", run, a.data, a.scale, b.data, b.scale, out_shape=out)


def _per_matrix(fn: Callable) -> Callable:
    """A 2-D kernel entry point over arguments whose leading axis stacks matrices:
    one call where there is one matrix (no batching around the kernel), else vmap."""

    def run(*args):
        if args[0].shape[0] == 1:
            return jax.tree.map(lambda t: t[None], fn(*(a[0] for a in args)))
        return jax.vmap(fn)(*args)

    return run


def _tpu_wgrad_from_cache(src: Requantizable, b: QTensor, out_dtype, out) -> jax.Array:
    """The Mosaic TPU Wgrad of x's FP8 cache (B, M, K), tiles along K, requantized in the
    kernel into 128-token tiles, and dy (B, M, N) in 128-token tiles."""
    # The dequantization's choice for every element, from the whole cache's scales.
    flag = jnp.broadcast_to(tpu_quantize.subnormal_scales(src.cached.scale), b.data.shape[:1])
    fn = partial(
        tpu_block_gemm.block_scaled_matmul_tn_requant,
        **kernel_settings(src.spec),
        out_dtype=out_dtype,
        interpret=False,
    )
    args = (src.cached.data, src.cached.scale, flag, b.data, b.scale)
    return _on_kernel_platform("mosaic", _per_matrix(fn), *args, out_shape=out)


def _on_kernel_platform(how: str, fn: Callable, *args, out_shape=None) -> Any:
    """``fn(*args)``, lowered only for the platform of a compiled kernel (``how``):
    any other platform of a multi-platform export sees dead zeros.  With
    ``out_shape``, the kernel is traced when a program is lowered for that platform."""
    if how == "interpret":
        return fn(*args)
    platform = ("tpu",) if how == "mosaic" else ("cuda",)
    return platforms.only_on(platform, fn, *args, out_shape=out_shape)


# --------------------------------------------------------------------------
# Grouped (MoE expert) GEMM on the expert-aligned tile layout
# --------------------------------------------------------------------------


def tile_rows(op, layout: GroupLayout):
    """(M, C) rows (quantized or array) -> (T, tile, C) expert-aligned tiles.

    Row-local scales (1xN tiles and rows along C, or one per tensor) move with
    their rows; padding rows are zero codes with unit scales.
    """
    if not is_quantized(op):
        return to_tiles(op, layout)
    # Padding rows get unit scales.
    lay, scale = op.layout.split_rows(op.scale, lambda s: to_tiles(s, layout, fill=1))
    return dataclasses.replace(op, data=to_tiles(op.data, layout), scale=scale, layout=lay)


def take_batch(op, index: jax.Array):
    """Batch elements ``index`` of a (E, ., .) operand (quantized or array)."""
    return op.take(index) if is_quantized(op) else op[index]


def grouped_gemm(
    a,
    b,
    layout: GroupLayout,
    kind: str,
    recipe: Recipe,
    num_groups: int,
    out_dtype=jnp.float32,
    b_codes_t: jax.Array | None = None,
):
    """One grouped GEMM, accumulated in float32 and rounded once to ``out_dtype``.

    fprop: a = x (M, K) rows, b = w (E, K, N) -> (M, N);
    dgrad: a = dy (M, N) rows (or its (T, tile, N) tiles), b = w (E, K, N) -> (M, K);
    wgrad: a = x (T, tile, K), b = dy (T, tile, N) already in tiles -> (E, K, N).
    Rows in no group give 0.  Runs as a batched :func:`gemm` over the tiles
    of ``layout`` (or a grouped kernel, which reads that layout and writes
    ``out_dtype`` itself: no float32 result in memory).  ``b_codes_t``: the
    Fprop's weight codes transposed (E, N, K), which the Mosaic GPU grouped
    kernel then reads in place of a transpose (:func:`weight_both_layouts`).
    """
    # The kernels write bfloat16 or float32; another dtype is rounded from float32.
    kernel_dtype = jnp.dtype(out_dtype) if out_dtype in KERNEL_FLOATS else jnp.dtype(jnp.float32)
    with path_record.scope("expert"):
        if kind == "wgrad":
            y = _grouped_wgrad(a, b, layout, recipe, num_groups, kernel_dtype)
        else:
            y = _grouped_rows(a, b, layout, kind, recipe, kernel_dtype, b_codes_t)
    return y.astype(out_dtype)


def _token_tiles(op) -> bool:
    """FP8 codes in expert-aligned 128-token tiles, one scale per tile and column."""
    return (
        is_quantized(op)
        and op.scheme == "fp8"
        and op.layout.tiled
        and op.axis == 1
        and op.tile == CHUNK
        and len(op.shape) == 3
        and op.shape[1] == CHUNK
    )


# How a "pallas" decision runs a kernel (not a refusal).
_KERNEL_HOWS = ("compiled", "interpret", "mosaic")


def _grouped_path(how: str) -> str:
    """The path record's name of a grouped kernel run ``how`` (a "pallas" decision's)."""
    return "pallas grouped" + {"interpret": " interpret", "mosaic": " tpu"}.get(how, "")


def _grouped_wgrad(a, b, layout: GroupLayout, recipe: Recipe, num_groups: int, out_dtype):
    """The wgrad grouped GEMM of :func:`grouped_gemm`.

    Where "pallas" runs and both operands are FP8 token tiles, a grouped
    Wgrad kernel: each expert's tiles (each one 128-long K run) promoted into
    one float32 accumulator, in VMEM on a TPU
    (``tpu_block_gemm.grouped_wgrad``), in registers on a Hopper GPU or in
    Mosaic GPU's interpreter (``grouped_block_gemm.grouped_wgrad``).
    Elsewhere each token tile's GEMM is complete (scaled, promoted) before
    the tiles of a group are added in float32, through a (tiles, K, N)
    float32 intermediate.  Both add the tiles' promoted partials in tile
    order; a kernel may fuse each promotion into the add (one rounding), and
    under the accumulation emulator's FFMA promotion a dense GEMM would fold
    every chain into one accumulator, so the paths can differ in the last bits.
    """
    fits = layout.tile == CHUNK and _token_tiles(a) and _token_tiles(b)
    kernel = {
        p: how
        for p in platforms.PLATFORMS
        for impl, how in [_decision(recipe, a, b, "wgrad", p)]
        if fits and impl == "pallas" and how in _KERNEL_HOWS
    }
    others = tuple(p for p in platforms.PLATFORMS if p not in kernel)
    if kernel:
        path_record.note("wgrad", {p: _grouped_path(how) for p, how in kernel.items()})

    def build(how: str):
        if how:
            tpu = how == "mosaic"
            run = partial(
                tpu_block_gemm.grouped_wgrad if tpu else grouped_wgrad,
                num_groups=num_groups,
                out_dtype=out_dtype,
                interpret=how == "interpret",
            )
            args = (a.data, a.scale, b.data, b.scale, layout.tile_group)
            # (E, K, N): declared, so a compiled kernel is traced only when a
            # program is lowered for its platform.
            out = jax.ShapeDtypeStruct((num_groups, a.shape[2], b.shape[2]), out_dtype)
            return lambda: _on_kernel_platform(how, run, *args, out_shape=out)

        def per_tile():
            with path_record.only(others):
                dw = sum_tiles(gemm(a, b, "wgrad", recipe), layout, num_groups)
            return dw.astype(out_dtype)

        return per_tile

    return platforms.choose(lambda p: kernel.get(p, ""), build)


def grouped_kernels(a, b, layout: GroupLayout, kind: str, recipe: Recipe) -> dict:
    """{platform: (impl, how)} of the platforms where a grouped kernel runs the fprop /
    dgrad grouped GEMM of ``a`` (rows or tiles) and ``b``: "pallas" decisions on
    128-row tiles (other tile lengths run the dense kernel per tile)."""
    # Rows: their tiles' shapes and layout (the decision reads no values).
    a_t = a if len(a.shape) == 3 else jax.eval_shape(tile_rows, a, layout)
    decisions = {p: _decision(recipe, a_t, b, kind, p) for p in platforms.PLATFORMS}
    return {p: d for p, d in decisions.items() if d[0] == "pallas" and layout.tile == CHUNK}


def _grouped_rows(a, b, layout: GroupLayout, kind: str, recipe: Recipe, out_dtype, b_codes_t):
    """The fprop / dgrad grouped GEMM of :func:`grouped_gemm`."""
    # Rows (M, C), or operands already laid out in tiles (T, tile, C).
    a_t = a if len(a.shape) == 3 else tile_rows(a, layout)
    kernel = grouped_kernels(a_t, b, layout, kind, recipe)
    others = tuple(p for p in platforms.PLATFORMS if p not in kernel)
    if kernel:
        path_record.note(kind, {p: _grouped_path(how) for p, (_, how) in kernel.items()})

    def build(d):
        if d[0] == "pallas":
            return lambda: _grouped_kernel(
                a_t, b, layout, kind, how=d[1], out_dtype=out_dtype, b_codes_t=b_codes_t
            )

        def dense_tiles():
            # Each tile's expert (padding tiles take expert 0).
            tile_expert = jnp.maximum(layout.tile_group, 0)
            with path_record.only(others):
                y = gemm(a_t, b, kind, recipe, b_index=tile_expert)
            return from_tiles(y, layout).astype(out_dtype)

        return dense_tiles

    return platforms.choose(lambda p: kernel.get(p, ("dense tiles", "")), build)


def _grouped_kernel(
    a_t, b, layout: GroupLayout, kind: str, *, how: str, out_dtype, b_codes_t=None
) -> jax.Array:
    """The grouped kernel (Mosaic GPU, or Mosaic TPU where ``how`` is "mosaic") on the
    aligned rows and each tile's expert id (``how`` as in :func:`_pallas`)."""
    mp = layout.src_row.shape[0]
    b_data, b_scale, b_layout = b.data, b.scale, "kn" if kind == "fprop" else "nk"
    if b_codes_t is not None and how != "mosaic":
        # The Fprop's weight codes K-major as their quantizer wrote them: the
        # kernel's own layout, with the block scales beside them (E, Nc, Kc),
        # a transpose of E x K/128 x N/128 float32 in place of one of the codes.
        b_data, b_scale, b_layout = b_codes_t, jnp.swapaxes(b.scale, 1, 2), "nk"

    if how == "mosaic":
        kernel = tpu_block_gemm.grouped_block_scaled_matmul_aligned
    else:
        kernel = grouped_block_scaled_matmul_aligned

    def run(a_data, a_scale, b_data, b_scale, tile_group):
        return kernel(
            a_data.reshape(mp, -1),
            a_scale.reshape(mp, -1),
            b_data,
            b_scale,
            tile_group,
            out_dtype=out_dtype,
            b_layout=b_layout,
            interpret=how == "interpret",
        )

    args = (a_t.data, a_t.scale, b_data, b_scale, layout.tile_group)
    # (rows, N), N the output columns (_out_shape's convention): declared, so a
    # compiled kernel is traced only when a program is lowered for its platform.
    n = b.shape[2] if kind == "fprop" else b.shape[1]
    y = _on_kernel_platform(how, run, *args, out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype))
    return from_tiles(y.reshape(layout.num_tiles, layout.tile, -1), layout)
