"""Training across devices: the mesh, sharding rules, FP8 expert dispatch, FP8 FSDP gathers.

* :mod:`~fp8jax.parallel.mesh`: the ("data", "fsdp", "expert") mesh from
  config sizes, ``jax.distributed`` start-up, per-process batches;
* :mod:`~fp8jax.parallel.placement`: where parameters, master weights and
  moments live;
* :mod:`~fp8jax.parallel.dispatch` / :mod:`~fp8jax.parallel.experts`:
  expert parallelism with FP8 dispatch and a BF16 combine;
* :mod:`~fp8jax.parallel.fsdp`: FSDP gathers in FP8 blocks, reduce-scatter
  backward;
* :mod:`~fp8jax.parallel.training`: the setup a training loop calls.

Train on 8 simulated CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/train.py \
      --config=configs/tiny.py --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.expert=2

Benchmark (bytes moved, memory, time, deepseek_v3 vs bf16):
``python experiments/bench.py --config=configs/bench/parallel.py``.
"""

from fp8jax.parallel import dispatch, fsdp, mesh, placement
from fp8jax.parallel.mesh import AXES, axis_sizes, batch_sharding, global_batch, make_mesh

__all__ = [
    "AXES",
    "axis_sizes",
    "batch_sharding",
    "dispatch",
    "fsdp",
    "global_batch",
    "make_mesh",
    "mesh",
    "placement",
]
