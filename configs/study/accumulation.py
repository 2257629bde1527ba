r"""FP8 GEMM error vs K under the Hopper accumulation model, per input distribution.

Commands:
  python experiments/study.py --config=configs/study/accumulation.py        # results in a new temporary directory
  python experiments/study.py --config=configs/study/accumulation.py --out_dir=/tmp/acc --config.ks=256,1024,4096

What it prints: the distributions and columns, then per distribution and K the
max and median relative error of y without promotion, with promotion every 128
and with DeepSeek-V3's scales (fp8jax/numerics/accumulation_study.py), the
emulator's time against a float32 matmul, e.g.
  speed (M,K,N)=(256, 1024, 256): emulated ... ms, f32 matmul ... ms (medians, jitted), ratio ...x
and "wrote DIR/table.txt, error_vs_k.json, error_vs_k.png".  Each K's inputs
are drawn from (seed, K), so --config.ks=4096 alone gives the K = 4096 row of
the full table.  (Before this, K was seeded by its position in the K list;
tables made that way, such as the README's from commit 7806fae, are not
reproduced by a rerun's draws.)  Logic: fp8jax.numerics.studies.accumulation.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "accumulation"  # fp8jax.numerics.studies.accumulation
    c.m = 32  # rows of x (tokens)
    c.n = 32  # columns of w (output features)
    # Input distributions, comma-separated ("": all of accumulation_study.DISTRIBUTIONS).
    c.distributions = ""
    c.ks = ",".join(str(2**i) for i in range(8, 15))  # contraction lengths K, 256 ... 16384
    c.seed = 0  # seed of the inputs (each K draws from (seed, K))
    c.time_shapes = "256x1024x256,64x256x64"  # MxKxN shapes to time ("": none)
    return c
