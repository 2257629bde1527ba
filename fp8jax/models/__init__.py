"""The DeepSeek-V3-style MoE transformer whose GEMMs run through fp8jax."""

from fp8jax.models.config import ModelConfig
from fp8jax.models.router import update_router_bias
from fp8jax.models.sharding import batch_sharding, make_mesh, shard_model
from fp8jax.models.transformer import MoETransformer, cross_entropy, loss_fn

__all__ = [
    "ModelConfig",
    "MoETransformer",
    "batch_sharding",
    "cross_entropy",
    "loss_fn",
    "make_mesh",
    "shard_model",
    "update_router_bias",
]
