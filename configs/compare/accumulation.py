r"""Accumulation in training at contraction lengths where it matters (K >= 1024 in the FFNs).

Command:
  python experiments/compare_recipes.py --config=configs/compare/accumulation.py --workdir=/tmp/fp8jax_cmp/accumulation

The argument after the file name picks the seeds ("0-4" by default): two
processes can share the workdir (``accumulation.py:0-4:2`` and ``:1-4:2``), then
the command above re-reads every finished run and tabulates them.

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, the verdict on +-0.25%, tokens/s and FP8 telemetry.  Runs live
under the workdir (``DIR/runs``).

The tiny model with FFNs of 1024 (dense d_ff and experts), so the down
projections contract over 1024 and the Wgrad GEMMs over the 512 tokens of a
batch.  Every FP8 GEMM, dense and expert, runs on the tensor-core
accumulation emulator (``fp8jax.accumulate``) in the emulator arms: exact
FP32 accumulation (current_tensor), no promotion (acc_no_promote: one chain
over all of K, per-tensor scales), promotion every 128 (acc_promote128), and
DeepSeek-V3's tiles with the emulator (acc_tiles: its scales change every 128
elements, so its chains are promoted there).  Slow: the emulator costs
several times an f32 GEMM.
"""

import ml_collections

from fp8jax.train.defaults import comparison_block, parse_seeds, set_comparison_eval, tiny_config


def get_config(seeds: str = "0-4"):
    """``seeds``: "a-b", "a-b:step" or "s1,s2" (fp8jax.train.defaults.parse_seeds)."""
    c = tiny_config()
    c.steps = 60
    c.warmup_steps = 6
    c.eval_every = 20
    c.log_every = 2
    c.final_window = 10
    c.model_overrides = ml_collections.ConfigDict(dict(d_ff=1024, d_expert=1024))
    set_comparison_eval(c)
    c.compare = comparison_block(
        "accumulation",
        dict(
            bf16=dict(recipe="bf16"),
            current_tensor=dict(recipe="current_tensor"),
            acc_no_promote=dict(recipe="acc_no_promote"),
            acc_promote128=dict(recipe="acc_promote128"),
            deepseek_v3=dict(recipe="deepseek_v3"),
            acc_tiles=dict(recipe="acc_tiles"),
        ),
        notes=(
            "Tiny MoE model with FFNs of 1024 (K = 1024 in the down projections), 60 steps of "
            "8 x 64 bytes. current_tensor and deepseek_v3 accumulate exactly in FP32; "
            "acc_no_promote / acc_promote128 are current_tensor on the emulated Hopper "
            "accumulation (13 fraction bits) without promotion / promoted every 128; acc_tiles "
            "is deepseek_v3 on the emulator."
        ),
        seeds=parse_seeds(seeds),
    )
    return c
