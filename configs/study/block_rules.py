r"""Block-format rules on a trained model's tensors: saturated / flushed fractions and GEMM error.

Commands (train the tiny model in BF16, then measure on its tensors):
  python experiments/train.py --config=configs/tiny.py --config.recipe=bf16 --config.steps=120 --workdir=/tmp/fp8jax_tiny_bf16
  python experiments/study.py --config=configs/study/block_rules.py --run=/tmp/fp8jax_tiny_bf16 --out_dir=experiments/results/block_rules

What it prints: per GEMM site and rule a line of the saturated and flushed
fractions of x, w and dy and the relative errors of y, dx and dW, then the
run's description, the table of the rules' means over the sites and the table
per site.  Rules: mxfp8 (E8M0 scales rounded down), mxfp8_ceil (rounded up),
nvfp4_all_layers, and nvfp4 (nvfp4_all_layers with bf16's rows on the sites of
``last_block_sites``).  --out_dir=DIR writes the tables to DIR/table.md.  Logic:
fp8jax.numerics.studies.block_rules.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "block_rules"  # fp8jax.numerics.studies.block_rules
    c.batch = 16  # held-out sequences captured
    c.seed = 0  # which held-out windows
    c.rules = "bf16,mxfp8,mxfp8_ceil,nvfp4_all_layers"  # recipes measured per site
    # Sites of the blocks the nvfp4 preset keeps in BF16 (tiny model: its second
    # and last block: attention in / out, routed experts up / down, shared
    # expert up / down).
    c.last_block_sites = "dense4,dense5,dense6,dense7,expert0,expert1"
    return c
