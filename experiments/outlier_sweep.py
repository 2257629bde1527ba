r"""Massive activations swept over magnitude: where per-tensor scaling breaks, where tiles do.

Command (every magnitude, every run of configs/compare/outlier_sweep.py, 2 seeds):
  python experiments/outlier_sweep.py --workdir=/tmp/fp8jax_cmp/outlier_sweep

A smaller sweep (four recipes, the injected faults left out):
  python experiments/outlier_sweep.py --workdir=DIR --labels=bf16,deepseek_v3,tensor_current,tensor_delayed

Runs configs/compare/outlier_sweep.py at each ``--magnitudes`` value (in units of
the median |activation| at every FFN down-projection input) into
``DIR/<magnitude>`` (resumable: finished runs are re-read), then writes
``DIR/sweep.md`` (the paired val-loss gap to bf16 with its 95% interval, the
verdict on +-0.25%, flushed and saturated fractions, per magnitude and run),
``DIR/sweep.json`` and ``DIR/sweep.png`` (gap and flushed fraction against
magnitude).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags

import fp8jax
from fp8jax.lab.compare import run_comparison
from fp8jax.lab.compare_sweep import plot_sweep, sweep_markdown, sweep_rows
from fp8jax.train.defaults import ConfigError, config_file
from fp8jax.train.runtime import CACHE_HELP, default_jax_cache_dir, setup_runtime, usage_error

_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (one comparison per magnitude)")
_MAGNITUDES = flags.DEFINE_list("magnitudes", ["1e2", "1e3", "1e4", "1e5"], "x median |h|")
_LABELS = flags.DEFINE_list(
    "labels", None, "runs of configs/compare/outlier_sweep.py (default: all)"
)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1"], "seeds of every run")
_CACHE = flags.DEFINE_string("jax_cache_dir", default_jax_cache_dir(), CACHE_HELP)
flags.mark_flag_as_required("workdir")

CONFIG = Path(fp8jax.__file__).resolve().parents[1] / "configs" / "compare" / "outlier_sweep.py"


def _config(magnitude: str):
    c = config_file(CONFIG, magnitude)
    if _LABELS.value:
        unknown = [lab for lab in _LABELS.value if lab not in c.compare.runs]
        if unknown:
            raise ConfigError(f"--labels: {unknown} not in {list(c.compare.runs)}")
        c.compare.labels = list(_LABELS.value)
    c.compare.seeds = [int(s) for s in _SEEDS.value]
    return c


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}")
    setup_runtime(_CACHE.value)
    root = Path(_WORKDIR.value)
    command = "python " + " ".join(sys.argv)
    results = {}
    try:
        configs = {m: _config(m) for m in _MAGNITUDES.value}
        for m, c in configs.items():
            print(f"=== magnitude {m} x median |h|", flush=True)
            results[float(m)] = run_comparison(c, root / m, command=command)
    except (ConfigError, ValueError) as e:
        usage_error(str(e))
    rows = sweep_rows(results)
    text = f"# Massive activations: gap to bf16 vs magnitude\n\n`{command}`\n\n" + sweep_markdown(
        rows, "magnitude (x median |h|)"
    )
    (root / "sweep.md").write_text(text)
    (root / "sweep.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    plot_sweep(
        rows,
        root / "sweep.png",
        "injected magnitude (x median |h|)",
        "Massive activations at every FFN down-projection input",
    )
    print(text)


if __name__ == "__main__":
    app.run(main)
