"""Model configuration: one frozen dataclass, three size presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-style MoE transformer.

    Blocks: x += attn(RMSNorm(x)); x += FFN(RMSNorm(x)).  The first
    ``n_dense_layers`` blocks have a dense SwiGLU FFN of width ``d_ff``; the
    others a MoE layer: ``n_shared_experts`` always-on SwiGLU experts plus
    ``n_routed_experts`` routed ones (width ``d_expert``), ``top_k`` per token.

    Attention: "mha" (``n_heads`` x ``head_dim``, RoPE) or "mla" (DeepSeek-V3
    multi-head latent attention: queries through a ``q_lora_rank`` bottleneck
    (0 = none), keys/values from a ``kv_lora_rank`` latent, per-head
    ``qk_nope_head_dim`` + a shared decoupled RoPE key of ``qk_rope_head_dim``,
    values of ``v_head_dim``).  The attention core is recomputed in the
    backward pass and runs over blocks of ``attention_block_q`` queries when
    the sequence is longer (0 = never), which bounds its float32 temporaries
    at (B, H, attention_block_q, T).

    Routing: sigmoid scores; top-k selection on scores + router bias
    (aux-loss-free balancing, the bias moves by ``bias_update_rate`` per
    step); gate weights = selected unbiased scores, normalised, times
    ``routed_scaling``; optional sequence-wise balance loss
    (``seq_aux_loss_coef``, 0 = off); group-limited routing with ``n_groups``
    groups of experts of which ``topk_groups`` are kept (1 / 1 = off).

    ``smooth_swiglu``: Smooth-SwiGLU (Fishman et al. 2024) in every SwiGLU,
    dense, shared and routed: a per-channel power-of-two scale divides the
    down-projection's input before it is quantized and multiplies the
    matching rows of the down-projection (:class:`fp8jax.models.moe.SwiGLU`).
    """

    vocab_size: int = 256
    max_seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 16
    attention: str = "mha"
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    # queries per block of the attention core (0: the whole sequence at once)
    attention_block_q: int = 512
    # FFN / MoE
    n_dense_layers: int = 1
    d_ff: int = 256
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    top_k: int = 2
    d_expert: int = 64
    routed_scaling: float = 1.0
    bias_update_rate: float = 1e-3
    seq_aux_loss_coef: float = 0.0
    n_groups: int = 1
    topk_groups: int = 1
    # numerics
    norm_eps: float = 1e-6
    param_dtype: str = "float32"
    dtype: str = "bfloat16"
    smooth_swiglu: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError("n_dense_layers must be in [0, n_layers]")
        if self.n_moe_layers > 0:
            if not 1 <= self.top_k <= self.n_routed_experts:
                raise ValueError("top_k must be in [1, n_routed_experts]")
            if self.n_routed_experts % self.n_groups:
                raise ValueError("n_routed_experts must be divisible by n_groups")
            if not 1 <= self.topk_groups <= self.n_groups:
                raise ValueError("topk_groups must be in [1, n_groups]")
            per_group = self.n_routed_experts // self.n_groups
            if self.topk_groups * per_group < self.top_k:
                raise ValueError("topk_groups * experts per group must be >= top_k")
        if self.attention == "mla" and self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (RoPE pairs)")
        if self.attention == "mha" and self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE pairs)")
        if self.attention_block_q < 0:
            raise ValueError("attention_block_q must be >= 0 (0: no blocks)")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        """Parameters (embedding and head included), computed from the sizes."""
        d = self.d_model
        if self.attention == "mha":
            attn = 4 * d * self.n_heads * self.head_dim
        else:
            h, nope, rope, v = (
                self.n_heads,
                self.qk_nope_head_dim,
                self.qk_rope_head_dim,
                self.v_head_dim,
            )
            qd = h * (nope + rope)
            q = (
                d * qd
                if self.q_lora_rank == 0
                else d * self.q_lora_rank + self.q_lora_rank * (1 + qd)
            )
            kv = d * (self.kv_lora_rank + rope) + self.kv_lora_rank * (1 + h * (nope + v))
            attn = q + kv + h * v * d
        dense_ffn = 3 * d * self.d_ff
        moe = 3 * d * self.d_expert * (self.n_routed_experts + self.n_shared_experts)
        moe += d * self.n_routed_experts
        per_norms = 2 * d
        blocks = self.n_layers * (attn + per_norms)
        blocks += self.n_dense_layers * dense_ffn + self.n_moe_layers * moe
        return blocks + 2 * self.vocab_size * d + d

    @classmethod
    def tiny(cls, **kw) -> ModelConfig:
        """CPU seconds: d_model 64, 2 layers (1 dense, 1 MoE), 8 experts top-2, seq 64."""
        return cls(**kw)

    @classmethod
    def small(cls, **kw) -> ModelConfig:
        """Minutes on a 2-core CPU: d_model 256, 4 layers, 8 experts, seq 128 (~9M params)."""
        base = dict(
            max_seq_len=128,
            d_model=256,
            n_layers=4,
            n_heads=4,
            head_dim=64,
            n_dense_layers=1,
            d_ff=768,
            n_routed_experts=8,
            n_shared_experts=1,
            top_k=2,
            d_expert=256,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def gpu_1b(cls, **kw) -> ModelConfig:
        """About 1B parameters (MLA, 64 routed experts, top-6): a single-GPU run."""
        base = dict(
            vocab_size=32768,
            max_seq_len=2048,
            d_model=1024,
            n_layers=16,
            n_heads=16,
            head_dim=64,
            attention="mla",
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_dense_layers=1,
            d_ff=4096,
            n_routed_experts=64,
            n_shared_experts=1,
            top_k=6,
            d_expert=256,
            n_groups=8,
            topk_groups=4,
            routed_scaling=2.5,
        )
        base.update(kw)
        return cls(**base)
