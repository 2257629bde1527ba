"""Relative error of y, dx and dW of one linear layer under each recipe.

Errors are measured against float64 on the unquantized inputs, both over the
whole tensor (||a - ref|| / ||ref||) and as the median over tokens of each
token's relative error (rows of y and dx; rows of dW, i.e. input features).
The whole-tensor norm is dominated by outliers and hides what happens to the
ordinary tokens; the per-token median shows it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import recipes as recipes_lib
from fp8jax import scaling
from fp8jax.dot_general import dot_general
from fp8jax.numerics.metrics import relative_error
from fp8jax.recipes import Recipe

_DN = (((1,), (0,)), ((), ()))


def median_token_relative_error(a, ref) -> float:
    """Median over rows (tokens) of each row's ||a - ref|| / ||ref||, in float64.

    Rows whose reference is zero count as 0 if ``a`` is zero there too, else inf.
    """
    a64, ref64 = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    num = np.linalg.norm(a64 - ref64, axis=-1)
    den = np.linalg.norm(ref64, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return float(np.median(rel))


def linear_outputs(recipe: Recipe, x, w, dy, *, warm_state: bool = True):
    """y, dx, dw of y = x @ w with upstream gradient dy, under ``recipe``.

    Delayed recipes: ``warm_state`` first runs one step on the same tensors so
    the state holds their amaxes (steady state); otherwise the fresh state
    (scale 1) is used, which clips everything above the format's max.
    """
    state = scaling.init_delayed_gemm_state(recipe) if recipes_lib.needs_state(recipe) else None

    @jax.jit
    def run(x, w, dy, state):
        def f(x, w, state):
            return jnp.sum(dot_general(x, w, _DN, recipe=recipe, state=state) * dy)

        y = dot_general(x, w, _DN, recipe=recipe, state=state)
        dx, dw, new_state = jax.grad(f, argnums=(0, 1, 2))(x, w, state)
        return y, dx, dw, new_state

    if state is not None and warm_state:
        state = run(x, w, dy, state)[3]
    y, dx, dw, _ = run(x, w, dy, state)
    return np.asarray(y, np.float64), np.asarray(dx, np.float64), np.asarray(dw, np.float64)


def gemm_errors(recipe: Recipe, x, w, dy, *, warm_state: bool = True) -> dict[str, float]:
    """Whole-tensor and per-token-median relative errors of y, dx, dW."""
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    ref = {"y": x64 @ w64, "dx": dy64 @ w64.T, "dw": x64.T @ dy64}
    y, dx, dw = linear_outputs(recipe, x, w, dy, warm_state=warm_state)
    got = {"y": y, "dx": dx, "dw": dw}
    out = {}
    for k in ref:
        out[f"{k}_rel"] = relative_error(got[k], ref[k])
        out[f"{k}_tok"] = median_token_relative_error(got[k], ref[k])
    return out


def format_table(rows: list[dict]) -> str:
    """A Markdown table of gemm_errors rows (with 'inputs' and 'recipe' keys)."""
    cols = ["y_rel", "y_tok", "dx_rel", "dx_tok", "dw_rel", "dw_tok"]
    head = "| inputs | recipe | " + " | ".join(cols) + " |"
    sep = "|" + "---|" * (len(cols) + 2)
    lines = [head, sep]
    for r in rows:
        vals = " | ".join(f"{r[c]:.2e}" for c in cols)
        lines.append(f"| {r['inputs']} | {r['recipe']} | {vals} |")
    return "\n".join(lines)
