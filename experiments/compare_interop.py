"""Paired recipe comparison on a model quantized through fp8jax.interop (see its config)."""

import json
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from fp8jax.lab.qwix_comparison import markdown, run
from fp8jax.train.defaults import ConfigError
from fp8jax.train.run_log import to_jsonable

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/compare/interop_llama.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "where results.json and results.md go")
_MIXED = flags.DEFINE_bool(
    "allow_mixed_code", False, "run from a modified tree (a scratch comparison; the table says so)"
)


def main(argv):
    del argv
    if not _WORKDIR.value:
        print("compare_interop.py: --workdir is required", file=sys.stderr)
        return 2
    workdir = Path(_WORKDIR.value)
    try:
        results = run(_CONFIG.value, allow_mixed_code=_MIXED.value)
    except ConfigError as e:
        print(f"compare_interop.py: {e}", file=sys.stderr)
        return 2
    workdir.mkdir(parents=True, exist_ok=True)
    results["command"] = " ".join(["python"] + sys.argv)
    (workdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=1) + "\n")
    text = markdown(results, results["command"])
    (workdir / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
