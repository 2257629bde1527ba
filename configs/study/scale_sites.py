r"""Scale rules at DeepSeek-V3's sites: amax floors on gradients, power-of-two re-quantization.

Commands:
  python experiments/study.py --config=configs/study/scale_sites.py                  (about 8 minutes on a shared 2-core CPU)
  python experiments/study.py --config=configs/study/scale_sites.py --config.steps=0 (at init only)

What it prints: "## small config at init ..." and "## small config after 20
Adam steps ..." tables (per kind/operand: share of 1x128 groups with amax below
1e-4, flushed fraction and relative error with and without the 1e-4 floor),
"loss after 20 steps: ...", the Gaussian dy table at std 1e-9 / 1e-10, and two
"## Wgrad x ..." tables (direct vs re-quantized from the cached FP8 or E5M6
copy, arbitrary vs power-of-two scales).  Logic:
fp8jax.numerics.studies.scale_sites.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "scale_sites"  # fp8jax.numerics.studies.scale_sites
    c.steps = 20  # training steps before the second capture (0: init only)
    c.seed = 0  # seed of model and data
    return c
