"""Every benchmark of fp8jax: one timing helper, one HLO inspector, one set of shapes.

* :mod:`fp8jax.bench.timing`   warmup + block_until_ready + median timing (round-robin
  over the functions compared), XLA's static memory;
* :mod:`fp8jax.bench.hlo`      which GEMM kernel ran and with which dot algorithm,
  from the compiled HLO text;
* :mod:`fp8jax.bench.gemm_cases`     the shape lists, variants (recipe x impl), the jitted
  ``dot_general`` cases and the hand-written canonical per-tensor FP8 reference;
* :mod:`fp8jax.bench.sweep`    the GEMM sweep and its JSON / CSV / PNG outputs
  (:mod:`fp8jax.bench.plots`);
* :mod:`fp8jax.bench.moe_step` the MoE model's train step per recipe;
* :mod:`fp8jax.bench.kernel`   the block-scaled Pallas kernels on ready FP8 operands;
* :mod:`fp8jax.bench.core`     the numerics core's cost as ratios to bf16.

* :mod:`fp8jax.bench.experiments` each benchmark as a function of its config
  (configs/bench/*.py), the logic of the entry point ``experiments/bench.py``.
"""

from fp8jax.bench.gemm_cases import (
    Shape,
    Variant,
    backend_variants,
    fp8_per_tensor_matmul,
    gemm_shapes,
    parse_shape,
)
from fp8jax.bench.hlo import CUBLASLT_FP8_TARGET, hlo_report, kernel_path, summarize_hlo
from fp8jax.bench.sweep import SweepConfig, run_sweep, summary_table, write_results
from fp8jax.bench.timing import memory_stats, time_call, time_calls

__all__ = [
    "CUBLASLT_FP8_TARGET",
    "Shape",
    "SweepConfig",
    "Variant",
    "backend_variants",
    "fp8_per_tensor_matmul",
    "gemm_shapes",
    "hlo_report",
    "kernel_path",
    "memory_stats",
    "parse_shape",
    "run_sweep",
    "summarize_hlo",
    "summary_table",
    "time_call",
    "time_calls",
    "write_results",
]
