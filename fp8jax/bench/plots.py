"""PNG plots of a sweep: time, TFLOP/s, speedup vs bf16 and peak memory per shape and variant."""

from __future__ import annotations

import os
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

METRICS = {
    "time": ("median_s", "median time per call [ms]", 1e3, True),
    "tflops": ("tflops", "TFLOP/s (2MKN fwd, 6MKN fwd+bwd)", 1.0, False),
    "ratio_bf16": (
        "speedup_vs_bf16",
        "speedup vs bf16 recipe (t_bf16 / t; >1 = faster)",
        1.0,
        False,
    ),
    "memory": ("peak_bytes", "peak memory, XLA static estimate [MiB]", 1 / 2**20, True),
}


def _bar_panel(ax, recs, key, scale, log):
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    val = {(r["shape"], r["variant"]): r.get(key) for r in recs}
    width = 0.8 / max(1, len(variants))
    xs = np.arange(len(shapes))
    cmap = plt.get_cmap("tab20")
    for i, v in enumerate(variants):
        ys = [val.get((s, v)) for s in shapes]
        ys = [np.nan if y is None else y * scale for y in ys]
        ax.bar(xs + (i - (len(variants) - 1) / 2) * width, ys, width, label=v, color=cmap(i % 20))
    ax.set_xticks(xs)
    ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
    if log:
        ax.set_yscale("log")
    return variants


def plot_results(results: dict[str, Any], out_dir: str) -> dict[str, str]:
    """One PNG per metric (rows: passes) in ``out_dir``; returns {"png_<metric>": path}."""
    recs = [r for r in results["records"] if r.get("kind") == "gemm" and r.get("status") == "ok"]
    passes = list(dict.fromkeys(r["pass"] for r in recs)) or ["fwd"]
    dev = results.get("device", {})
    title_dev = f"{dev.get('backend', '?')} / {dev.get('device_kind', '?')}"
    paths = {}
    for metric, (key, ylabel, scale, log) in METRICS.items():
        fig, axes = plt.subplots(
            len(passes), 1, figsize=(12, 3.6 * len(passes)), squeeze=False, constrained_layout=True
        )
        variants: list[str] = []
        for ax, p in zip(axes[:, 0], passes):
            sub = [r for r in recs if r["pass"] == p and r.get(key) is not None]
            if not sub:
                ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
                continue
            variants = _bar_panel(ax, sub, key, scale, log)
            if metric == "ratio_bf16":
                ax.axhline(1.0, color="k", lw=0.8, ls="--")
            ax.set_title(f"{p}  ({title_dev})", fontsize=9)
            ax.set_ylabel(ylabel, fontsize=8)
        if variants:
            axes[0, 0].legend(fontsize=6, ncol=4, loc="upper left", bbox_to_anchor=(0, 1.0))
        path = os.path.join(out_dir, f"{metric}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths[f"png_{metric}"] = path
    return paths
