r"""Run one benchmark: python experiments/bench.py --config=configs/bench/NAME.py [--out_dir=DIR].

The config names the benchmark (``config.benchmark``: core, kernels, memory,
model_step, parallel or sweep) and holds its sizes; its docstring gives the
command and what it prints.  Override any field, e.g. --config.iters=3; every
field is checked (type, range, names, memory) before the benchmark starts.  With
--out_dir the benchmark also writes what it measured there (results.json; the
sweep also results.csv and PNGs, and needs it).  Logic:
fp8jax.bench.experiments.  Mistakes print one line and exit 2.

Without ml_collections (the GPU image) the same flags are read by
fp8jax.bench.config_file, for the config files that build their fields with
its ``new_config`` (configs/bench/sweep.py, what scripts/gpu_sweep.sh runs).
"""

import sys

from absl import app, flags

from fp8jax.bench.experiments import checked_benchmark
from fp8jax.train.fields import ConfigError
from fp8jax.train.runtime import parse_flags, usage_error

try:
    from ml_collections import config_flags
except ImportError:  # read by fp8jax.bench.config_file instead
    config_flags = None

if config_flags is not None:
    _CONFIG = config_flags.DEFINE_config_file(
        "config", None, "Benchmark config file (configs/bench/*.py).", lock_config=True
    )
    _OUT_DIR = flags.DEFINE_string(
        "out_dir", None, "Where results.json (and the sweep's CSV/PNGs) go."
    )
    flags.mark_flags_as_required(["config"])


def run(c, out_dir: str | None) -> None:
    """Run the benchmark ``c.benchmark`` names once its fields are checked; a bad
    name or value is one line, exit 2."""
    try:
        checked_benchmark(c)(c, out_dir)
    except ConfigError as e:
        usage_error(str(e))


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --config=... [--out_dir=...]")
    run(_CONFIG.value, _OUT_DIR.value)


def main_without_ml_collections(argv: list[str]) -> None:
    from fp8jax.bench.config_file import parse_argv

    try:
        config, out_dir = parse_argv(argv[1:])
    except ValueError as e:
        usage_error(str(e))
    run(config, out_dir)


if __name__ == "__main__":
    if config_flags is None:
        main_without_ml_collections(sys.argv)
    else:
        app.run(main, flags_parser=parse_flags)
