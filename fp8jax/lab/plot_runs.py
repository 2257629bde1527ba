"""Several runs' curves in one figure: ``fp8jax runs plot DIR... --out FILE``.

Each DIR is a run directory (it holds ``metrics.jsonl``, or ``metrics.jsonl.gz``
as the committed results do) or a folder of runs (every such log below it,
e.g. a comparison's ``runs/``); a run is
labelled by its path.  One panel per metric (default: training loss and
validation loss against the step); a run keeps one colour and one line style
in every panel (colour and line style both change from one run to the next),
so curves stay told apart in print and in grey.

Logs are read by :func:`fp8jax.train.run_log.read_jsonl`: a malformed row is
left out of the picture with one line naming its file and line, a log that
is not a regular file (a FIFO, a device) or is too large is refused.  The
PNG is written to exactly the path given (no suffix added).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fp8jax.train.defaults import ConfigError
from fp8jax.train.run_log import LOG_NAMES, DamagedLog, as_float, find_log, read_jsonl

DEFAULT_KEYS = ("loss", "val_loss")
_STYLES = ("-", "--", ":", "-.")


def find_runs(paths: list[str | Path]) -> list[tuple[str, Path]]:
    """(label, log) of every run under ``paths``, in the order given (then sorted).

    A run's log is its metrics.jsonl, else its metrics.jsonl.gz (:func:`find_log`).
    """
    found: list[tuple[str, Path]] = []
    for raw in paths:
        p = Path(raw)
        log = find_log(p)
        if log is not None and log.is_file():
            found.append((str(p), log))
            continue
        if not p.is_dir():
            raise ConfigError(f"{str(raw)!r} is not a run directory or a folder of runs")
        runs = sorted({m.parent for name in LOG_NAMES for m in p.rglob(name)})
        if not runs:
            raise ConfigError(f"no metrics.jsonl under {str(raw)!r}: give run directories")
        found += [(os.path.join(str(p), str(r.relative_to(p))), find_log(r)) for r in runs]
    return found


def run_styles(n: int) -> list[dict]:
    """Matplotlib line styles for ``n`` runs: colour and line style both change from run to run.

    Ten colours and four line styles: no two of the first twenty runs look alike.
    """
    import matplotlib

    colours = matplotlib.colormaps["tab10"].colors
    return [
        {"color": colours[i % len(colours)], "linestyle": _STYLES[i % len(_STYLES)]}
        for i in range(n)
    ]


def curve(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key`` in the rows that carry it (null read as NaN)."""
    pts = [(int(r["step"]), as_float(r[key])) for r in rows if key in r]
    if not pts:
        return np.zeros(0, np.int64), np.zeros(0)
    steps, vals = zip(*pts)
    return np.asarray(steps), np.asarray(vals, np.float64)


def figure(rows: dict[str, list[dict]], keys: tuple[str, ...] = DEFAULT_KEYS):
    """A matplotlib Figure: one panel per key, one line per run (label -> rows)."""
    import matplotlib.pyplot as plt

    missing = [k for k in keys if not any(curve(r, k)[0].size for r in rows.values())]
    if missing:
        raise ConfigError(f"no run logs {', '.join(missing)}: choose --keys among the logged ones")
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False)
    for label, style in zip(rows, run_styles(len(rows))):
        for ax, key in zip(axes[0], keys):
            s, v = curve(rows[label], key)
            # Sparse curves (validation) get markers: a few points read as points.
            marker = "o" if 0 < s.size <= 30 else None
            ax.plot(s, v, label=label, lw=1.3, marker=marker, ms=3, **style)
    for ax, key in zip(axes[0], keys):
        ax.set(xlabel="step", ylabel=key, title=key)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(rows), 3), fontsize=8)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(rows) - 1) // 3), 1, 1))
    return fig


def plot_runs(
    paths: list[str | Path],
    out: str | Path,
    keys: tuple[str, ...] = DEFAULT_KEYS,
    say: Callable[[str], None] | None = None,
) -> Path:
    """Write :func:`figure` of the runs under ``paths`` as a PNG at ``out``; returns ``out``.

    ``say`` gets one line per log with rows left out (default: a warning).
    ConfigError (one line) for an ``out`` that is a directory and for a log
    that cannot be read.
    """
    import matplotlib.pyplot as plt

    out = Path(out)
    if out.is_dir():
        raise ConfigError(
            f"--out {str(out)!r} is a directory: give a file, e.g. {out / 'runs.png'}"
        )
    try:
        rows = {
            label: read_jsonl(path, say, skip_malformed=True) for label, path in find_runs(paths)
        }
    except DamagedLog as e:
        raise ConfigError(str(e)) from None
    fig = figure(rows, keys)
    out.parent.mkdir(parents=True, exist_ok=True)
    # format given: matplotlib would otherwise add ".png" to a name without a suffix.
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return out
