"""Training across devices: the mesh, sharding rules, FP8 expert dispatch, FP8 FSDP gathers."""

from fp8jax.parallel import dispatch, fsdp, mesh, rules
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
    "rules",
]
