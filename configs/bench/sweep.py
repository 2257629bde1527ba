r"""The benchmark sweep: FP8 GEMMs (recipe x implementation) on GEMM shapes, and the MoE train step.

Commands:
  python experiments/bench.py --config=configs/bench/sweep.py:cpu --out_dir=/tmp/bench_cpu
  python experiments/bench.py --config=configs/bench/sweep.py --out_dir=$OUT/bench_gpu
  (the argument after the file: "gpu", the default, or "cpu": minutes on 2 cores)
Override any field, e.g. selected shapes and recipes only:
  python experiments/bench.py --config=configs/bench/sweep.py --config.groups=dsv3 \
      --config.m_tokens=2048 --config.recipes=bf16,deepseek_v3 --out_dir=/tmp/bench_dsv3
  python experiments/bench.py --config=configs/bench/sweep.py:cpu \
      --config.shapes=4096x7168x2112,512x512x512 --config.passes=fwd --out_dir=/tmp/bench_shapes

Lists are comma-separated strings (so that one --config.<field>=a,b sets them);
an empty string takes the default named in the field's comment.
What it writes (--out_dir is required): results.json, results.csv and
time/tflops/ratio_bf16/memory PNGs.  What it prints: the speedup-vs-bf16 tables
(fwd+bwd, then fwd) of every recipe x implementation per shape, the
implementations not offered on this backend, the MoE train-step table and
"wall ... s; wrote ...".  Logic: fp8jax.bench.sweep.
Every field is flat (text, numbers, booleans), built with
fp8jax.bench.config_file.new_config: experiments/bench.py reads this file with or
without ml_collections (scripts/gpu_sweep.sh runs it on the GPU image, which has none).
"""

from typing import Any

from fp8jax.bench.config_file import new_config

# Values that differ between the two sizes: (gpu, cpu).
_BY_SIZE = {
    "square_sizes": ("1024,2048,4096,8192", "256,512,1024"),
    "m_tokens": (4096, 64),
    "warmup": (2, 1),
    "iters": (10, 3),
    "moe_preset": ("small", "tiny"),
    "moe_iters": (10, 3),
}


def get_config(size: str = "gpu") -> Any:
    if size not in ("gpu", "cpu"):
        raise ValueError(
            f"size {size!r}: give 'gpu' or 'cpu' (--config=configs/bench/sweep.py:cpu)"
        )
    pick = {k: v[size == "cpu"] for k, v in _BY_SIZE.items()}
    c = new_config()
    c.benchmark = "sweep"  # fp8jax.bench.experiments.sweep
    # --- GEMM shapes (fp8jax.bench.gemm_cases) ---
    # Shape groups: square (M = K = N), dsv3 (DeepSeek-V3's K = 7168 linears), moe (expert GEMMs).
    c.groups = "square,dsv3,moe"
    # Explicit MxKxN shapes, e.g. "4096x7168x2112,512x512x512"; they replace the groups.
    c.shapes = ""
    # Sizes of the square group.
    c.square_sizes = pick["square_sizes"]
    # M (tokens) of the dsv3 shapes.
    c.m_tokens = pick["m_tokens"]
    # N of the dsv3 shapes ("": all four of DeepSeek-V3's).
    c.dsv3_n = ""
    # M of the moe expert shapes (0: m_tokens).
    c.expert_m = 0
    # --- what runs on each shape ---
    # Recipe names of fp8jax.registry.get ("": every preset).
    c.recipes = ""
    # GEMM implementations: xla, chunked, fp8, fp8_fast, pallas, reference ("": every one offered).
    c.impls = ""
    # Dequantize dtypes of the "xla" path (dequantize, then dot).
    c.dequant_dtypes = "float32,bfloat16"
    # Passes timed: fwd and/or fwd_bwd.
    c.passes = "fwd,fwd_bwd"
    # dtype of x, w and dy.
    c.dtype = "bfloat16"
    # --- timing (fp8jax.bench.timing) ---
    # Untimed calls after compilation.
    c.warmup = pick["warmup"]
    # Timed calls per case (the median is reported).
    c.iters = pick["iters"]
    # Skip the cases left after this many seconds (0: no budget).
    c.time_budget_s = 0.0
    # --- the MoE model's train step (fp8jax.bench.moe_step) ---
    # Also time the train step of every recipe.
    c.moe_step = True
    # ModelConfig preset of the step.
    c.moe_preset = pick["moe_preset"]
    # Batch size of the step.
    c.moe_batch = 8
    # Sequence length of the step (0: the model's max_seq_len).
    c.moe_seq = 0
    # Timed steps per recipe.
    c.moe_iters = pick["moe_iters"]
    # --- outputs ---
    # Save the first shape's compiled HLO under out_dir/hlo.
    c.dump_hlo = False
    # Write the PNG plots.
    c.plots = True
    return c
