r"""Late-failure stress: a long, alignment-accelerating run of the tiny model with the monitors on.

Settings chosen to speed up the gate / up weight alignment that Fishman et al.
(arXiv 2409.12517) trace the late FP8 failures to: learning rate 1e-2 (the
tiny default: 3e-3), no weight decay (the default: 0.1), a short warm-up and
no decay to speak of (min_lr_ratio 0.5), 3,000 steps (25x a comparison).
Runs: bf16, per-tensor delayed (E4M3, tensor_delayed), per-tensor current
(current_tensor) and deepseek_v3, each with and without Smooth-SwiGLU
(``*_smooth``: ``model_overrides.smooth_swiglu``); seeds 0-2.

Commands (long; every run is resumable from its directory), then the monitors' tables
and figure from the finished runs (configs/study/stress_monitors.py):
  python experiments/compare_recipes.py --config=configs/compare/stress.py --workdir=/tmp/fp8jax_cmp/stress
  python experiments/study.py --config=configs/study/stress_monitors.py --run=/tmp/fp8jax_cmp/stress

What they print / write: the comparison's results.md (gap to bf16 per seed,
intervals) and, in the workdir, monitors.md: per run and seed the first
logged step where the loss notices (the training loss, averaged over 100
steps, 5% above bf16's at the same seed and steps, or non-finite), the first step each monitor crosses its threshold
(fp8jax.lab.stress), the lead in steps and the extreme value reached; and
monitors.png: loss and monitors against steps, one colour per run.

Smoke check (3 steps, two runs, one seed; the test suite runs the same):
  python experiments/compare_recipes.py --config=configs/compare/stress.py:smoke --workdir=/tmp/stress_smoke
  python experiments/study.py --config=configs/study/stress_monitors.py --config.arg=smoke --run=/tmp/stress_smoke
"""

import ml_collections

from fp8jax.train.defaults import comparison_block, parse_seeds, set_comparison_eval, tiny_config

RECIPES = ("bf16", "tensor_delayed", "current_tensor", "deepseek_v3")


def _runs(recipes) -> dict:
    runs = {}
    for r in recipes:
        runs[r] = dict(recipe=r)
        runs[f"{r}_smooth"] = dict(
            recipe=r, model_overrides=ml_collections.ConfigDict({"smooth_swiglu": True})
        )
    return runs


def get_config(arg: str = "0-2"):
    """``arg``: seeds ("a-b", "a-b:step" or a comma list), or "smoke" (3 steps, 2 runs, seed 0)."""
    smoke = arg == "smoke"
    c = tiny_config()
    c.steps = 3 if smoke else 3000
    c.lr = 1e-2
    c.weight_decay = 0.0
    c.warmup_steps = 1 if smoke else 50
    c.min_lr_ratio = 0.5
    c.log_every = 1 if smoke else 10
    c.final_window = 1 if smoke else 10
    set_comparison_eval(c)
    c.eval_every = 3 if smoke else 250
    if smoke:
        c.eval_batches = 1
    c.checkpoint_every = 0 if smoke else 500
    runs = _runs(("bf16",)) if smoke else _runs(RECIPES)
    c.compare = comparison_block(
        "stress",
        runs,
        "Tiny MoE model, stdlib corpus, lr 1e-2, no weight decay, min_lr_ratio 0.5: settings "
        "chosen to accelerate gate/up weight alignment, not to train well. *_smooth: "
        "Smooth-SwiGLU (power-of-two per-channel scales before the down-projection's "
        "quantization, folded into its weight).",
        seeds=(0,) if smoke else parse_seeds(arg),
    )
    return c
