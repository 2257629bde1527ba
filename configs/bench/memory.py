r"""Where a train step's bytes go, deepseek_v3 vs bf16: autodiff residuals and XLA's compiled peak.

Commands:
  python experiments/bench.py --config=configs/bench/memory.py --config.compile=true   # ~3 min
  python experiments/bench.py --config=configs/bench/memory.py --config.seq=512 --config.layers=2 --config.batch=8

The default is a setting where activations dominate a step's memory (long
sequences, several layers, d_model 256): 4096 tokens per step through 8 blocks
(one dense, seven MoE), attention in blocks of 512 queries.

What it prints: per recipe, the bytes kept from forward to backward (the VJP's
residuals, ``fp8jax.bench.residuals``) in total and per dtype and the largest
sources by line of code, e.g.
  ## deepseek_v3: residuals ... MiB; by dtype: ...
then a table of MiB per recipe with the ratio to the first recipe; with
compile=true also XLA's compiled temporaries and peak of the whole train step on
one device (minutes per recipe on a CPU).  --out_dir=DIR writes DIR/results.json.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "memory"  # fp8jax.bench.experiments.memory
    c.seq = 2048  # sequence length
    c.layers = 8  # transformer blocks (the first is dense)
    c.batch = 2  # sequences per step
    c.d_model = 256  # model width
    c.recipes = "bf16,deepseek_v3"  # presets, comma-separated; the first is the base
    c.top = 8  # largest residual sources shown per recipe
    c.compile = False  # also compile the train step for XLA's peak
    return c
