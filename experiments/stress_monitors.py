r"""The late-failure stress comparison and its monitors (configs/compare/stress.py has the commands).

Trains every run of the comparison (``fp8jax.lab.compare.run_comparison``:
results.md, results.json, plots), then writes ``monitors.md`` (per run and
seed: loss event, each monitor's first threshold crossing, lead in steps,
extreme value; ``fp8jax.lab.stress``; the loss event is the first logged
step where the run's training loss, averaged over 10 logged steps, is 5%
above the baseline run's at the same seed) and ``monitors.png`` (loss and the
per-site monitors against steps, one colour per run; seed 0).
``--analyze_only`` skips training and reads the finished runs.  Exit code 2
with one line for a bad config or workdir.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from fp8jax.lab.compare import run_comparison, run_config, run_dir
from fp8jax.lab.stress import lead_table
from fp8jax.lab.telemetry_plot import plot_telemetry
from fp8jax.train.defaults import ConfigError
from fp8jax.train.run_log import read_jsonl

_CONFIG = config_flags.DEFINE_config_file("config", None, "a comparison config", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "comparison directory (runs under DIR/runs)")
_ANALYZE = flags.DEFINE_bool("analyze_only", False, "only tabulate and plot finished runs")
flags.mark_flags_as_required(["config", "workdir"])

# How far (relative) above the baseline's loss a run's averaged training
# loss must go to count as the loss noticing.
LOSS_SPIKE = 0.05

PLOT_STATS = ("loss", "outlier_ratio", "align_max", "amax_growth", "saturated", "noise_ratio")


def analyze(config, workdir: Path) -> str:
    """Write monitors.md and monitors.png from the runs under ``workdir/runs``; returns the table."""
    runs, seed0 = {}, {}
    for seed in config.compare.seeds:
        for label in config.compare.labels:
            rdir = run_dir(workdir / "runs", run_config(config, label, int(seed)), int(seed))
            if (rdir / "metrics.jsonl").is_file():
                runs[f"{label} seed {seed}"] = read_jsonl(rdir / "metrics.jsonl")
                if int(seed) == int(config.compare.seeds[0]):
                    seed0[label] = rdir
    if not runs:
        raise ConfigError(f"no finished runs under {workdir / 'runs'}: train them first")
    # The loss event: the run's training loss, averaged over 100 steps, 5%
    # above the baseline run's (bf16) at the same seed and steps.
    base = config.compare.baseline
    baselines = {
        f"{label} seed {seed}": runs.get(f"{base} seed {seed}")
        for seed in config.compare.seeds
        for label in config.compare.labels
    }
    table = lead_table(runs, spike=LOSS_SPIKE, baselines=baselines)
    (workdir / "monitors.md").write_text(table + "\n")
    plot_telemetry(
        list(seed0.values()),
        workdir / "monitors.png",
        stats=PLOT_STATS,
        # FFN sites: the down-projections' inputs and the SwiGLU monitors.
        sites=r"^model$|swiglu|w2/x|w2/dy",
        labels=list(seed0),
    )
    return table


def main(argv):
    del argv
    config, workdir = _CONFIG.value, Path(_WORKDIR.value)
    try:
        if not _ANALYZE.value:
            res = run_comparison(config, workdir, command=" ".join(sys.argv))
            print(res["markdown"])
        print(analyze(config, workdir))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
