r"""GEMM error of each recipe on the activations, weights and gradients of a trained model.

Commands (train the small model in BF16, then measure on its tensors):
  python experiments/train.py --config=configs/small.py --config.recipe=bf16 --workdir=/tmp/fp8jax_small_bf16
  python experiments/captured_gemm_error.py --run=/tmp/fp8jax_small_bf16 --out=/tmp/captured.md

What it prints: per GEMM site (dense projections as ``denseI``; routed
experts as ``expertI``, measured on the expert that received the most
tokens), its shape and, per recipe, the relative error of y (Fprop), dx
(Dgrad) and dW (Wgrad) against float64 on the same unquantized operands:
over the whole tensor (*_rel) and the median over tokens of each token's error
(*_tok).  The captured batch is ``--batch`` held-out sequences, so Wgrad
contracts over ``batch x seq_len`` tokens (2,048 by default): the long-K GEMM
of a training step.  The ``acc_*`` rows run every GEMM through the Hopper
accumulation model (13 fraction bits in blocks of 32): ``acc_no_promote``
and ``acc_promote128`` with per-tensor scales, without and with promotion to
FP32 every 128; ``acc_tiles`` with DeepSeek-V3's tiles; compare them with
``current_tensor`` and ``deepseek_v3`` (the same quantization, exact
accumulation).
"""

from __future__ import annotations

from pathlib import Path

from absl import app, flags

from fp8jax.numerics.captured import trained_run_operands
from fp8jax.numerics.gemm_error import format_table, gemm_errors, linear_outputs
from fp8jax.numerics.metrics import relative_error
from fp8jax.registry import get as get_recipe

_RUN = flags.DEFINE_string("run", None, "workdir of a finished training run")
_BATCH = flags.DEFINE_integer("batch", 16, "held-out sequences captured (Wgrad's K / seq_len)")
_SEED = flags.DEFINE_integer("seed", 0, "which held-out windows")
_SITES = flags.DEFINE_list(
    "sites",
    ["dense0", "dense1", "dense2", "dense3", "expert0", "expert1"],
    "GEMM sites, in the model's trace order (the first block: attention in / out, FFN "
    "up / down; then the first MoE block's routed experts up / down)",
)
_RECIPES = flags.DEFINE_list(
    "recipes",
    [
        "bf16",
        "deepseek_v3",
        "current_tensor",
        "hybrid_delayed",
        "rowwise",
        "mxfp8",
        "nvfp4",
        "acc_no_promote",
        "acc_promote128",
        "acc_tiles",
    ],
    "recipes (fp8jax.registry.get names)",
)
# Each accumulation arm and the recipe with the same quantization and exact
# (float32) accumulation: their difference is the accumulation error alone.
ACC_TWINS = {
    "acc_no_promote": "current_tensor",
    "acc_promote128": "current_tensor",
    "acc_tiles": "deepseek_v3",
}
_OUT = flags.DEFINE_string("out", None, "optional path for the Markdown table")
flags.mark_flag_as_required("run")


def main(argv):
    del argv
    sites, cfg = trained_run_operands(_RUN.value, batch_size=_BATCH.value, seed=_SEED.value)
    missing = [s for s in _SITES.value if s not in sites]
    if missing:
        raise app.UsageError(f"no site {missing}; this model has {', '.join(sites)}")
    rows, acc_rows = [], []
    for name in _SITES.value:
        site = sites[name]
        x, w, dy = site.operands()
        label = f"{name} ({x.shape[0]}x{x.shape[1]} @ {w.shape[0]}x{w.shape[1]})"
        for r in _RECIPES.value:
            errs = gemm_errors(get_recipe(r), x, w, dy)
            rows.append({"inputs": label, "recipe": r, **errs})
            print(f"{label:34s} {r:15s} " + " ".join(f"{k}={v:.3e}" for k, v in errs.items()))
            if r in ACC_TWINS:
                got = linear_outputs(get_recipe(r), x, w, dy)
                ref = linear_outputs(get_recipe(ACC_TWINS[r]), x, w, dy)
                acc = {
                    f"{k}_vs_exact_acc": relative_error(a, b)
                    for k, a, b in zip(("y", "dx", "dw"), got, ref)
                }
                acc_rows.append((label, r, ACC_TWINS[r], acc))
    head = (
        f"Run {_RUN.value} (recipe {cfg.recipe}, {cfg.steps} steps, model {cfg.model}); "
        f"{_BATCH.value} held-out sequences of {cfg.seq_len} bytes.\n\n"
    )
    table = head + format_table(rows)
    if acc_rows:
        table += (
            "\n\nAccumulation error alone: relative difference to the same quantization with "
            "exact float32 accumulation.\n\n| inputs | recipe | exact twin | y | dx | dW |\n"
            "|---|---|---|---|---|---|\n"
        )
        table += "\n".join(
            f"| {lab} | {r} | {t} | "
            + " | ".join(f"{acc[k + '_vs_exact_acc']:.2e}" for k in ("y", "dx", "dw"))
            + " |"
            for lab, r, t, acc in acc_rows
        )
    print(table)
    if _OUT.value:
        Path(_OUT.value).write_text(table + "\n")


if __name__ == "__main__":
    app.run(main)
