"""The accumulation study's draws: each K's operands depend on (seed, K) only."""

import numpy as np

from fp8jax.numerics import accumulation_study as study


def test_error_vs_k_row_does_not_depend_on_other_ks():
    both = study.error_vs_k("gaussian", [256, 512], m=8, n=8, seed=3)
    alone = study.error_vs_k("gaussian", [512], m=8, n=8, seed=3)
    assert both[1] == alone[0]
    # The operands themselves: numpy's generator seeded with (seed, K).
    x, w = study.sample_operands("gaussian", 8, 512, 8, seed=(3, 512))
    rng = np.random.default_rng((3, 512))
    np.testing.assert_array_equal(x, rng.standard_normal((8, 512)).astype(np.float32))
    np.testing.assert_array_equal(w, rng.standard_normal((512, 8)).astype(np.float32))
    assert study.error_vs_k("gaussian", [512], m=8, n=8, seed=4)[0] != alone[0]
