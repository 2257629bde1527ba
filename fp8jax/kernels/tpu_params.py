"""What every Mosaic TPU kernel of :mod:`fp8jax.kernels` asks Mosaic for: the grid
axes' semantics and its scoped VMEM (the GEMM kernels of
:mod:`~fp8jax.kernels.tpu_block_gemm` and the quantizers of
:mod:`~fp8jax.kernels.tpu_quantize`)."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

#: The scoped VMEM the dense GEMM and the quantizing kernels ask for.  tpu7x
#: has 64 MiB of VMEM per core, v5e and v6e 128; the three dense orientations
#: compile at 4096^3 with the dense blocks for all three chips with bfloat16
#: and float32 outputs ("tn" needs 57.5 MiB on tpu7x, "nn" more than 48).
#: The limit also shapes what libtpu keeps in VMEM around a kernel: for
#: deepseek_v3's fwd+bwd at 4096^3 on tpu7x with 1024 x 1024 blocks and the
#: limit on the GEMM kernels only, 32 MiB gave 12 prefetch copies and a 632
#: us estimate, 48 MiB 9 copies and 577 us; the quantizers' requantizing
#: kernel took 28 us and 99 MiB at the default limit, 10 us and 35 MiB at 48
#: MiB.  With the quantizers at 60 MiB rather than 48 the fwd+bwd at 4096^3
#: is 473.4 us and 502.7 MiB rather than 475.1 us and 508.8 MiB.
VMEM_LIMIT = 60 << 20

#: float32's sublane tile in Mosaic's native (8, 128) tiling: a float32 block's
#: second-to-last dimension, and a dynamic store of rows, start at multiples of it.
F32_SUBLANES = 8


def compiler_params(
    semantics: tuple[str, ...], vmem_limit: int = VMEM_LIMIT
) -> pltpu.CompilerParams:
    """Mosaic's parameters for a kernel of this package: the grid axes' ``semantics``
    and ``vmem_limit`` bytes of scoped VMEM."""
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit)
