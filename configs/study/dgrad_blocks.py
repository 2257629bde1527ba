r"""128x128 blocks for Dgrad's activation gradient: what they cost each token, on a trained model.

Commands (train the small model in BF16, then measure on its gradients):
  python experiments/train.py --config=configs/small.py --config.recipe=bf16 --workdir=/tmp/fp8jax_small_bf16
  python experiments/study.py --config=configs/study/dgrad_blocks.py --run=/tmp/fp8jax_small_bf16 --out_dir=/tmp/dgrad_blocks

What it prints: per GEMM site two rows (1x128 tiles, 128x128 blocks) of the
Markdown table: dy's relative error whole and per token (median / p90 / p99),
the flushed share, how far below its group's amax a token's amax lies, and the
error that reaches dx = dy W^T; then the whole table.  Writes
DIR/dgrad_blocks.md and DIR/dgrad_blocks.png (--out_dir is required).  Logic:
fp8jax.numerics.studies.dgrad_blocks.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "dgrad_blocks"  # fp8jax.numerics.studies.dgrad_blocks
    c.batch = 16  # held-out sequences captured
    c.seed = 0  # which held-out windows
    return c
