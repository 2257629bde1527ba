r"""Block-format rules on a trained model's tensors: saturated / flushed fractions and GEMM error.

Per GEMM site of the captured forward and backward pass
(``fp8jax.numerics.captured``: dense projections ``denseI`` in trace order,
routed experts ``expertI`` on the expert with the most tokens) and per rule,
the saturated and flushed fractions of the Fprop operands x and w and of the
Dgrad gradient dy (``fp8jax.telemetry``: exactly what the training logs
report) and the relative error of y, dx and dW against float64 on the same
unquantized operands, then the same numbers averaged over the sites.  Rules:
``mxfp8`` (E8M0 scales rounded down, the OCP rule), ``mxfp8_ceil`` (rounded
up), ``nvfp4_all_layers`` (NVFP4 on every GEMM); ``nvfp4`` differs from it
only in running its last blocks' GEMMs as ``bf16`` (the sites listed in
``last_block_sites``, whose rows it takes from ``bf16``).  Settings:
configs/study/block_rules.py; with an output directory, the tables go to
``table.md`` there.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np

from fp8jax.bench.experiments import items
from fp8jax.dot_general import dot_general_with_stats
from fp8jax.numerics.captured import trained_run_operands
from fp8jax.numerics.gemm_error import gemm_errors
from fp8jax.numerics.studies import StudyConfigError, one_run
from fp8jax.registry import get as get_recipe
from fp8jax.train.fields import integer, recipe_names, text

COLS = ("x_sat", "w_sat", "dy_sat", "x_flush", "w_flush", "dy_flush", "y_rel", "dx_rel", "dw_rel")
DN = (((1,), (0,)), ((), ()))


def operand_fractions(recipe, x, w, dy) -> dict[str, float]:
    """Saturated / flushed fractions of Fprop's x and w and of Dgrad's dy under ``recipe``."""
    _, fwd = dot_general_with_stats(jnp.asarray(x), jnp.asarray(w), DN, recipe=recipe)
    # Dgrad is dy (M, N) @ w^T (N, K): run as an Fprop with the Dgrad operand specs.
    as_dgrad = dataclasses.replace(recipe, fprop=recipe.dgrad)
    _, bwd = dot_general_with_stats(jnp.asarray(dy), jnp.asarray(w).T, DN, recipe=as_dgrad)
    out = {}
    for name, st in (("x", fwd["x"]), ("w", fwd["w"]), ("dy", bwd["x"])):
        out[f"{name}_sat"] = float(st["saturated"])
        out[f"{name}_flush"] = float(st["flushed"])
    return out


def measure(sites, names, rules) -> list[dict]:
    rows = []
    for name in names:
        x, w, dy = sites[name].operands()
        label = f"{name} ({x.shape[0]}x{x.shape[1]} @ {w.shape[0]}x{w.shape[1]})"
        for r in rules:
            recipe = get_recipe(r)
            errs = gemm_errors(recipe, x, w, dy)
            row = {"site": name, "inputs": label, "rule": r, **operand_fractions(recipe, x, w, dy)}
            row.update({k: errs[k] for k in ("y_rel", "dx_rel", "dw_rel")})
            rows.append(row)
            print(f"{label:34s} {r:17s} " + " ".join(f"{k}={row[k]:.3e}" for k in COLS))
    return rows


def with_nvfp4_default(rows: list[dict], last_sites: list[str]) -> list[dict]:
    """Add ``nvfp4`` rows: bf16's numbers on ``last_sites``, nvfp4_all_layers' elsewhere."""
    by = {(r["site"], r["rule"]): r for r in rows}
    extra = []
    for site in dict.fromkeys(r["site"] for r in rows):
        src = by.get((site, "bf16" if site in last_sites else "nvfp4_all_layers"))
        if src is not None:
            extra.append({**src, "rule": "nvfp4"})
    return rows + extra


def table(rows: list[dict]) -> str:
    head = "| inputs | rule | " + " | ".join(COLS) + " |\n|" + "---|" * (len(COLS) + 2)
    lines = [head] + [
        f"| {r['inputs']} | {r['rule']} | " + " | ".join(f"{r[c]:.2e}" for c in COLS) + " |"
        for r in rows
    ]
    return "\n".join(lines)


def means(rows: list[dict]) -> str:
    rules = list(dict.fromkeys(r["rule"] for r in rows))
    head = "| rule (mean over sites) | " + " | ".join(COLS) + " |\n|" + "---|" * (len(COLS) + 1)
    lines = [head]
    for rule in rules:
        sel = [r for r in rows if r["rule"] == rule]
        lines.append(
            f"| {rule} | " + " | ".join(f"{np.mean([r[c] for r in sel]):.2e}" for c in COLS) + " |"
        )
    return "\n".join(lines)


# The settings (configs/study/block_rules.py) and what each accepts; the sites are
# checked against the run's model once it is restored.
FIELDS = {
    "batch": integer(1),
    "seed": integer(0),
    "rules": recipe_names(),
    "last_block_sites": text,
}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    run_dir = one_run(runs, "block_rules")
    sites, cfg = trained_run_operands(run_dir, batch_size=int(c.batch), seed=int(c.seed))
    last = items(c.last_block_sites)
    missing = [s for s in last if s not in sites]
    if missing:
        raise StudyConfigError(f"no site {missing}; this model has {', '.join(sites)}")
    rows = with_nvfp4_default(measure(sites, list(sites), items(c.rules)), last)
    text = (
        f"Run {run_dir} (recipe {cfg.recipe}, {cfg.steps} steps, model {cfg.model}); "
        f"{int(c.batch)} held-out sequences of {cfg.seq_len} bytes.  Fractions of elements; "
        "errors relative to float64.\n\n" + means(rows) + "\n\n" + table(rows)
    )
    print(text)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "table.md").write_text(text + "\n")
