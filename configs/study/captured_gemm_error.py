r"""GEMM error of each recipe on the activations, weights and gradients of a trained model.

Commands (train the small model in BF16, then measure on its tensors):
  python experiments/train.py --config=configs/small.py --config.recipe=bf16 --workdir=/tmp/fp8jax_small_bf16
  python experiments/study.py --config=configs/study/captured_gemm_error.py --run=/tmp/fp8jax_small_bf16 --out_dir=/tmp/captured

What it prints: per GEMM site (dense projections ``denseI``; routed experts
``expertI`` on the expert with the most tokens) and recipe a line of the
relative errors of y, dx and dW, whole tensor (*_rel) and median token (*_tok),
then the run's description, the Markdown table of them all and the
accumulation error alone of the ``acc_*`` rows against their exact-accumulation
twins.  --out_dir=DIR writes the tables to DIR/table.md.  Logic:
fp8jax.numerics.studies.captured_gemm_error.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "captured_gemm_error"  # fp8jax.numerics.studies.captured_gemm_error
    c.batch = 16  # held-out sequences captured (Wgrad's K / seq_len)
    c.seed = 0  # which held-out windows
    # GEMM sites, in the model's trace order (the first block: attention in / out,
    # FFN up / down; then the first MoE block's routed experts up / down).
    c.sites = "dense0,dense1,dense2,dense3,expert0,expert1"
    # Recipes, comma-separated (fp8jax.registry.get names).
    c.recipes = (
        "bf16,deepseek_v3,current_tensor,hybrid_delayed,rowwise,mxfp8,nvfp4,"
        "acc_no_promote,acc_promote128,acc_tiles"
    )
    return c
