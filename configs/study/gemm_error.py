r"""GEMM error of each recipe on Gaussian and LLM-like inputs, against float64.

Commands:
  python experiments/study.py --config=configs/study/gemm_error.py                  # M=K=N=1024
  python experiments/study.py --config=configs/study/gemm_error.py --config.m=512 --config.k=512 --config.n=512 --out_dir=/tmp/gemm_error

What it prints: per input kind and preset a line of the relative errors of y,
dx and dW over the whole tensor (*_rel) and of the median token (*_tok), the
Markdown table of them all, then the massive-activation check, e.g.
  massive activations, per-token median y error: current_tensor / deepseek_v3 = ...x (OK, goal >= 2x)
--out_dir=DIR writes the table to DIR/table.md.  Logic:
fp8jax.numerics.studies.gemm_error.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "gemm_error"  # fp8jax.numerics.studies.gemm_error
    c.m = 1024  # tokens
    c.k = 1024  # input features
    c.n = 1024  # output features
    c.seed = 0  # seed of the inputs (fp8jax.numerics.inputs.make_gemm_inputs)
    # Presets, comma-separated (fp8jax.registry.get names).
    c.recipes = "bf16,deepseek_v3,current_tensor,rowwise,hybrid_delayed,mxfp8,nvfp4"
    return c
