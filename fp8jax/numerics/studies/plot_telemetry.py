r"""Plot the per-site telemetry of one or several training runs (one colour per run).

Writes a PNG (``config.png`` in the output directory) with one panel per
statistic (saturated and flushed fractions, amax growth, SwiGLU outlier ratio
and alignment, gradient-noise ratio, tokens per expert; those the runs logged),
every run in one colour in every panel, every site in one line style and
marker (:func:`fp8jax.lab.telemetry_plot.plot_telemetry`).  A directory
without metrics.jsonl, or nothing matching, raises StudyConfigError.
Settings: configs/study/plot_telemetry.py.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from fp8jax.bench.experiments import items
from fp8jax.lab.telemetry_plot import DEFAULT_STATS, plot_telemetry
from fp8jax.numerics.studies import StudyConfigError
from fp8jax.train.fields import file_name, pattern, text

# The settings (configs/study/plot_telemetry.py) and what each accepts.
FIELDS = {
    "png": file_name,
    "stats": text,
    "sites": pattern,
    "labels": text,
}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    if not runs:
        raise StudyConfigError("give one or more run directories: --run=DIR[,DIR...]")
    out = Path(out_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    try:
        path = plot_telemetry(
            runs,
            out / c.png,
            stats=items(c.stats) or list(DEFAULT_STATS),
            sites=c.sites or None,
            labels=items(c.labels) or None,
        )
    except (OSError, ValueError) as e:
        raise StudyConfigError(str(e)) from None
    print(f"wrote {path}")
