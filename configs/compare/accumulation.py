r"""Accumulation: emulated 14-bit tensor-core accumulation, promoted to FP32 every 128 or never.

Command:
  python experiments/compare_recipes.py --config=configs/compare/accumulation.py --workdir=/tmp/fp8jax_cmp/accumulation

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
Slow (the accumulation emulator runs every GEMM), so short. The contraction lengths that exceed 128 here are the
Wgrad token axis (batch x seq = 256) and the FFN down projections (d_ff 256); the tiny model's d_model 64 is below 128.
"""

from fp8jax.train.defaults import comparison_block, set_comparison_eval, tiny_config


def get_config():
    c = tiny_config()
    c.steps = 40
    c.warmup_steps = 4
    c.eval_every = 10
    c.log_every = 1
    c.final_window = 10
    c.batch_size = 4
    set_comparison_eval(c)
    c.compare = comparison_block(
        "accumulation",
        dict(
            bf16=dict(recipe="bf16"),
            deepseek_v3=dict(recipe="deepseek_v3"),
            acc_no_promote=dict(recipe="acc_no_promote"),
            acc_promote128=dict(recipe="acc_promote128"),
        ),
        notes=(
            "Tiny MoE model, 40 steps of 4 x 64 bytes. deepseek_v3 accumulates its FP8 GEMMs "
            "exactly in FP32; acc_no_promote uses fp8jax.recipes.deepseek_v3(accumulation="
            "Accumulation(promote_every=None)) (Hopper-like 13-fraction-bit accumulation over all "
            "of K); acc_promote128 promotes to FP32 every 128 elements (DeepSeek-V3's N_C)."
        ),
    )
    return c
