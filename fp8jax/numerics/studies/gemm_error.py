"""GEMM error of each recipe on Gaussian and LLM-like inputs, against float64.

Prints, per input distribution and preset, the relative error of y, dx and dW over the
whole tensor (*_rel) and the median over tokens of each token's relative error
(*_tok), then the massive-activation check: deepseek_v3's per-token median
forward error versus current_tensor's and hybrid_delayed's (goal: >= 2x lower).
Settings: configs/study/gemm_error.py; with an output directory, writes the
Markdown table to ``table.md`` there.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from fp8jax import recipes, registry
from fp8jax.bench.experiments import items
from fp8jax.numerics.gemm_error import format_table, gemm_errors
from fp8jax.numerics.inputs import DISTRIBUTIONS, make_gemm_inputs
from fp8jax.train.fields import integer, recipe_names

# The settings (configs/study/gemm_error.py) and what each accepts.
FIELDS = {
    "m": integer(1),
    "k": integer(1),
    "n": integer(1),
    "seed": integer(0),
    "recipes": recipe_names(),
}


def footprint(v: dict) -> int:
    """Bytes at least, of the checked settings ``v``: x (M, K), w (K, N) and dy (M, N) in
    float32 and their float64 copies."""
    m, k, n = v["m"], v["k"], v["n"]
    return 12 * (m * k + k * n + m * n)


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    del runs
    rows = []
    for distribution in DISTRIBUTIONS:
        x, w, dy = make_gemm_inputs(distribution, int(c.m), int(c.k), int(c.n), int(c.seed))
        for name in items(c.recipes):
            errs = gemm_errors(registry.get(name), x, w, dy)
            rows.append({"inputs": distribution, "recipe": name, **errs})
            print(
                f"{distribution:17s} {name:15s} "
                + " ".join(f"{k}={v:.3e}" for k, v in errs.items())
            )
        if distribution == "massive":
            x_fresh = gemm_errors(recipes.hybrid_delayed(), x, w, dy, warm_state=False)
            rows.append(
                {"inputs": distribution, "recipe": "hybrid_delayed (fresh state)", **x_fresh}
            )
    table = format_table(rows)
    print()
    print(table)
    mass = {r["recipe"]: r["y_tok"] for r in rows if r["inputs"] == "massive"}
    if "deepseek_v3" in mass:
        print()
        for other in ("current_tensor", "hybrid_delayed"):
            if other in mass:
                ratio = mass[other] / mass["deepseek_v3"]
                verdict = "OK" if ratio >= 2 else "BELOW GOAL"
                print(
                    f"massive activations, per-token median y error: {other} / deepseek_v3 = "
                    f"{ratio:.2f}x ({verdict}, goal >= 2x)"
                )
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "table.md").write_text(table + "\n")
