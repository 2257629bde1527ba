r"""Plot the per-site telemetry of one or several training runs (one colour per run).

Command (two runs of the tiny model, the attention sites of block 0 and the SwiGLU monitors):
  python experiments/study.py --config=configs/study/plot_telemetry.py --config.sites='layer0|swiglu|tokens' --run=/tmp/run_a,/tmp/run_b --out_dir=/tmp

What it prints: "wrote DIR/telemetry.png" (DIR: --out_dir, default the current
directory), a PNG with one panel per statistic (saturated and flushed
fractions, amax growth, SwiGLU outlier ratio and alignment, gradient-noise
ratio, tokens per expert; those the runs logged), every run in one colour in
every panel, every site in one line style and marker.  One line and exit
code 2 when a directory holds no metrics.jsonl or nothing matches.  The plot of
experiments/results/monitors: configs/study/monitors_example.py.  Logic:
fp8jax.numerics.studies.plot_telemetry.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "plot_telemetry"  # fp8jax.numerics.studies.plot_telemetry
    c.png = "telemetry.png"  # file name of the plot in --out_dir
    # Statistics, one panel each, comma-separated ("": fp8jax.lab.telemetry_plot.DEFAULT_STATS).
    c.stats = ""
    c.sites = ""  # regular expression the site names must match ("": every site)
    c.labels = ""  # legend names of the runs, comma-separated ("": the directory names)
    return c
