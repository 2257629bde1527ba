r"""A train step on 8 simulated CPU devices, deepseek_v3 vs bf16: collective bytes, memory, time.

Commands:
  python experiments/bench.py --config=configs/bench/parallel.py      # mesh (1, 4, 2), seq 256
  python experiments/bench.py --config=configs/bench/parallel.py --config.mesh=2,2,2 --config.seq=512 --config.layers=4

What it prints: the model and mesh, then side by side with the ratio to bf16:
the all-to-all bytes of the expert dispatch and of the combine, the all-gather
bytes of the FSDP weight gathers, the other collectives, XLA's compiled memory
per device and the step time (logic in ``fp8jax.bench.parallel``).  Without an
XLA_FLAGS setting it asks XLA for 8 host devices.  --out_dir=DIR writes
DIR/results.json.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "parallel"  # fp8jax.bench.experiments.parallel
    c.mesh = "1,4,2"  # data,fsdp,expert sizes
    c.batch = 8  # global batch (sequences)
    c.seq = 256  # sequence length
    c.layers = 2  # transformer blocks (the first is dense)
    c.d_model = 256  # model width
    c.experts = 8  # routed experts
    c.iters = 3  # timed steps
    return c
