"""Benchmark sweeps: FP8 GEMMs and the MoE train step for every recipe and implementation.

* :mod:`fp8jax.bench.gemm`   shapes, variants (recipe x impl), the jitted cases
  and the hand-written canonical per-tensor FP8 reference;
* :mod:`fp8jax.bench.timing` warmup + block_until_ready + median timing, XLA memory;
* :mod:`fp8jax.bench.hlo`    which GEMM kernel ran, from the compiled HLO text;
* :mod:`fp8jax.bench.moe_step` one MoE training step per recipe;
* :mod:`fp8jax.bench.sweep`  the sweep and its JSON / CSV / PNG outputs.

Entry point: ``python experiments/bench_sweep.py --small --out_dir=...``.
"""

from fp8jax.bench.gemm import (
    Shape,
    Variant,
    backend_variants,
    fp8_per_tensor_matmul,
    gemm_shapes,
    parse_shape,
)
from fp8jax.bench.hlo import CUBLASLT_FP8_TARGET, kernel_path, summarize_hlo
from fp8jax.bench.sweep import SweepConfig, default_shapes, run_sweep, summary_table, write_results
from fp8jax.bench.timing import memory_stats, time_call

__all__ = [
    "CUBLASLT_FP8_TARGET",
    "Shape",
    "SweepConfig",
    "Variant",
    "backend_variants",
    "default_shapes",
    "fp8_per_tensor_matmul",
    "gemm_shapes",
    "kernel_path",
    "memory_stats",
    "parse_shape",
    "run_sweep",
    "summarize_hlo",
    "summary_table",
    "time_call",
    "write_results",
]
