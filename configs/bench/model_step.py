r"""Train-step time, tokens/s and compiled peak memory of the MoE model: FP8 vs bf16.

Commands:
  python experiments/bench.py --config=configs/bench/model_step.py     # small config, batch 8 x 128
  python experiments/bench.py --config=configs/bench/model_step.py --config.preset=tiny --config.steps=5

What it prints: a line naming the model and backend, then a table with one row
per recipe: the train-step time (median of ``steps`` timed steps after one
warm-up, the rows' steps interleaved), tokens/s and the step's peak memory from
XLA's compiled memory analysis, with their ratios to the bf16 row.  A row is
``recipe[:dequant_dtype][@notel]`` (@notel: FP8 telemetry off for that row).
--out_dir=DIR writes DIR/results.json.  Logic: fp8jax.bench.moe_step.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "model_step"  # fp8jax.bench.experiments.model_step
    c.preset = "small"  # model size preset (fp8jax.bench.moe_step.PRESETS)
    c.attention = "mha"  # attention type: mha or mla
    c.batch = 8  # sequences per step
    c.seq = 0  # sequence length (0: the preset's max_seq_len)
    c.steps = 5  # timed steps
    # Rows, comma-separated: recipe[:dequant_dtype][@notel].
    c.recipes = "bf16,deepseek_v3,deepseek_v3:bfloat16,deepseek_v3@notel"
    return c
