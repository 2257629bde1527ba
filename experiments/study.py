r"""Run one numerics study: python experiments/study.py --config=configs/study/NAME.py [--run=DIR] [--out_dir=DIR].

The config names the study (``config.study``: accumulation, block_rules,
captured_gemm_error, dgrad_blocks, gemm_error, plot_telemetry, scale_sites,
site_errors or stress_monitors) and holds its settings; its docstring gives the command and what
it prints.  Override any field, e.g. --config.m=512; every field is checked
(type, range, names, memory) before the study starts.  --run names the trained
runs a study reads (comma-separated directories of experiments/train.py);
--out_dir is where it writes its tables and plots.  Logic:
fp8jax.numerics.studies.  Mistakes print one line and exit 2.
"""

from absl import app, flags
from ml_collections import config_flags

from fp8jax.numerics.studies import checked_runner
from fp8jax.train.fields import ConfigError
from fp8jax.train.runtime import parse_flags, usage_error

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Study config file (configs/study/*.py).", lock_config=True
)
_RUN = flags.DEFINE_list("run", [], "Trained run directories the study reads (comma-separated).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the study writes its tables and plots.")
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        usage_error(
            f"unexpected arguments {argv[1:]}: flags are --config=... [--run=DIR,...] "
            "[--out_dir=DIR]"
        )
    c = _CONFIG.value
    try:
        checked_runner(c)(c, list(_RUN.value), _OUT_DIR.value)
    except ConfigError as e:
        usage_error(str(e))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
