"""FP8 GEMM kernels: block-scaled (DeepSeek-V3 1x128 / 128x128) Mosaic GPU kernels and dispatch.

See docs/kernels.md.  The kernels exported here are compiled where a program is lowered
for a Hopper+ NVIDIA GPU and run in Mosaic GPU's interpreter elsewhere (tests);
``fp8jax.kernels.tpu_block_gemm`` holds the same GEMMs as Pallas TPU (Mosaic) kernels.
"""

from fp8jax.kernels.availability import hopper_gpu, kernel_available, self_check_error
from fp8jax.kernels.block_gemm import (
    batched_matmul_nt,
    block_scaled_matmul,
    block_scaled_matmul_nt,
    block_scaled_matmul_reference,
    block_scaled_matmul_tn,
    block_scaled_matmul_tn_reference,
)
from fp8jax.kernels.grouped_block_gemm import (
    grouped_block_scaled_matmul,
    grouped_block_scaled_matmul_aligned,
    grouped_block_scaled_matmul_reference,
    grouped_wgrad,
)

__all__ = [
    "batched_matmul_nt",
    "block_scaled_matmul",
    "block_scaled_matmul_nt",
    "block_scaled_matmul_reference",
    "block_scaled_matmul_tn",
    "block_scaled_matmul_tn_reference",
    "grouped_block_scaled_matmul",
    "grouped_block_scaled_matmul_aligned",
    "grouped_block_scaled_matmul_reference",
    "grouped_wgrad",
    "hopper_gpu",
    "kernel_available",
    "self_check_error",
]
