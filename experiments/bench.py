r"""Run one benchmark: python experiments/bench.py --config=configs/bench/NAME.py [--out_dir=DIR].

The config names the benchmark (``config.benchmark``: core, kernels, memory,
model_step, parallel or sweep) and holds its sizes; its docstring gives the
command and what it prints.  Override any field, e.g. --config.iters=3; every
field is checked (type, range, names, memory) before the benchmark starts.  With
--out_dir the benchmark also writes what it measured there (results.json; the
sweep also results.csv and PNGs, and needs it).  Logic:
fp8jax.bench.experiments.  Mistakes print one line and exit 2.
"""

from absl import app, flags
from ml_collections import config_flags

from fp8jax.bench.experiments import checked_benchmark
from fp8jax.train.fields import ConfigError
from fp8jax.train.runtime import parse_flags, usage_error

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Benchmark config file (configs/bench/*.py).", lock_config=True
)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where results.json (and the sweep's CSV/PNGs) go.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --config=... [--out_dir=...]")
    c = _CONFIG.value
    try:
        checked_benchmark(c)(c, _OUT_DIR.value)
    except ConfigError as e:
        usage_error(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
