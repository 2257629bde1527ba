"""The headline comparison (configs/compare/headline.py) restricted to its bf16 and deepseek_v3 labels.

Usage (from a clean checkout of the commit the runs come from, PYTHONPATH there):
  python two_arms.py SEEDS WORKDIR      e.g.  python two_arms.py 24,26,28 /tmp/fp8jax_cmp/headline
The runs are the same runs compare_recipes.py trains for these labels (the run
directory is keyed by the training config, which does not include the label list).
"""

import importlib.util
import sys
from pathlib import Path

import fp8jax
from fp8jax.lab.compare import run_comparison
from fp8jax.train.runtime import default_jax_cache_dir, setup_runtime

root = Path(fp8jax.__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "headline", root / "configs" / "compare" / "headline.py"
)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
seeds, workdir = sys.argv[1], sys.argv[2]
c = mod.get_config(seeds)
c.compare.labels = ["bf16", "deepseek_v3"]
setup_runtime(default_jax_cache_dir())
res = run_comparison(c, workdir, command="python two_arms.py " + " ".join(sys.argv[1:]))
print(res["markdown"])
