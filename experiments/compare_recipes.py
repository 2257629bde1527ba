r"""Compare recipes x seeds on the same data: python experiments/compare_recipes.py --config=FILE --workdir=DIR.

Three kinds of config, each with the command and what it prints in its docstring:

* a comparison (a ``compare`` block, configs/compare/*.py): trains every run
  under DIR/runs (finished runs are re-read, interrupted ones resumed) and
  writes DIR/results.md, results.json, loss_curves.png and gap_to_bf16.png;
* a sweep (a ``sweep`` block, configs/sweep/*.py): one comparison per value of
  a comparison config's argument, in DIR/<value>, then DIR/sweep.md,
  sweep.json and sweep.png (the gap to the baseline against the value);
* a comparison through fp8jax.interop (configs/compare/interop_llama.py:
  labels, seeds, model): DIR/results.json and results.md.

The runs must come from one commit and a clean tree (see --allow_mixed_code).
Mistakes print one line and exit 2; Ctrl-C / SIGTERM save the current run's
checkpoint and exit 130 / 143 with the command that resumes.
"""

import json
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from fp8jax.lab.compare import run_comparison
from fp8jax.lab.compare_sweep import plot_sweep, sweep_markdown, sweep_rows
from fp8jax.train.checkpoint import CheckpointError
from fp8jax.train.defaults import ConfigError, config_file, parse_seeds
from fp8jax.train.loop import TrainingDiverged, TrainingInterrupted
from fp8jax.train.run_log import to_jsonable
from fp8jax.train.runtime import (
    CACHE_HELP,
    default_jax_cache_dir,
    parse_flags,
    setup_runtime,
    usage_error,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Comparison, sweep or interop config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (results and every run).")
_CACHE = flags.DEFINE_string("jax_cache_dir", default_jax_cache_dir(), CACHE_HELP)
_MIXED = flags.DEFINE_bool(
    "allow_mixed_code",
    False,
    "Run from a modified tree and tabulate runs of different commits (a scratch comparison; "
    "the table says so). Off: a comparison's runs come from one commit and a clean tree.",
)
flags.mark_flags_as_required(["config", "workdir"])

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def sweep(config, workdir: Path, command: str) -> str:
    """One comparison per value of ``config.sweep.points``; returns sweep.md's text."""
    s = config.sweep
    labels = [x.strip() for x in str(s.labels).split(",") if x.strip()]
    configs = {}
    for value in (x.strip() for x in str(s.points).split(",") if x.strip()):
        try:
            c = config_file(CONFIGS / s.config, value)
            float(value)
        except ValueError as e:
            raise ConfigError(f"config.sweep.points: {value!r}: {e}") from None
        unknown = [lab for lab in labels if lab not in c.compare.runs]
        if unknown:
            raise ConfigError(f"config.sweep.labels: {unknown} not in {list(c.compare.runs)}")
        if labels:
            c.compare.labels = labels
        try:
            c.compare.seeds = list(parse_seeds(str(s.seeds)))
        except ValueError as e:
            raise ConfigError(f"config.sweep.seeds: {e}") from None
        configs[value] = c
    results = {}
    for value, c in configs.items():
        print(f"=== {s.value_name} {value}", flush=True)
        results[float(value)] = run_comparison(
            c, workdir / value, command=command, allow_mixed_code=_MIXED.value
        )
    rows = sweep_rows(results)
    text = f"# {s.title}\n\n`{command}`\n\n" + sweep_markdown(rows, s.value_name)
    (workdir / "sweep.md").write_text(text)
    (workdir / "sweep.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    plot_sweep(rows, workdir / "sweep.png", s.axis, s.plot_title)
    return text


def interop(config, workdir: Path, command: str) -> str:
    """A comparison through fp8jax.interop (the Qwix provider); returns results.md's text."""
    from fp8jax.lab.qwix_comparison import markdown, run

    results = run(config, allow_mixed_code=_MIXED.value)
    workdir.mkdir(parents=True, exist_ok=True)
    results["command"] = command
    (workdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=1) + "\n")
    text = markdown(results, command)
    (workdir / "results.md").write_text(text)
    return text


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --config=... --workdir=...")
    setup_runtime(_CACHE.value)
    command = "python " + " ".join(sys.argv)
    config, workdir = _CONFIG.value, Path(_WORKDIR.value)
    try:
        if "sweep" in config:
            text = sweep(config, workdir, command)
        elif "compare" not in config and "labels" in config:
            text = interop(config, workdir, command)
        else:
            text = run_comparison(config, workdir, command=command, allow_mixed_code=_MIXED.value)[
                "markdown"
            ]
    except ConfigError as e:
        usage_error(str(e))
    except (TrainingDiverged, CheckpointError) as e:
        usage_error(str(e), code=1)
    except TrainingInterrupted as e:
        usage_error(f"{e}; resume the comparison with: {command}", code=128 + e.signum)
    except KeyboardInterrupt:
        usage_error("interrupted before the first step of a run; nothing was saved", code=130)
    print(text)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
