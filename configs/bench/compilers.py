r"""What the GPU and TPU compilers predict for fp8jax's programs, from a CPU machine.

Commands (GPU targets need the jax CUDA plugin at jax's version; TPU targets libtpu):
  pip install -c constraints-jax0.11.txt -e ".[dev,compile-cuda]"   # jax 0.11.2 + the compile-only CUDA client
  python experiments/bench.py --config=configs/bench/compilers.py --config.targets=h100
  pip install -e ".[dev,tpu]"                                            # libtpu
  python experiments/bench.py --config=configs/bench/compilers.py --config.targets=tpu7x
  python experiments/bench.py --config=configs/bench/compilers.py --config.targets=h100 \
      --config.shapes=1024x1024x1024 --config.grouped= --config.moe_step= --config.cpu_compile_recipe=   # quick

What it prints: per target, a table with one row per case x recipe x impl: the
GEMM kernels by kind, fusions, loops that hold a GEMM, temporaries, HBM bytes,
the predicted time and its ratio to the same program on bf16 lax.dot_general /
lax.ragged_dot for the same target, the HBM bytes ratio, and (GPU) the
non-GEMM kernels' predicted time over the bf16 GEMMs' at BF16 peak, e.g.
  h100    gemm 4096x4096x4096          bf16             lax      3 XLA Triton GEMM ...   1.00
Each dense shape also has a row "e4m3 operands" (fp8_reference): the same
three GEMMs as the compiler's own dots on operands already in E4M3, nothing
quantized, the floor of any FP8 recipe's GEMMs in that target's estimate.
Then the CPU compile time of the tiny train step, deepseek_v3 / bf16 (goal <= 2):
the median ratio of cpu_compile_rounds fresh-process rounds and their range,
and per program its phases, fusions and the distinct kernels XLA built for
them (with their instructions, and how many are the quantizer's);
and a line saying these are predictions, not measurements.  A target this
machine cannot compile for prints "skipped: ..." with what it needs.
--out_dir=DIR writes DIR/results.json.  Logic: fp8jax.bench.predicted, fp8jax.bench.compilers.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "compilers"  # fp8jax.bench.experiments.compilers
    c.targets = "h100,tpu7x"  # fp8jax.bench.compilers.TARGETS: h100, h200, v5e, v6e, tpu7x
    c.recipes = "deepseek_v3"  # presets (fp8jax.registry), each against bf16 lax ops
    c.impls = "auto"  # GEMM-core paths per recipe: auto, chunked, fp8, xla, pallas
    # Dense fwd+bwd shapes MxKxN: 4096^3 and DeepSeek-V3's dense shape at K 7168.
    c.shapes = "4096x4096x4096,4096x7168x2048"
    # Also the compiler's own FP8 GEMMs per shape (three lax.dot_general on E4M3
    # operands, no quantization): what the target's cost model credits FP8 with.
    c.fp8_reference = True
    # Grouped expert GEMMs EXPERTSxROWSxKxN (fp8jax.ragged_dot vs lax.ragged_dot).
    c.grouped = "8x512x7168x2048"
    c.moe_step = "small"  # MoE train step preset ("" to skip): fp8jax.bench.moe_step
    c.batch = 8  # sequences in the train step
    c.cpu_compile_recipe = "deepseek_v3"  # CPU compile ratio vs bf16 ("" to skip)
    c.cpu_compile_preset = "tiny"  # the model whose train step is compiled on this CPU
    # Rounds of that measurement, each a fresh process (bf16 then the recipe):
    # the printed ratio is their median, with their range.
    c.cpu_compile_rounds = 3
    return c
