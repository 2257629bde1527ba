"""Paired recipe comparison on a model quantized through fp8jax.interop (see its config)."""

import json
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from fp8jax.interop.compare import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/compare/interop_llama.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "where results.json goes")


def main(argv):
    del argv
    if not _WORKDIR.value:
        print("compare_interop.py: --workdir is required", file=sys.stderr)
        return 2
    workdir = Path(_WORKDIR.value)
    workdir.mkdir(parents=True, exist_ok=True)
    results = run(_CONFIG.value)
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    for label, r in results.items():
        line = f"{label}: val {r['val_loss']}"
        if "gap" in r:
            g = r["gap"]
            line += f" | gap {g['mean']:+.3%} [{g['lo']:+.3%}, {g['hi']:+.3%}] {r['verdict']}"
        print(line)
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
