r"""GEMM error of deepseek_v3 at each of its scale sites, its power-of-two variant and DeepSeek's act_quant.

Heavy-tailed inputs (M, K, N = 384, 1024, 512 by default): "massive3" (N(0, 1)
with 3 massive activations of 1e4-1e5) and "lognormal" (random signs times a
log-normal magnitude with sigma 2); x and the gradient dy are drawn from the
same distribution, w ~ N(0, 1/K).  For each: the relative error (Frobenius, against
float64 products of the unquantized tensors) of Fprop y, Dgrad dx and Wgrad
dW, for deepseek_v3 at a general linear and at each site of
``fp8jax.recipes.for_site``, for ``deepseek_v3_pow2x``, and for the numpy
reference of DeepSeek's quantization (``fp8jax.numerics.act_quant_reference``);
also the variant ``attn_out_e5m6_unscaled`` at attn_out (its Wgrad cache in
E5M6 without scales).  Each draw (``seeds``, one numpy generator per seed
for both input distributions) gives one value per cell, listed in seed order; the
ratio columns give each row's Fprop and Wgrad error over the reference's of
the same draw, per draw, then their geometric mean and its 95% interval over
the draws.  With an output directory: the
Markdown table in ``table.md`` and ``results.json`` with every value.  A
trained run's captured tensors are added as one more fixed draw.  Settings:
configs/study/site_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections
import numpy as np

from fp8jax import recipes, variants
from fp8jax.bench.experiments import items
from fp8jax.lab.stats import mean_interval
from fp8jax.numerics.act_quant_reference import reference_linear
from fp8jax.numerics.gemm_error import linear_outputs
from fp8jax.numerics.metrics import relative_error
from fp8jax.train.fields import integer, integers


def heavy_tailed(distribution: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """float32 tensor of the named distribution (module docstring), drawn in float64, rounded once."""
    if distribution == "massive3":
        x = rng.standard_normal(shape)
        flat = rng.choice(x.size, 3, replace=False)
        x.flat[flat] = rng.choice([-1.0, 1.0], 3) * 10.0 ** rng.uniform(4, 5, 3)
    elif distribution == "lognormal":
        x = rng.choice([-1.0, 1.0], shape) * np.exp(2.0 * rng.standard_normal(shape))
    else:
        raise ValueError(distribution)
    return x.astype(np.float32)


def arms() -> dict[str, recipes.Recipe]:
    r = recipes.deepseek_v3()
    out = {"deepseek_v3 (general linear)": r}
    for site in recipes.GEMM_SITES:
        out[f"deepseek_v3 at {site}"] = recipes.for_site(r, site)
    out["deepseek_v3_pow2x (general linear)"] = recipes.deepseek_v3_pow2x()
    out["attn_out_e5m6_unscaled at attn_out"] = recipes.for_site(
        variants.attn_out_e5m6_unscaled(), "attn_out"
    )
    return out


def errors(x, w, dy) -> dict[str, tuple[float, float, float]]:
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    exact = (x64 @ w64, dy64 @ w64.T, x64.T @ dy64)
    rows = {"DeepSeek act_quant (numpy reference)": reference_linear(x, w, dy)}
    for name, recipe in arms().items():
        rows[name] = linear_outputs(recipe, x, w, dy)
    return {
        name: tuple(relative_error(got, ref) for got, ref in zip(outs, exact))
        for name, outs in rows.items()
    }


REF_NAME = "DeepSeek act_quant (numpy reference)"


def ratio_cell(ratios: np.ndarray) -> str:
    """'1.83, 1.11, 1.25; geomean 1.36 [0.71, 2.61]': the draws, their mean and 95% interval.

    Ratios are averaged on a log scale: the geometric mean, and the t-interval
    of the mean log ratio over the draws (:func:`fp8jax.lab.stats.mean_interval`)
    mapped back with exp, so the interval is never below 0 and 2x and 0.5x
    weigh alike.  With three draws t = 4.30: the interval is wide.  One draw (a
    trained run's tensors) is shown alone.
    """
    text = ", ".join(f"{v:.2f}" for v in ratios)
    if len(ratios) < 2:
        return text
    st = mean_interval(np.log(ratios))
    mean, lo, hi = np.exp([st["mean"], st["lo"], st["hi"]])
    return f"{text}; geomean {mean:.2f} [{lo:.2f}, {hi:.2f}]"


def table(results: dict[str, list[dict[str, tuple[float, float, float]]]]) -> str:
    """Markdown: per row the draws' values in seed order, ratios per draw, their geomean and interval."""
    lines = [
        "| inputs | quantization | Fprop y | Dgrad dx | Wgrad dW | y / ref | dW / ref |",
        "|---|---|---|---|---|---|---|",
    ]
    for inputs, draws in results.items():
        for name in draws[0]:
            errs = np.array([d[name] for d in draws])  # (draws, 3)
            refs = np.array([d[REF_NAME] for d in draws])
            cells = [", ".join(f"{v:.4f}" for v in errs[:, j]) for j in range(3)]
            ratios = [ratio_cell(errs[:, j] / refs[:, j]) for j in (0, 2)]
            lines.append(f"| {inputs} | {name} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def captured_inputs(run_dir: str) -> dict[str, tuple]:
    """Each captured dense site's (x, w, dy), cropped to multiples of 128."""
    from fp8jax.numerics.captured import trained_run_operands

    sites, _ = trained_run_operands(run_dir)
    out = {}
    for name, site in sites.items():
        x, w, dy = site.operands()
        if dy is None or x.ndim != 2 or w.ndim != 2:
            continue
        m, k, n = (d - d % 128 for d in (x.shape[0], x.shape[1], w.shape[1]))
        if min(m, k, n) == 0:
            continue
        out[f"captured {name}"] = (x[:m, :k], w[:k, :n], dy[:m, :n])
    return out


def synthetic_inputs(seed: int, m: int, k: int, n: int) -> dict[str, tuple]:
    """One draw of each heavy-tailed distribution: (x, w, dy), from one generator per seed."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for distribution in ("massive3", "lognormal"):
        x = heavy_tailed(distribution, (m, k), rng)
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inputs[f"{distribution} ({m}x{k}x{n})"] = (x, w, heavy_tailed(distribution, (m, n), rng))
    return inputs


# The settings (configs/study/site_errors.py) and what each accepts: the sizes are
# whole 128-blocks (DeepSeek's reference quantizes 128-long groups).
FIELDS = {
    "m": integer(128, multiple=128),
    "k": integer(128, multiple=128),
    "n": integer(128, multiple=128),
    "seeds": integers(0),
}


def footprint(v: dict) -> int:
    """Bytes at least, of the checked settings ``v``: x (M, K), w (K, N) and dy (M, N) in
    float32 and their float64 copies."""
    m, k, n = v["m"], v["k"], v["n"]
    return 12 * (m * k + k * n + m * n)


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    m, k, n = int(c.m), int(c.k), int(c.n)
    seeds = [int(s) for s in items(c.seeds)]
    results: dict[str, list] = {}
    for seed in seeds:
        for name, (x, w, dy) in synthetic_inputs(seed, m, k, n).items():
            results.setdefault(name, []).append(errors(x, w, dy))
            print(f"{name}, seed {seed}: done", flush=True)
    for run_dir in runs:
        # Captured tensors are one fixed draw.
        for name, (x, w, dy) in captured_inputs(run_dir).items():
            results[name] = [errors(x, w, dy)]
            print(f"{name}: done", flush=True)
    text = table(results)
    print(text)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.md").write_text(text)
        record = {
            "seeds": seeds,
            "shape": [m, k, n],
            "columns": ["fprop_y", "dgrad_dx", "wgrad_dw"],
            "errors": {
                inputs: {name: [list(d[name]) for d in draws] for name in draws[0]}
                for inputs, draws in results.items()
            },
        }
        (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
