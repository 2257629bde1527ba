r"""Outlier stress: massive activations at every FFN down-projection input (routed experts too).

Command (1e5 x the median |activation|; configs/sweep/outliers.py runs 1e2, 1e3, 1e4, 1e5):
  python experiments/compare_recipes.py --config=configs/compare/outlier_sweep.py --workdir=/tmp/fp8jax_cmp/outliers
  python experiments/compare_recipes.py --config=configs/compare/outlier_sweep.py:1e3 --workdir=/tmp/fp8jax_cmp/outliers_1e3

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
Expected: per-tensor scaling pushes the ordinary values into E4M3 subnormals (large flushed fraction) and
loses to 1x128 tiles; delayed scaling additionally clips (saturated > 0) when its state is fresh or stale.
"""

from fp8jax.train.defaults import comparison_block, set_comparison_eval, tiny_config
from fp8jax.train.injection import inject_block


def get_config(magnitude: str = "1e5"):
    """``magnitude``: the injected value in units of the median |activation|
    (``--config=configs/compare/outlier_sweep.py:1e3`` for a point of the sweep
    1e2 ... 1e5)."""
    scale = float(magnitude)
    c = tiny_config()
    c.steps = 100
    c.warmup_steps = 10
    c.eval_every = 25
    c.log_every = 2
    c.final_window = 10
    # Two channels of the first token of every FFN down-projection input set to
    # ``magnitude`` x the median |activation| (fp8jax.train.injection).
    c.inject = inject_block(
        massive_activation_scale=scale,
        massive_activation_count=2,
        massive_activation_site="ffn_hidden",
    )
    set_comparison_eval(c)
    c.compare = comparison_block(
        "outliers" if scale == 1e5 else f"outliers_{magnitude}",
        dict(
            bf16=dict(recipe="bf16"),
            deepseek_v3=dict(recipe="deepseek_v3"),
            tensor_current=dict(recipe="current_tensor"),
            tensor_delayed=dict(recipe="tensor_delayed"),
            # Faults of the delayed state, on top of the massive activations.
            delayed_fresh=dict(recipe="tensor_delayed", inject=dict(fp8_reset_every=10)),
            delayed_growing=dict(recipe="tensor_delayed", inject=dict(fp8_amax_growth=4.0)),
        ),
        notes=(
            f"Tiny MoE model with massive activations ({magnitude} x median |x|, 2 channels of "
            "the first token of every sequence) "
            "injected into every FFN down-projection input. delayed_fresh resets the delayed "
            "state to fresh (scale 1, empty history) every 10 steps; delayed_growing divides the "
            "stored amax history and scale by 4 after every step, i.e. the next step's scale is "
            "4x too small, as for a tensor whose amax grew 4x since the last step (both are "
            "injected faults)."
        ),
    )
    return c
