r"""Scaling: online (current) vs delayed (amax history).

Command:
  python experiments/compare_recipes.py --config=configs/compare/scaling.py --workdir=/tmp/fp8jax_cmp/scaling

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
The core supports delayed scaling per-tensor only, so the fine-grained arm is online tile/block vs delayed per-tensor.
"""

from fp8jax.train.defaults import tiny_comparison_config


def get_config():
    return tiny_comparison_config(
        "scaling",
        {
            "bf16": dict(recipe="bf16"),
            "tensor_current": dict(recipe="current_tensor"),
            "tensor_delayed": dict(recipe="tensor_delayed"),
            "fine_online": dict(recipe="deepseek_v3"),
        },
        notes=(
            "Tiny MoE model, stdlib corpus, E4M3 for every operand so only the scaling differs. "
            "Per-tensor: online (tensor_current) vs delayed with a 16-step amax history "
            "(tensor_delayed). Fine-grained: delayed scaling exists only per-tensor in "
            "fp8jax's core, so fine_online (1x128 / 128x128 online, = deepseek_v3) is "
            "compared with the per-tensor delayed run, not with a fine-grained delayed one."
        ),
    )
