r"""GEMM error of each recipe on the activations, weights and gradients of a trained model.

Per GEMM site (dense projections as ``denseI``; routed experts as ``expertI``,
measured on the expert that received the most tokens), its shape and, per
recipe, the relative error of y (Fprop), dx (Dgrad) and dW (Wgrad) against
float64 on the same unquantized operands: over the whole tensor (*_rel) and the
median over tokens of each token's error (*_tok).  The captured batch is
``batch`` held-out sequences, so Wgrad contracts over ``batch x seq_len``
tokens (2,048 by default): the long-K GEMM of a training step.  The ``acc_*``
rows run every GEMM through the Hopper accumulation model (13 fraction bits in
blocks of 32): ``acc_no_promote`` and ``acc_promote128`` with per-tensor scales,
without and with promotion to FP32 every 128; ``acc_tiles`` with DeepSeek-V3's
tiles; compare them with ``current_tensor`` and ``deepseek_v3`` (the same
quantization, exact accumulation).  Settings: configs/study/captured_gemm_error.py;
with an output directory, the table goes to ``table.md`` there.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from fp8jax.bench.experiments import items
from fp8jax.numerics.captured import trained_run_operands
from fp8jax.numerics.gemm_error import format_table, gemm_errors, linear_outputs
from fp8jax.numerics.metrics import relative_error
from fp8jax.numerics.studies import StudyConfigError, one_run
from fp8jax.registry import get as get_recipe
from fp8jax.train.fields import integer, recipe_names, text

# Each accumulation arm and the recipe with the same quantization and exact
# (float32) accumulation: their difference is the accumulation error alone.
ACC_TWINS = {
    "acc_no_promote": "current_tensor",
    "acc_promote128": "current_tensor",
    "acc_tiles": "deepseek_v3",
}


# The settings (configs/study/captured_gemm_error.py) and what each accepts; the
# sites are checked against the run's model once it is restored.
FIELDS = {"batch": integer(1), "seed": integer(0), "sites": text, "recipes": recipe_names()}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    run_dir = one_run(runs, "captured_gemm_error")
    sites, cfg = trained_run_operands(run_dir, batch_size=int(c.batch), seed=int(c.seed))
    missing = [s for s in items(c.sites) if s not in sites]
    if missing:
        raise StudyConfigError(f"no site {missing}; this model has {', '.join(sites)}")
    rows, acc_rows = [], []
    for name in items(c.sites):
        site = sites[name]
        x, w, dy = site.operands()
        label = f"{name} ({x.shape[0]}x{x.shape[1]} @ {w.shape[0]}x{w.shape[1]})"
        for r in items(c.recipes):
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
        f"Run {run_dir} (recipe {cfg.recipe}, {cfg.steps} steps, model {cfg.model}); "
        f"{int(c.batch)} held-out sequences of {cfg.seq_len} bytes.\n\n"
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
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "table.md").write_text(table + "\n")
