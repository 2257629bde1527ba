r"""128x128 blocks for Dgrad's activation gradient: what they cost each token, on a trained model.

DeepSeek-V3 (appendix B.2) reports that quantizing the activation gradient
(Dgrad's dy) in 128x128 blocks instead of 1x128 tiles makes a 16B model
diverge.  This measures why, on the gradients a trained model produces:
per GEMM site (dense projections ``denseI``; routed experts ``expertI`` on
the expert with the most tokens), dy of ``batch`` held-out sequences is
quantized to E4M3 in 1x128 tiles (one token per scale) and in 128x128
blocks (128 tokens share a scale).  Printed per site and granularity:

* the relative error of dy over the whole tensor and per token (median,
  90th and 99th percentile), and the share of non-zero values flushed to 0;
* how far below its block's amax a token's amax lies
  (:func:`fp8jax.numerics.token_error.group_amax_ratio`: median; the share of
  tokens more than 2^6 and 2^12 below), over tokens with a non-zero gradient;
* the error that reaches Dgrad's output dx = dy W^T (deepseek_v3 vs the
  same recipe with 128x128 Dgrad blocks), whole tensor and median per token.

Writes ``dgrad_blocks.md`` and ``dgrad_blocks.png`` (per-token error of dy
against the token's amax relative to its scale group's, for the site where
blocks cost most) to the output directory.  Settings: configs/study/dgrad_blocks.py.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax.numerics.captured import trained_run_operands  # noqa: E402
from fp8jax.numerics.gemm_error import gemm_errors  # noqa: E402
from fp8jax.numerics.studies import StudyConfigError, one_run  # noqa: E402
from fp8jax.numerics.token_error import token_quant_errors  # noqa: E402
from fp8jax.registry import get as get_recipe  # noqa: E402
from fp8jax.train.fields import integer  # noqa: E402

# The settings (configs/study/dgrad_blocks.py) and what each accepts.
FIELDS = {"batch": integer(1), "seed": integer(0)}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    run_dir = one_run(runs, "dgrad_blocks")
    if not out_dir:
        raise StudyConfigError("dgrad_blocks writes dgrad_blocks.md / .png: give --out_dir=DIR")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sites, cfg = trained_run_operands(run_dir, batch_size=int(c.batch), seed=int(c.seed))
    tile_r, block_r = get_recipe("deepseek_v3"), get_recipe("dgrad_blocks")
    lines = [
        f"Run {run_dir} (recipe {cfg.recipe}, {cfg.steps} steps, model {cfg.model}); dy of "
        f"{int(c.batch)} held-out sequences of {cfg.seq_len} bytes, E4M3.\n",
        "| site | dy shape | granularity | dy rel err | per-token err median / p90 / p99 "
        "| flushed | token amax / group amax: median, < 2^-6, < 2^-12 | dx rel err | dx token "
        "median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    curves = {}
    for name, site in sites.items():
        x, w, dy = site.operands()
        if dy.shape[0] < 128:
            continue  # fewer tokens than one block: blocks and tiles coincide
        dx_err = {
            "tile": gemm_errors(tile_r, x, w, dy),
            "block": gemm_errors(block_r, x, w, dy),
        }
        for gran in ("tile", "block"):
            e = token_quant_errors(dy, gran)
            d64 = dy.astype(np.float64)
            nz = d64 != 0
            # Whole-tensor figures from the per-token ones: sum of squared errors.
            whole = float(
                np.sqrt(np.sum((e["rel_err"] * np.linalg.norm(d64, axis=1)) ** 2))
                / np.linalg.norm(d64)
            )
            flushed = float(np.sum(e["flushed"] * nz.sum(axis=1)) / max(nz.sum(), 1))
            p = np.percentile(e["rel_err"], [50, 90, 99])
            # Tokens whose gradient is exactly 0 (the last position of each
            # sequence predicts nothing) have no ratio.
            ratio = e["amax_ratio"][dy.any(axis=1)]
            lines.append(
                f"| {name} | {dy.shape[0]}x{dy.shape[1]} | {gran} | {whole:.2%} | "
                f"{p[0]:.2%} / {p[1]:.2%} / {p[2]:.2%} | {flushed:.2e} | "
                f"{np.median(ratio):.3g}, {np.mean(ratio < 2.0**-6):.1%}, "
                f"{np.mean(ratio < 2.0**-12):.1%} | {dx_err[gran]['dx_rel']:.2%} | "
                f"{dx_err[gran]['dx_tok']:.2%} |"
            )
            curves[name, gran] = e
        print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines) + "\n"
    (out / "dgrad_blocks.md").write_text(text)
    # The site whose median per-token error grows most from tiles to blocks.
    worst = max(
        {n for n, _ in curves},
        key=lambda n: (
            np.median(curves[n, "block"]["rel_err"])
            / max(np.median(curves[n, "tile"]["rel_err"]), 1e-30)
        ),
    )
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for gran, color in (("tile", "tab:blue"), ("block", "tab:red")):
        e = curves[worst, gran]
        keep = e["amax_ratio"] > 0
        ax.scatter(
            e["amax_ratio"][keep],
            e["rel_err"][keep],
            s=4,
            alpha=0.5,
            color=color,
            label=f"{'1x128 tiles' if gran == 'tile' else '128x128 blocks'}",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="token amax / amax of its scale group",
        ylabel="token's relative error of dy (E4M3)",
        title=f"Dgrad dy at {worst}: one dot per token",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dgrad_blocks.png", dpi=120)
    print(text)
