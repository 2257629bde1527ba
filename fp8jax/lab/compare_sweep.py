"""One comparison repeated over a swept setting: gap and FP8 telemetry against the setting.

A sweep is a set of comparisons (fp8jax.lab.compare) that differ in one
number, e.g. the magnitude of injected massive activations.  Per value and
run label, :func:`sweep_rows` takes the paired gap to the baseline (mean and
95% t-interval over seeds) and the telemetry (flushed fraction averaged over
steps and seeds, saturated fraction's maximum); :func:`plot_sweep` draws both
against the swept value on a log axis, one line per label, so the value where
a recipe starts to lose shows as the point its interval leaves the +-0.25%
band.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt

from fp8jax.lab.stats import (
    DEEPSEEK_TOLERANCE,
    VERDICT_TEXT,
    interval_text,
    stats_from_json,
)
from fp8jax.train.run_log import as_float

__all__ = ["plot_sweep", "sweep_markdown", "sweep_rows"]


def sweep_rows(results_by_value: dict[float, dict]) -> list[dict]:
    """Rows (value, label, gap stats, flushed_mean, saturated_max, verdict) of non-baseline runs."""
    rows = []
    for value in sorted(results_by_value):
        res = results_by_value[value]
        for r in res["table"]:
            if r["label"] == res["baseline"]:
                continue
            gap = stats_from_json(r["gap_val"])
            tel = r["fp8_telemetry"]
            rows.append(
                {
                    "value": float(value),
                    "label": r["label"],
                    "gap": gap,
                    "flushed_mean": as_float(tel.get("flushed_mean", math.nan)),
                    "saturated_max": as_float(tel.get("saturated_max", math.nan)),
                    "verdict": r["verdict"],
                }
            )
    return rows


def sweep_markdown(rows: list[dict], value_name: str) -> str:
    """The sweep as a Markdown table, one row per (value, label)."""
    lines = [
        f"| {value_name} | run | val gap to baseline [95% CI] | within 0.25% | flushed mean "
        "| saturated max |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['value']:.0e} | {r['label']} | {interval_text(r['gap'])} | "
            f"{VERDICT_TEXT[r['verdict']]} | {r['flushed_mean']:.2e} | {r['saturated_max']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def plot_sweep(rows: list[dict], path: str | Path, value_name: str, title: str = "") -> Path:
    """Gap (mean, 95% interval as error bars, the +-0.25% band) and flushed fraction vs value."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, (ax_gap, ax_fl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, label in enumerate(labels):
        rs = [r for r in rows if r["label"] == label]
        # Labels side by side around each value so their error bars do not overlap.
        shift = 1.0 + 0.04 * (i - (len(labels) - 1) / 2)
        x = [r["value"] * shift for r in rs]
        mean = [100 * r["gap"]["mean"] for r in rs]
        lo = [100 * (r["gap"]["mean"] - r["gap"]["lo"]) for r in rs]
        hi = [100 * (r["gap"]["hi"] - r["gap"]["mean"]) for r in rs]
        ax_gap.errorbar(x, mean, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax_fl.plot([r["value"] for r in rs], [r["flushed_mean"] for r in rs], "o-", label=label)
    tol = 100 * DEEPSEEK_TOLERANCE
    ax_gap.axhspan(-tol, tol, color="0.85", zorder=0, label="+-0.25%")
    ax_gap.axhline(0, color="0.4", lw=0.8)
    ax_gap.set(xscale="log", xlabel=value_name, ylabel="val loss gap to baseline (%)")
    ax_gap.set_title("paired gap, mean and 95% interval over seeds", fontsize=10)
    ax_fl.set(xscale="log", xlabel=value_name, ylabel="flushed fraction")
    # Flushed fractions are >= 0 and span decades: log where every point is
    # positive; otherwise symlog (linear around 0) starting at 0.
    flushed = [r["flushed_mean"] for r in rows if math.isfinite(r["flushed_mean"])]
    if flushed and min(flushed) > 0:
        ax_fl.set_yscale("log")
    else:
        ax_fl.set_yscale("symlog", linthresh=1e-6)
        ax_fl.set_ylim(bottom=0)
    ax_fl.set_title("FP8 elements flushed to zero (mean over steps, seeds)", fontsize=10)
    ax_gap.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
