"""The DeepSeek-V3-style MoE transformer whose GEMMs run through fp8jax."""

from fp8jax.models.config import ModelConfig
from fp8jax.models.router import update_router_bias
from fp8jax.models.transformer import MoETransformer, cross_entropy, loss_fn

__all__ = [
    "ModelConfig",
    "MoETransformer",
    "cross_entropy",
    "loss_fn",
    "update_router_bias",
]
