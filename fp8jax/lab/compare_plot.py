"""A comparison's two figures: loss curves and the paired gap to the baseline.

``loss_curves.png``: train loss (a moving average over ``smooth`` logged steps)
and validation loss vs step, each the mean over seeds.  ``gap_to_bf16.png``:
per step, the paired relative gap of every label to the baseline (same seed),
its mean over seeds with the 95% t-interval shaded (:func:`fp8jax.lab.stats.
mean_interval` at every step), each seed as a thin line, and the +-0.25% band.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from fp8jax.lab.plot_runs import curve
from fp8jax.lab.stats import DEEPSEEK_TOLERANCE, mean_interval


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or y.size < window:
        return y
    k = np.ones(window) / window
    # 'valid' would shorten the curve; pad with edge values instead.
    pad = np.pad(y, (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(pad, k, mode="valid")


def _smooth_rows(v: np.ndarray, window: int) -> np.ndarray:
    return np.stack([_smooth(row, window) for row in v])


def _band(gaps_SxN: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds (axis 0) and its t-interval at every step."""
    stats = [mean_interval(gaps_SxN[:, i], level) for i in range(gaps_SxN.shape[1])]
    return tuple(np.asarray([st[k] for st in stats]) for k in ("mean", "lo", "hi"))


def plot(results: dict, run_rows: dict, workdir: Path, smooth: int = 10) -> list[Path]:
    """loss_curves.png and gap_to_bf16.png (means over seeds, 95% intervals of the gap)."""
    labels = [r["label"] for r in results["table"]]
    base = results["baseline"]
    seeds = results["seeds"]

    def paired_curves(label: str, key: str):
        """Steps logged by every seed of ``label`` and of the baseline; both [seeds, steps]."""
        curves = [curve(run_rows[label][s], key) for s in seeds]
        base_curves = [curve(run_rows[base][s], key) for s in seeds]
        common = set(curves[0][0].tolist())
        for c in curves[1:] + base_curves:
            common &= set(c[0].tolist())
        steps = np.asarray(sorted(common))

        def pick(cs):
            return np.stack([c[1][np.isin(c[0], steps)] for c in cs])

        return steps, pick(curves), pick(base_curves)

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in labels:
        s, v, _ = paired_curves(label, "loss")
        ax_t.plot(s, _smooth(v.mean(0), smooth), label=label, lw=1.2)
        s, v, _ = paired_curves(label, "val_loss")
        ax_v.plot(s, v.mean(0), marker="o", ms=3, label=label, lw=1.2)
    ax_t.set(
        xlabel="step", ylabel=f"train loss (mean over seeds, {smooth}-step avg)", title="train"
    )
    ax_v.set(xlabel="step", ylabel="validation cross-entropy (nats/byte)", title="validation")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['name']}: loss curves")
    fig.tight_layout()
    p1 = workdir / "loss_curves.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in labels:
        if label == base:
            continue
        s, v, vb = paired_curves(label, "loss")
        # Paired (same seed) relative gap per seed, then its mean and interval.
        gap_t = (_smooth_rows(v, smooth) - _smooth_rows(vb, smooth)) / _smooth_rows(vb, smooth)
        mean, lo, hi = _band(gap_t)
        (line,) = ax_t.plot(s, 100 * mean, label=label, lw=1.2)
        ax_t.fill_between(s, 100 * lo, 100 * hi, color=line.get_color(), alpha=0.15)
        s, v, vvb = paired_curves(label, "val_loss")
        gap_v = (v - vvb) / vvb
        mean, lo, hi = _band(gap_v)
        (line,) = ax_v.plot(s, 100 * mean, marker="o", ms=3, label=f"{label} (mean)", lw=1.4)
        ax_v.fill_between(s, 100 * lo, 100 * hi, color=line.get_color(), alpha=0.15)
        for row in gap_v:
            ax_v.plot(s, 100 * row, color=line.get_color(), lw=0.6, alpha=0.5)
    for ax, what in ((ax_t, "train loss"), (ax_v, "validation loss")):
        ax.axhline(0, color="k", lw=0.8)
        ax.axhspan(
            -100 * DEEPSEEK_TOLERANCE,
            100 * DEEPSEEK_TOLERANCE,
            color="green",
            alpha=0.08,
            label="+-0.25%",
        )
        ax.set(xlabel="step", ylabel=f"paired gap of {what} to {base} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_v.set_title(f"mean over {len(seeds)} seeds, shaded: 95% t-interval, thin: each seed")
    fig.suptitle(f"{results['name']}: gap to {base}")
    fig.tight_layout()
    p2 = workdir / "gap_to_bf16.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]
