r"""The late-failure stress comparison's monitors: when each fires against when the loss notices.

Reads the finished runs of a comparison (configs/compare/stress.py, trained
by experiments/compare_recipes.py) and writes ``monitors.md`` (per run and
seed: loss event, each monitor's first threshold crossing, lead in steps,
extreme value; ``fp8jax.lab.stress``; the same values as data in
``monitors.json``; the loss event is the first logged
step where the run's training loss, averaged over 10 logged steps, is
``loss_spike`` above the baseline run's at the same seed) and ``monitors.png``
(loss and the per-site monitors against steps, one colour per run; the first
seed).  Settings: configs/study/stress_monitors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_collections

from fp8jax.bench.experiments import items
from fp8jax.lab.compare import run_config, run_dir
from fp8jax.lab.stress import LOSS_WINDOW, format_lead_table, lead_records
from fp8jax.lab.telemetry_plot import plot_telemetry
from fp8jax.numerics.studies import StudyConfigError, one_run
from fp8jax.train.defaults import ConfigError, config_file
from fp8jax.train.fields import number, pattern, text
from fp8jax.train.run_log import find_log, read_jsonl, to_jsonable

# How far (relative) above the baseline's loss a run's averaged training
# loss must go to count as the loss noticing.
LOSS_SPIKE = 0.05

PLOT_STATS = ("loss", "outlier_ratio", "align_max", "amax_growth", "saturated", "noise_ratio")
# FFN sites: the down-projections' inputs and the SwiGLU monitors.
PLOT_SITES = r"^model$|swiglu|w2/x|w2/dy"


def analyze(
    config: ml_collections.ConfigDict,
    workdir: Path,
    *,
    loss_spike: float = LOSS_SPIKE,
    stats=PLOT_STATS,
    sites: str = PLOT_SITES,
) -> str:
    """Write monitors.md and monitors.png from the runs under ``workdir/runs``; returns the table."""
    workdir = Path(workdir)
    runs, seed0 = {}, {}
    for seed in config.compare.seeds:
        for label in config.compare.labels:
            rdir = run_dir(workdir / "runs", run_config(config, label, int(seed)), int(seed))
            log = find_log(rdir)
            if log is not None:
                runs[f"{label} seed {seed}"] = read_jsonl(log)
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
    records = lead_records(runs, spike=loss_spike, baselines=baselines)
    table = format_lead_table(records)
    (workdir / "monitors.md").write_text(table + "\n")
    # The same values as data: monitors.md recomputes from them once the
    # per-site columns of the logs are no longer committed.
    kept = {"spike": loss_spike, "window": LOSS_WINDOW, "runs": records}
    (workdir / "monitors.json").write_text(json.dumps(to_jsonable(kept), indent=1) + "\n")
    plot_telemetry(
        list(seed0.values()),
        workdir / "monitors.png",
        stats=stats,
        sites=sites,
        labels=list(seed0),
    )
    return table


# The settings (configs/study/stress_monitors.py) and what each accepts; the
# comparison file is checked when it loads.
FIELDS = {
    "comparison": text,
    "arg": text,
    "loss_spike": number(0, above=True),
    "stats": text,
    "sites": pattern,
}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    workdir = Path(one_run(runs, "stress_monitors"))
    if out_dir:
        raise StudyConfigError("stress_monitors writes into the comparison's directory (--run)")
    root = Path(__file__).resolve().parents[3] / "configs"
    try:
        comparison = config_file(root / c.comparison, *([c.arg] if c.arg else []))
        print(
            analyze(
                comparison,
                workdir,
                loss_spike=float(c.loss_spike),
                stats=items(c.stats),
                sites=c.sites,
            )
        )
    except ConfigError as e:
        raise StudyConfigError(str(e)) from None
