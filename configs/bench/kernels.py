r"""TFLOP/s of the block-scaled FP8 Pallas kernels vs BF16 and per-tensor FP8 (XLA/cuBLASLt).

Commands:
  GPU (H100/H200):
  python experiments/bench.py --config=configs/bench/kernels.py --config.sweep=true --out_dir=/tmp/bench_kernels_gpu
  CPU (small shapes; the kernel runs only in Pallas interpret mode on one tiny shape):
  python experiments/bench.py --config=configs/bench/kernels.py --out_dir=/tmp/bench_kernels_cpu

What it prints: a JSON header line (backend, device, jax, whether the kernel
is available), whether XLA compiled the per-tensor FP8 pattern to a cuBLASLt
FP8 GEMM, then one line per (shape, implementation) with TFLOP/s and the ratio
to BF16; writes everything to DIR/results.json.  Logic: fp8jax.bench.kernel.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "kernels"  # fp8jax.bench.experiments.kernels
    # Shapes: "small" (256-sized; 3 timed samples), "full" (4096-sized) or
    # "auto" (small unless a Hopper GPU runs the kernels).
    c.size = "auto"
    c.iters = 10  # timed samples per implementation (median) at full size
    c.sweep = False  # also sweep Triton launch parameters at 4096^3 (GPU only)
    c.grouped = True  # also benchmark the grouped (MoE) kernel
    return c
