r"""Plot the per-site telemetry of one or several training runs (one colour per run).

Command (two runs of the tiny model, the attention sites of block 0 and the SwiGLU monitors):
  python experiments/plot_telemetry.py --out=/tmp/telemetry.png --sites='layer0|swiglu|tokens' /tmp/run_a /tmp/run_b

What it writes: a PNG with one panel per statistic (saturated and flushed
fractions, amax growth, SwiGLU outlier ratio and alignment, gradient-noise
ratio, tokens per expert; those the runs logged), every run in one colour in
every panel, every site in one line style and marker
(:func:`fp8jax.lab.telemetry_plot.plot_telemetry`).  Exit code 2 with one
line when a directory holds no metrics.jsonl or nothing matches.
"""

from __future__ import annotations

import sys

from absl import app, flags

from fp8jax.lab.telemetry_plot import DEFAULT_STATS, plot_telemetry

_OUT = flags.DEFINE_string("out", "telemetry.png", "PNG to write")
_STATS = flags.DEFINE_list("stats", list(DEFAULT_STATS), "statistics, one panel each")
_SITES = flags.DEFINE_string("sites", None, "regular expression the site names must match")
_LABELS = flags.DEFINE_list("labels", None, "legend names of the runs (default: directory names)")


def main(argv):
    dirs = argv[1:]
    if not dirs:
        print("error: give one or more run directories", file=sys.stderr)
        return 2
    try:
        out = plot_telemetry(
            dirs, _OUT.value, stats=_STATS.value, sites=_SITES.value, labels=_LABELS.value
        )
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
