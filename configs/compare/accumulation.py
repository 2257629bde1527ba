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
batch.  Three arms of the same FP8 operands (E4M3, per-tensor current
scaling): exact FP32 accumulation (current_tensor, the baseline of the
paired gaps), the tensor-core accumulation emulator (``fp8jax.accumulate``)
in every FP8 GEMM, dense and expert, without promotion (acc_no_promote: one
chain over all of K) and with promotion every 128 (acc_promote128); bf16 for
scale.  Slow: the emulator costs several times an f32 GEMM.
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
    # The baseline is exact FP32 accumulation of the same FP8 operands, so each
    # arm's paired gap isolates the accumulator (bf16 is there for scale).
    c.compare = comparison_block(
        "accumulation",
        dict(
            current_tensor=dict(recipe="current_tensor"),
            acc_no_promote=dict(recipe="acc_no_promote"),
            acc_promote128=dict(recipe="acc_promote128"),
            bf16=dict(recipe="bf16"),
        ),
        notes=(
            "Tiny MoE model with FFNs of 1024 (K = 1024 in the down projections), 60 steps of "
            "8 x 64 bytes, E4M3 with per-tensor current scaling in every GEMM. current_tensor "
            "(the baseline) accumulates exactly in FP32; acc_no_promote / acc_promote128 run "
            "every FP8 GEMM, dense and expert, on the emulated Hopper accumulator (13 fraction "
            "bits) without promotion / promoted to FP32 every 128 products. Gaps are to "
            "current_tensor, so they measure the accumulator alone."
        ),
        seeds=parse_seeds(seeds),
        baseline="current_tensor",
    )
    return c
