"""GEMM operands in the block-scaled formats (MXFP8, NVFP4) and their native GEMM.

:func:`fp8jax.schemes.quantize` quantizes an operand here when its QuantSpec
names a block format ("mxfp8" or "nvfp4").  The operand is quantized along the GEMM's contraction
axis (:mod:`fp8jax.microscaling`): 1 x block runs (``granularity="tile"``)
or, for NVFP4 weights, 16 x 16 blocks over the operand's two matrix axes
(``granularity="block"``; the canonical layouts keep both matrix axes last,
so one block grid serves W and W^T alike).

Wgrad options of NVIDIA's NVFP4 recipe:

* random Hadamard transform: both Wgrad operands are transformed along the
  token (contraction) axis with the same seeded signs
  (:func:`fp8jax.hadamard.rht`) before quantization, which cancels in the
  product in exact arithmetic;
* stochastic rounding of the gradient: the key is derived from the recipe's
  seed, a per-operand salt and a checksum of the operand's bits, so a run is
  reproducible, two different tensors (steps) get different draws, and the
  same gradient quantized for Dgrad and for Wgrad gets independent ones.

The native product (:func:`scaled_matmul`): where ``jax.nn.scaled_matmul``
exists and the device multiplies block-scaled operands natively (cuDNN on a
Blackwell GPU, compute capability >= 10), the quantized data and block scales
go to it and the NVFP4 tensor scales multiply its float32 result.  Which
implementation a block-format GEMM uses is decided with every other GEMM's,
in :func:`fp8jax.gemm.select_impl`; elsewhere it runs as "xla": both operands
dequantized to float32 (``data * scale``, exact for MXFP8 except below
float32's normal range, one rounding for NVFP4's tensor scale) and one dot
with float32 accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax import hadamard, microscaling, platforms
from fp8jax.formats import BLOCK_FORMATS
from fp8jax.layout import Layout, pad_axis
from fp8jax.quant import QTensor


def is_block_format(fmt: str | None) -> bool:
    """True for the block-scaled formats this module handles ("mxfp8", "nvfp4")."""
    return fmt in BLOCK_FORMATS


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer (uint32 -> uint32, every input bit reaches every output bit)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def operand_key(seed: int, salt: int, t: jax.Array) -> jax.Array:
    """A PRNG key for stochastic rounding of ``t``: seed, salt and a hash of t's bits.

    The hash is the wrapping uint32 sum over elements of a mixing function of
    (float32 bit pattern, position): a function of the tensor, so the same
    inputs give the same draws (a run is reproducible), while a different
    tensor (the next step's gradient, or this one scaled by 2, which a plain
    sum of bit patterns can miss) gets new ones.
    """
    bits = lax.bitcast_convert_type(t.astype(jnp.float32), jnp.uint32).reshape(-1)
    pos = lax.iota(jnp.uint32, bits.shape[0]) * jnp.uint32(0x9E3779B9)
    checksum = jnp.sum(_fmix32(bits ^ pos), dtype=jnp.uint32)
    key = jax.random.fold_in(jax.random.key(seed), salt)
    return jax.random.fold_in(key, checksum)


def quantize_block_operand(
    t: jax.Array,
    fmt: str,
    granularity: str,
    caxis: int,
    *,
    key: jax.Array | None = None,
    scale_rounding: str = "floor",
) -> QTensor:
    """Quantize one GEMM operand to ``fmt`` along its contraction axis ``caxis``.

    ``granularity="block"`` uses 2-d blocks over the last two axes, which
    must then contain ``caxis``.  ``scale_rounding``: MXFP8's E8M0 scale rule
    ("floor" or "ceil", :func:`fp8jax.microscaling.mx_shared_exponent`).
    """
    if not is_block_format(fmt):
        raise ValueError(f"unknown block format {fmt!r}; known: {sorted(BLOCK_FORMATS)}")
    two_d = Layout(granularity, caxis, BLOCK_FORMATS[fmt]).blocked
    if two_d and caxis % t.ndim < t.ndim - 2:
        raise ValueError("2-d blocks must cover the contraction axis (one of the last two axes)")
    if fmt == "mxfp8":
        return microscaling.quantize_mxfp8(
            t, caxis, two_d=two_d, key=key, scale_rounding=scale_rounding
        )
    return microscaling.quantize_nvfp4(t, caxis, two_d=two_d, key=key)


def hadamard_pair(
    a: jax.Array, a_axis: int, b: jax.Array, b_axis: int, seed: int
) -> tuple[jax.Array, jax.Array]:
    """Both operands of a product transformed along their contraction axes (same signs).

    The contraction axes are zero-padded to a multiple of 16 in both; the
    product of the results equals the product of the inputs in exact
    arithmetic.
    """
    signs = hadamard.random_signs(seed)
    return hadamard.rht(a, signs, a_axis), hadamard.rht(b, signs, b_axis)


# --------------------------------------------------------------------------
# Running the product: native block-scaled GEMM or exact emulation
# --------------------------------------------------------------------------


def native_block_gemm_available(platform: str, compute_capability: str | None) -> bool:
    """Whether ``jax.nn.scaled_matmul`` can run MXFP8 / NVFP4 natively on this device.

    cuDNN's block-scaled GEMM needs a Blackwell GPU (compute capability
    >= 10.0); XLA on CPU has no lowering for it at all.
    """
    if not hasattr(jax.nn, "scaled_matmul") or platform not in ("gpu", "cuda"):
        return False
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return False
    return major >= 10


def device_native_block_gemm() -> bool:
    """Whether the default device runs MXFP8 / NVFP4 GEMMs natively (see above)."""
    dev = jax.devices()[0]
    return native_block_gemm_available(dev.platform, getattr(dev, "compute_capability", None))


def _row_scales(q: QTensor) -> jax.Array:
    """(B, rows, K / block) scales of a canonical operand with K last.

    2-d 16x16 block scales (..., R/16, K/16) are repeated over the 16 rows of
    each block (cropped to the operand's rows).
    """
    if not q.layout.blocked:
        return q.scale
    s = jnp.repeat(q.scale, q.tile, axis=-2)
    return s[..., : q.data.shape[-2], :]


def scaled_matmul_args(qa: QTensor, qb: QTensor) -> tuple[Any, ...]:
    """(a, b, a_scales, b_scales, alpha) for ``jax.nn.scaled_matmul``.

    ``qa`` is (B, M, K) and ``qb`` (B, N, K), both blocked along K (axis 2);
    The data's K is zero-padded to a multiple of the block (the scales
    already have ceil(K / block) entries: a partial last block has its own
    scale, and the padded zero codes add nothing).
    ``alpha`` is the product of the two float32 tensor scales (1 for MX).
    """
    for q in (qa, qb):
        if q.data.ndim != 3 or not (q.layout.blocked or q.layout.runs_along(2)):
            raise ValueError("scaled_matmul operands must be (B, rows, K) blocked along K")
    blk = qa.tile
    k_scales = -(-qa.data.shape[-1] // blk)
    a = pad_axis(qa.data, 2, blk)
    b = pad_axis(qb.data, 2, blk)
    sa, sb = _row_scales(qa), _row_scales(qb)
    if sa.shape[-1] != k_scales or sb.shape[-1] != k_scales:
        raise ValueError("operands are not blocked along the same K")
    alpha = qa.tensor_scale * qb.tensor_scale
    return a, b, sa, sb, alpha


def scaled_matmul(qa: QTensor, qb: QTensor) -> jax.Array:
    """float32 (B, M, N) = qa (B, M, K) . qb (B, N, K) contracted over K, natively.

    ``jax.nn.scaled_matmul`` on the codes and block scales (cuDNN's
    block-scaled GEMM, ``__op$block_scaled_dot``, on a Blackwell GPU); the
    NVFP4 tensor scales multiply its float32 result.  The GEMM core picks it
    for a CUDA target of compute capability >= 10.0 only; it is lowered for
    CUDA alone (dead zeros in any other branch of a multi-platform export).
    """
    if not hasattr(jax.nn, "scaled_matmul"):
        raise ValueError("this jax has no jax.nn.scaled_matmul (the native block-format GEMM)")
    a, b, sa, sb, alpha = scaled_matmul_args(qa, qb)

    def native(a, b, sa, sb):
        return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)

    out = platforms.only_on(("cuda",), native, a, b, sa, sb)
    # The NVFP4 tensor scales are not part of the block-scaled product.
    return out * alpha
