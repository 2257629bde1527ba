"""TFLOP/s of the block-scaled FP8 Pallas kernel vs BF16 and per-tensor FP8 (XLA/cuBLASLt).

GPU (H100/H200):
  python experiments/bench_gemm.py --out experiments/results/bench_gemm_h200.json [--sweep]
CPU (small shapes; the kernel runs only in Pallas interpret mode on one tiny shape):
  python experiments/bench_gemm.py --small --out /tmp/bench_gemm_cpu.json

Prints one line per (shape, implementation) with TFLOP/s and the ratio to BF16,
whether XLA compiled the per-tensor FP8 pattern to ``__cublas$lt$matmul$f8``,
and writes everything as JSON to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from absl import app, flags

from fp8jax.kernels import bench, dispatch

_OUT = flags.DEFINE_string("out", None, "JSON output path.")
_SMALL = flags.DEFINE_bool("small", None, "Small shapes (default: on unless a Hopper GPU).")
_ITERS = flags.DEFINE_integer("iters", 10, "Calls per timing.")
_REPS = flags.DEFINE_integer("reps", 5, "Timings per measurement (median).")
_SWEEP = flags.DEFINE_bool("sweep", False, "Also sweep Triton launch parameters at 4096^3 (GPU).")
_GROUPED = flags.DEFINE_bool("grouped", True, "Also benchmark the grouped (MoE) kernel.")


def main(argv):
    del argv
    on_kernel_gpu = dispatch.kernel_available()
    small = (not on_kernel_gpu) if _SMALL.value is None else _SMALL.value
    dev = jax.devices()[0]
    header = {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "kernel_available": on_kernel_gpu,
        "small": small,
    }
    notes = []
    if not on_kernel_gpu:
        notes.append(
            "no Hopper GPU: the Pallas kernel runs only in interpret mode on one tiny shape "
            "(not a performance number); GPU measurement missing"
        )
    print(json.dumps(header))

    cublas = None
    try:
        m, k, n = (256, 256, 256) if small else (4096, 4096, 4096)
        cublas = bench.compiled_hlo_has_cublas_f8(m, k, n)
    except Exception as e:
        notes.append(f"cuBLAS FP8 HLO check failed: {e!r}"[:300])
    print(f"per-tensor FP8 pattern compiled to {bench.CUBLAS_F8_CALL}: {cublas}")

    iters, reps = (_ITERS.value, _REPS.value) if not small else (3, 3)
    results: list[bench.Result] = []
    dense_impls = ["bf16", "fp8_tensor_xla", "block_xla"]
    shapes = bench.SMALL_SHAPES if small else bench.FULL_SHAPES
    if on_kernel_gpu:
        dense_impls += ["pallas_kn", "pallas_nt", "pallas_tn_wgrad"]
    for name, m, k, n in shapes:
        results += bench.bench_dense(
            name, m, k, n, impls=dense_impls, iters=iters, reps=reps, interpret=False
        )
    if not on_kernel_gpu:
        name, m, k, n = bench.INTERPRET_SHAPE
        results += bench.bench_dense(
            name, m, k, n, impls=["bf16", "pallas_nt"], iters=1, reps=1, interpret=True
        )
    if _GROUPED.value:
        for name, e, rows, k, n in bench.SMALL_GROUPED if small else bench.FULL_GROUPED:
            for layout in ("kn", "nk"):
                results += bench.bench_grouped(
                    name,
                    e,
                    rows,
                    k,
                    n,
                    iters=1 if not on_kernel_gpu else iters,
                    reps=1 if not on_kernel_gpu else reps,
                    interpret=not on_kernel_gpu,
                    b_layout=layout,
                )
    if _SWEEP.value and on_kernel_gpu:
        results += bench.sweep_configs(4096, 4096, 4096, iters=iters, reps=reps)

    for r in results:
        tf = f"{r.tflops:9.2f}" if r.tflops is not None else "      n/a"
        ratio = f"{r.ratio_to_bf16:6.2f}x" if r.ratio_to_bf16 is not None else "     -"
        print(
            f"{r.shape:30s} {r.impl:42s} M={r.m:5d} K={r.k:5d} N={r.n:5d} {tf} TFLOP/s {ratio}  {r.note}"
        )
    for note in notes:
        print("NOTE:", note)

    if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        with open(_OUT.value, "w") as f:
            json.dump(
                {
                    **header,
                    "cublas_f8_custom_call_found": cublas,
                    "notes": notes,
                    "results": [dataclasses.asdict(r) for r in results],
                },
                f,
                indent=1,
            )
        print("wrote", _OUT.value)


if __name__ == "__main__":
    app.run(main)
