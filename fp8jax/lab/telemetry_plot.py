"""Per-site telemetry of one or several runs, against steps, in one figure.

Reads the ``layers/<site>/<stat>`` columns of each run's metrics.jsonl (or .gz)
(:mod:`fp8jax.train.run_log`) and draws one panel per statistic.  Every run
has one colour in every panel; within a run, each site has its own line
style and marker, the same in every panel, so lines stay distinguishable in
grey print too.  Vector statistics (tokens per expert) count each entry as a
site (``<site>[i]``); the run's ``loss`` and ``val_loss`` are statistics of
the site "model".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt

from fp8jax.train.run_log import as_float, find_log, read_jsonl

DEFAULT_STATS = (
    "loss",
    "saturated",
    "flushed",
    "amax_growth",
    "outlier_ratio",
    "align_max",
    "noise_ratio",
    "count",
)
# Whole-run columns drawn next to the per-site ones.
RUN_STATS = ("loss", "val_loss")
# Statistics spanning decades are drawn on a log axis.
LOG_STATS = ("amax", "amax_growth", "outlier_ratio", "noise_ratio")
_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*")


def split_key(key: str) -> tuple[str, str] | None:
    """``layers/<site>/<stat>`` -> (site, stat); ``.../<stat>/<i>`` -> ("<site>[i]", stat)."""
    parts = key.split("/")
    if parts[0] != "layers" or len(parts) < 3:
        return None
    if parts[-1].isdigit() and len(parts) >= 4:
        return f"{'/'.join(parts[1:-2])}[{parts[-1]}]", parts[-2]
    return "/".join(parts[1:-1]), parts[-1]


def load_series(run_dir: str | Path) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """(site, stat) -> (steps, values) of one run's per-site columns (null -> NaN)."""
    path = find_log(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a training run directory)")
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for row in read_jsonl(path):
        for key, value in row.items():
            parsed = ("model", key) if key in RUN_STATS else split_key(key)
            if parsed is None:
                continue
            steps, vals = series.setdefault(parsed, ([], []))
            steps.append(int(row["step"]))
            vals.append(as_float(value))
    return series


def plot_telemetry(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    *,
    stats: Sequence[str] = DEFAULT_STATS,
    sites: str | None = None,
    labels: Sequence[str] | None = None,
) -> Path:
    """Write a PNG of the per-site telemetry of ``run_dirs`` to ``out``.

    ``stats``: the statistics to draw, one panel each (those no run logged are
    skipped); ``sites``: a regular expression the site names must match
    (``re.search``), all sites when None; ``labels``: legend names of the runs
    (default: the directory names).  Raises ValueError when nothing matches.
    """
    if not run_dirs:
        raise ValueError("give at least one run directory")
    labels = list(labels) if labels is not None else [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    pattern = re.compile(sites) if sites else None
    runs = [load_series(d) for d in run_dirs]
    chosen = {
        stat: sorted(
            {s for r in runs for (s, st) in r if st == stat and (not pattern or pattern.search(s))}
        )
        for stat in stats
    }
    chosen = {k: v for k, v in chosen.items() if v}
    if not chosen:
        raise ValueError(
            f"no per-site telemetry for stats {list(stats)}"
            + (f" and sites matching {sites!r}" if sites else "")
            + " in these runs"
        )
    # One style per site, fixed across panels; one colour per run.
    all_sites = list(dict.fromkeys(s for v in chosen.values() for s in v))
    # Marker and line style both change from one site to the next (32 distinct looks).
    style = {
        s: (_MARKERS[i % len(_MARKERS)], _STYLES[(i + i // len(_MARKERS)) % len(_STYLES)])
        for i, s in enumerate(all_sites)
    }
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = len(chosen)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, (stat, stat_sites) in zip(axes.flat, chosen.items()):
        for i, series in enumerate(runs):
            for site in stat_sites:
                if (site, stat) not in series:
                    continue
                steps, vals = series[(site, stat)]
                marker, line = style[site]
                ax.plot(
                    steps,
                    vals,
                    color=colours[i % len(colours)],
                    linestyle=line,
                    marker=marker,
                    markersize=3,
                    linewidth=1.1,
                )
        if stat in LOG_STATS:
            ax.set_yscale("log")
        ax.set(title=stat, xlabel="step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    run_handles = [
        plt.Line2D([], [], color=colours[i % len(colours)], linewidth=2.5)
        for i in range(len(labels))
    ]
    site_handles = [
        plt.Line2D([], [], color="0.3", linestyle=style[s][1], marker=style[s][0], markersize=4)
        for s in all_sites
    ]
    # Legends below the panels: runs by colour, sites by style.
    site_rows = math.ceil(len(all_sites) / 4)
    bottom = min(0.5, (0.35 + 0.22 * max(site_rows, len(labels))) / fig.get_figheight())
    fig.legend(run_handles, labels, loc="lower left", title="run (colour)", fontsize=8)
    fig.legend(site_handles, all_sites, loc="lower right", title="site (style)", fontsize=7, ncol=4)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
