r"""Cost of the numerics core on this backend, printed as ratios from one run.

Commands:
  python experiments/bench.py --config=configs/bench/core.py      # 4096^2 quantize, 2048^3 GEMM
  python experiments/bench.py --config=configs/bench/core.py --config.size=512 --config.quant_rows=1024   # quick

What it prints: tile-quantize / astype(bf16) time (goal <= 1.2x); the fwd+bwd
time of deepseek_v3's dot_general on each XLA path of the GEMM core -- "xla"
(dequantize to float32, or bfloat16, then one dot) and "chunked" (128-long dots
of the FP8 codes) -- side by side with the bf16 recipe's, with the dot
algorithms each compiled module runs (goal <= 1.2x), and the path "auto" takes
on this CPU; and residual bytes deepseek_v3 / bf16 (goal <= 0.55), e.g.
  tile quantize / astype(bf16) [4096x4096]: 1.05x  (...; goal <= 1.2x)
  residual bytes deepseek_v3 / bf16: 0.5.. (...; goal <= 0.55)
--out_dir=DIR writes DIR/results.json.  Logic: fp8jax.bench.core.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "core"  # fp8jax.bench.experiments.core
    c.size = 2048  # M = K = N of the GEMM
    c.quant_rows = 4096  # rows (and columns) of the quantized tensor
    c.iters = 5  # timed iterations (median); the quantize ratio times twice as many
    return c
