"""Cost of the numerics core on this backend, printed as ratios from one run.

    python experiments/bench_core.py                  # 4096^2 quantize, 2048^3 GEMM
    python experiments/bench_core.py --size=512 --quant_rows=1024   # quick

Prints: tile-quantize / astype(bf16) time (goal <= 1.2x); the fwd+bwd time of
deepseek_v3's dot_general on each XLA path of the GEMM core -- "xla"
(dequantize to float32, or bfloat16, then one dot) and "chunked" (128-long
dots of the FP8 codes) -- side by side with the bf16 recipe's, with the dot
algorithms each compiled module runs (goal <= 1.2x), and the path "auto"
takes on this CPU; and residual bytes deepseek_v3 / bf16 (goal <= 0.55).
Logic: fp8jax.bench.core.
"""

import json

import jax
from absl import app, flags

from fp8jax import gemm, host_cpu
from fp8jax.bench.core import GEMM_VARIANTS, gemm_ratio, quantize_ratio

FLAGS = flags.FLAGS
flags.DEFINE_integer("size", 2048, "M = K = N of the GEMM")
flags.DEFINE_integer("quant_rows", 4096, "rows (and columns) of the quantized tensor")
flags.DEFINE_integer("iters", 5, "timed iterations (median)")
flags.DEFINE_string("out", None, "optional JSON output path")


def main(argv):
    del argv
    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    q = quantize_ratio(FLAGS.quant_rows, FLAGS.quant_rows, iters=2 * FLAGS.iters)
    print(
        f"tile quantize / astype(bf16) [{FLAGS.quant_rows}x{FLAGS.quant_rows}]: "
        f"{q['ratio']:.2f}x  ({q['t_tile_quantize_s'] * 1e3:.1f} ms vs "
        f"{q['t_astype_bf16_s'] * 1e3:.1f} ms; goal <= 1.2x)"
    )
    g = gemm_ratio(FLAGS.size, iters=FLAGS.iters)
    print(
        f"fwd+bwd at {FLAGS.size}^3 on {g['backend']} (median of {FLAGS.iters}, "
        "timed round-robin; goal <= 1.2x bf16):"
    )
    for name in GEMM_VARIANTS:
        print(
            f"  {name:24s} {g[f't_{name}_s'] * 1e3:8.1f} ms  {g[f'ratio_{name}']:5.2f}x  "
            f"[{g[f'dot_algorithms_{name}']}]"
        )
    if jax.default_backend() == "cpu":
        bf16_dot = {True: "yes", False: "no", None: "unknown"}[host_cpu.has_bf16_dot()]
        print(
            f'  "auto" runs {gemm.auto_impl("fp8", "cpu")} on this CPU '
            f"(bfloat16 dot instructions: {bf16_dot})"
        )
    print(
        f"residual bytes deepseek_v3 / bf16: {g['residual_ratio']:.3f} "
        f"({g['residual_bytes_deepseek_v3']} / {g['residual_bytes_bf16']}; goal <= 0.55)"
    )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"quantize": q, "gemm": g, "size": FLAGS.size}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
