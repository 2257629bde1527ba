r"""The late-failure stress comparison's monitors: their lead over the loss.

Commands (train the comparison of configs/compare/stress.py, then read its runs):
  python experiments/compare_recipes.py --config=configs/compare/stress.py --workdir=/tmp/fp8jax_cmp/stress
  python experiments/study.py --config=configs/study/stress_monitors.py --run=/tmp/fp8jax_cmp/stress

The study reads the finished runs only (it trains nothing), so it also reads a
comparison still in progress.  What it prints: the table of monitors.md, per
run and seed the first logged step where the loss notices (the training loss,
averaged over 10 logged steps, ``loss_spike`` above bf16's at the same seed and
steps, or non-finite), the first step each monitor crosses its threshold
(fp8jax.lab.stress), the lead in steps and the extreme value reached.
Writes monitors.md and monitors.png (loss and monitors against steps, one
colour per run, the first seed) into the comparison's directory.  Logic:
fp8jax.numerics.studies.stress_monitors.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "stress_monitors"  # fp8jax.numerics.studies.stress_monitors
    c.comparison = "compare/stress.py"  # the comparison config (under configs/) of the runs
    c.arg = ""  # its argument: seeds such as "0-2", or "smoke" ("": its default)
    c.loss_spike = 0.05  # relative rise over the baseline's loss that counts as the loss event
    # Panels of monitors.png, and the sites drawn (the FFN's: down-projection inputs, SwiGLU).
    c.stats = "loss,outlier_ratio,align_max,amax_growth,saturated,noise_ratio"
    c.sites = r"^model$|swiglu|w2/x|w2/dy"
    return c
