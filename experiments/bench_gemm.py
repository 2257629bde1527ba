"""TFLOP/s of the block-scaled FP8 Pallas kernel vs BF16 and per-tensor FP8 (XLA/cuBLASLt).

GPU (H100/H200):
  python experiments/bench_gemm.py --out=/tmp/bench_gemm_gpu.json --sweep
CPU (small shapes; the kernel runs only in Pallas interpret mode on one tiny shape):
  python experiments/bench_gemm.py --small --out=/tmp/bench_gemm_cpu.json

Prints one line per (shape, implementation) with TFLOP/s and the ratio to BF16,
whether XLA compiled the per-tensor FP8 pattern to a cuBLASLt FP8 GEMM, and
writes everything as JSON to --out.  Logic: fp8jax.bench.kernel.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from absl import app, flags

from fp8jax.bench import gemm_cases, kernel
from fp8jax.kernels import kernel_available

_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_SMALL = flags.DEFINE_bool("small", None, "Small shapes (default: on unless a Hopper GPU).")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed samples per implementation (median).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also sweep Triton launch parameters at 4096^3 (GPU).")
_GROUPED = flags.DEFINE_bool("grouped", True, "Also benchmark the grouped (MoE) kernel.")


def main(argv):
    del argv
    on_gpu = kernel_available()
    small = (not on_gpu) if _SMALL.value is None else _SMALL.value
    header = {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "kernel_available": on_gpu,
        "small": small,
    }
    notes = []
    if not on_gpu:
        notes.append(
            "no Hopper GPU: the Pallas kernel runs only in interpret mode on one tiny shape "
            "(not a performance number)"
        )
    print(json.dumps(header))
    size = 256 if small else 4096
    cublas = kernel.cublaslt_fp8_compiles(size, size, size)
    print(f"per-tensor FP8 pattern compiled to a cuBLASLt FP8 GEMM: {cublas}")

    iters = 3 if small else _ITERS.value
    impls = list(kernel.DENSE_IMPLS if on_gpu else ("bf16", "fp8_tensor_xla", "block_xla"))
    results: list[kernel.Result] = []
    for shape in gemm_cases.kernel_shapes(small):
        results += kernel.bench_dense(shape, impls=impls, iters=iters, interpret=False)
    if not on_gpu:
        results += kernel.bench_dense(
            gemm_cases.INTERPRET_SHAPE, impls=["bf16", "pallas_nt"], iters=1, interpret=True
        )
    if _GROUPED.value:
        for shape in gemm_cases.grouped_shapes(small):
            for layout in ("kn", "nk"):
                results += kernel.bench_grouped(
                    shape, iters=iters if on_gpu else 1, interpret=not on_gpu, b_layout=layout
                )
    if _SWEEP.value and on_gpu:
        results += kernel.sweep_launch_params(gemm_cases.parse_shape("4096x4096x4096"), iters=iters)

    for r in results:
        tf = f"{r.tflops:9.2f}" if r.tflops is not None else "      n/a"
        ratio = f"{r.ratio_to_bf16:6.2f}x" if r.ratio_to_bf16 is not None else "     -"
        print(
            f"{r.shape:28s} {r.impl:42s} M={r.m:5d} K={r.k:5d} N={r.n:5d} {tf} TFLOP/s "
            f"{ratio}  {r.note}"
        )
    for note in notes:
        print("NOTE:", note)
    if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        with open(_OUT.value, "w") as f:
            json.dump(
                {
                    **header,
                    "cublaslt_fp8_found": cublas,
                    "notes": notes,
                    "results": [dataclasses.asdict(r) for r in results],
                },
                f,
                indent=1,
            )
        print("wrote", _OUT.value)


if __name__ == "__main__":
    app.run(main)
