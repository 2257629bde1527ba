"""Deployment planner: memory, cards, nodes and a decode-throughput bound.

Given a model (total and active parameters, layers and KV-cache geometry), a
weight precision, an accelerator and a serving budget (context length,
concurrent sequences, KV-cache precision), :func:`plan` computes:

* **weights**: ``total_params * bytes_per_param`` plus the scales of block
  formats (FP8 as DeepSeek-V3 ships it: one float32 ``scale_inv`` per
  128x128 block, 4 / 16384 bytes per parameter).  Every parameter is counted
  at the weight precision; DeepSeek's BF16 leftovers (embeddings, norms,
  router) are under 2% of its parameters and are covered by the overhead;
* **KV cache**: ``batch * context * layers * kv_elems_per_layer *
  kv_bytes``.  Multi-head latent attention (DeepSeek-V2/V3/R1) caches one
  compressed latent (512) plus the decoupled RoPE key (64) per token per
  layer; grouped-query attention caches ``2 * kv_heads * head_dim``;
* **overhead**: a fraction of weights + KV cache (activations, workspace,
  allocator fragmentation, runtime context);
* **cards** = ceil(total / card memory), **nodes** = ceil(cards / 8), and the
  smallest power-of-two layout that holds it (tensor/expert parallel sizes
  are powers of two in practice);
* **decode bound**: one decode step of one sequence reads the active weights
  and that sequence's KV cache; memory bandwidth bounds the token rate at
  ``bandwidth / (active weight bytes + KV bytes per sequence)``.  Reported
  for one card's bandwidth (the reads done in series, as in a pipeline) and
  for all cards of the layout (reads split evenly, the ideal of expert /
  tensor parallelism), plus the batch bound, where a step of ``batch``
  sequences reads ``min(all weights, batch * active weights)``.

Cards without native FP8 cannot run FP8 weights; they hold the BF16
conversion (``fp8jax convert fp8-to-bf16``), twice the bytes.  The planner
switches to BF16 on such cards and says so.

Units: GB = 1e9 bytes; card memory is the vendor figure read as 1e9 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fp8jax.toolkit.hardware import Accelerator

BLOCK = 128


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know of a model.

    ``kv_elems_per_layer``: cached elements per token per layer (MLA: latent +
    rope dims; GQA: 2 * kv_heads * head_dim).
    """

    name: str
    total_params: float
    active_params: float
    n_layers: int
    kv_elems_per_layer: int
    kv_kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.total_params <= 0 or self.active_params <= 0:
            raise ValueError("parameter counts must be positive")
        if self.active_params > self.total_params:
            raise ValueError("active parameters cannot exceed total parameters")
        if self.n_layers <= 0 or self.kv_elems_per_layer < 0:
            raise ValueError("layers must be positive and KV elements non-negative")


def _deepseek(name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        total_params=671e9,
        active_params=37e9,
        n_layers=61,
        kv_elems_per_layer=512 + 64,
        kv_kind="MLA latent 512 + RoPE key 64",
        source="DeepSeek-V3 technical report (arXiv 2412.19437): 671B total, 37B activated, "
        "61 layers, KV compression dim 512, decoupled RoPE head dim 64",
    )


def _llama(name: str, params: float, layers: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        total_params=params,
        active_params=params,
        n_layers=layers,
        kv_elems_per_layer=2 * 8 * 128,
        kv_kind="GQA 8 KV heads x 128 dims (K and V)",
        source="Llama 3.1 model card / config.json (nominal parameter count)",
    )


MODELS: dict[str, ModelSpec] = {
    "deepseek-v3": _deepseek("DeepSeek-V3"),
    "deepseek-r1": _deepseek("DeepSeek-R1"),
    "llama-3.1-8b": _llama("Llama-3.1-8B", 8e9, 32),
    "llama-3.1-70b": _llama("Llama-3.1-70B", 70e9, 80),
    "llama-3.1-405b": _llama("Llama-3.1-405B", 405e9, 126),
}


def get_model(name: str) -> ModelSpec:
    key = name.lower().replace("_", "-")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; named configs: {sorted(MODELS)}")
    return MODELS[key]


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per parameter of a weight format, and of its scales."""

    name: str
    bytes_per_param: float
    scale_bytes_per_param: float
    needs_fp8: bool
    describe: str


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 4.0, 0.0, False, "FP32"),
    "bf16": WeightFormat("bf16", 2.0, 0.0, False, "BF16"),
    "fp16": WeightFormat("fp16", 2.0, 0.0, False, "FP16"),
    # DeepSeek-V3 layout: one float32 scale_inv per 128x128 block.
    "fp8": WeightFormat(
        "fp8", 1.0, 4.0 / (BLOCK * BLOCK), True, "FP8 E4M3 + float32 scale per 128x128 block"
    ),
}

KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Plan:
    """Everything :func:`plan` computes (bytes, counts, tokens/s)."""

    model: ModelSpec
    accel: Accelerator
    weights: WeightFormat
    kv_dtype: str
    context: int
    batch: int
    overhead_frac: float
    node_size: int
    card_bytes: float
    bandwidth: float | None
    weight_bytes: float
    scale_bytes: float
    kv_bytes_per_token: float
    kv_bytes: float
    overhead_bytes: float
    total_bytes: float
    cards: int
    nodes: int
    layout_cards: int
    layout_nodes: int
    active_weight_bytes: float
    kv_bytes_per_seq: float
    bytes_per_token: float
    tokens_per_s_one_card: float | None
    tokens_per_s_all_cards: float | None
    batch_tokens_per_s: float | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def format(self) -> str:
        return format_plan(self)


def plan(
    model: ModelSpec,
    accel: Accelerator,
    weights: str = "auto",
    kv_dtype: str = "bf16",
    context: int = 32768,
    batch: int = 32,
    overhead: float = 0.10,
    node_size: int = 8,
    memory_gb: float | None = None,
    bandwidth_gbs: float | None = None,
) -> Plan:
    """Plan a deployment (see the module docstring for every formula).

    ``weights``: "auto" (FP8 where the card has it, else BF16), or one of
    WEIGHT_FORMATS; "fp8" on a card without FP8 becomes BF16 with a note.
    ``memory_gb`` / ``bandwidth_gbs`` override the table (e.g. for a card
    whose figure is not in it).
    """
    if context <= 0 or batch <= 0 or node_size <= 0:
        raise ValueError("context, batch and node size must be positive")
    if not 0 <= overhead < 10:
        raise ValueError("overhead is a fraction of weights + KV cache, e.g. 0.1")
    notes: list[str] = []
    card_gb = memory_gb if memory_gb is not None else accel.memory_gb
    if card_gb is None or card_gb <= 0:
        raise ValueError(f"{accel.name}: no memory figure; pass memory_gb")
    bw_gbs = bandwidth_gbs if bandwidth_gbs is not None else accel.bandwidth_gbs

    wname = weights.lower()
    if wname == "auto":
        wname = "fp8" if accel.fp8_native else "bf16"
        if not accel.fp8_native:
            notes.append(
                f"{accel.name} has no native FP8: weights held in BF16 "
                "(an FP8 checkpoint is converted with `fp8jax convert fp8-to-bf16`), "
                "twice the bytes of FP8."
            )
    if wname not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weight precision {weights!r}; one of auto, {sorted(WEIGHT_FORMATS)}"
        )
    wf = WEIGHT_FORMATS[wname]
    if wf.needs_fp8 and not accel.fp8_native:
        notes.append(
            f"{accel.name} has no native FP8: FP8 weights must be converted to BF16 "
            "(`fp8jax convert fp8-to-bf16`), twice the bytes; planned in BF16."
        )
        wf = WEIGHT_FORMATS["bf16"]

    kv = kv_dtype.lower()
    if kv not in KV_BYTES:
        raise ValueError(f"unknown KV cache precision {kv_dtype!r}; one of {sorted(KV_BYTES)}")
    if kv == "fp8" and not accel.fp8_native:
        notes.append(f"{accel.name} has no native FP8: KV cache planned in BF16.")
        kv = "bf16"

    # Memory.
    weight_bytes = model.total_params * wf.bytes_per_param
    scale_bytes = model.total_params * wf.scale_bytes_per_param
    kv_per_token = model.n_layers * model.kv_elems_per_layer * KV_BYTES[kv]
    kv_bytes = batch * context * kv_per_token
    sub = weight_bytes + scale_bytes + kv_bytes
    overhead_bytes = overhead * sub
    total = sub + overhead_bytes
    card_bytes = card_gb * 1e9
    cards = math.ceil(total / card_bytes)
    nodes = math.ceil(cards / node_size)
    if cards <= node_size:
        layout_cards = _next_pow2(cards)
    else:
        layout_cards = _next_pow2(nodes) * node_size
    layout_nodes = math.ceil(layout_cards / node_size)

    # Decode bound.
    active_bytes = model.active_params * (wf.bytes_per_param + wf.scale_bytes_per_param)
    kv_seq = context * kv_per_token
    per_token = active_bytes + kv_seq
    bw = None if bw_gbs is None else bw_gbs * 1e9
    if bw is None:
        one = all_ = batch_tps = None
        notes.append(
            f"{accel.name}: no bandwidth figure in the table; pass --bandwidth for a decode bound."
        )
    else:
        one = bw / per_token
        all_ = bw * layout_cards / per_token
        step_bytes = min(weight_bytes + scale_bytes, batch * active_bytes) + batch * kv_seq
        batch_tps = batch * bw * layout_cards / step_bytes

    return Plan(
        model=model,
        accel=accel,
        weights=wf,
        kv_dtype=kv,
        context=context,
        batch=batch,
        overhead_frac=overhead,
        node_size=node_size,
        card_bytes=card_bytes,
        bandwidth=bw,
        weight_bytes=weight_bytes,
        scale_bytes=scale_bytes,
        kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_bytes,
        overhead_bytes=overhead_bytes,
        total_bytes=total,
        cards=cards,
        nodes=nodes,
        layout_cards=layout_cards,
        layout_nodes=layout_nodes,
        active_weight_bytes=active_bytes,
        kv_bytes_per_seq=kv_seq,
        bytes_per_token=per_token,
        tokens_per_s_one_card=one,
        tokens_per_s_all_cards=all_,
        batch_tokens_per_s=batch_tps,
        notes=tuple(notes),
    )


def _gb(b: float) -> str:
    return f"{b / 1e9:,.2f} GB"


def _params(n: float) -> str:
    return f"{n / 1e9:g}B"


def format_plan(p: Plan) -> str:
    """Human-readable plan (what ``fp8jax plan`` prints)."""
    m, a = p.model, p.accel
    card_gb = p.card_bytes / 1e9
    lines = [
        f"model        {m.name}: {_params(m.total_params)} parameters, {_params(m.active_params)} active "
        f"per token, {m.n_layers} layers, KV: {m.kv_kind}",
        f"accelerator  {a.name}: {card_gb:g} GB, "
        + (f"{p.bandwidth / 1e9:g} GB/s" if p.bandwidth else "bandwidth unknown")
        + f", native FP8: {'yes' if a.fp8_native else 'no'}",
        f"serving      {p.batch} sequences x {p.context} tokens, KV cache {p.kv_dtype.upper()}",
        "",
        f"weights      {p.weights.describe}: {_gb(p.weight_bytes)}"
        + (
            f" + {_gb(p.scale_bytes)} scales = {_gb(p.weight_bytes + p.scale_bytes)}"
            if p.scale_bytes
            else ""
        ),
        f"KV cache     {p.kv_bytes_per_token:,.0f} B/token x {p.context} x {p.batch} = {_gb(p.kv_bytes)}",
        f"overhead     {p.overhead_frac:.0%} of weights + KV = {_gb(p.overhead_bytes)}",
        f"total        {_gb(p.total_bytes)}",
        f"cards        {p.cards} x {card_gb:g} GB -> {p.nodes} node{'s' if p.nodes != 1 else ''} of {p.node_size}",
        f"layout       {p.layout_cards} cards (power of two) = {p.layout_nodes} node"
        f"{'s' if p.layout_nodes != 1 else ''}; {_gb(p.total_bytes / p.layout_cards)} per card "
        f"({p.total_bytes / p.layout_cards / p.card_bytes:.0%} of {card_gb:g} GB)",
        f"decode       bytes/token = {_gb(p.active_weight_bytes)} active weights + "
        f"{_gb(p.kv_bytes_per_seq)} KV = {_gb(p.bytes_per_token)}",
    ]
    if p.tokens_per_s_one_card is None:
        lines.append("             bound: n/a (no bandwidth figure)")
    else:
        lines += [
            f"             <= {p.tokens_per_s_one_card:,.1f} tokens/s per sequence on one card's bandwidth",
            f"             <= {p.tokens_per_s_all_cards:,.1f} tokens/s per sequence on all {p.layout_cards} "
            "cards (ideal split)",
            f"             <= {p.batch_tokens_per_s:,.0f} tokens/s in total at batch {p.batch}",
        ]
    for n in p.notes:
        lines.append(f"note         {n}")
    return "\n".join(lines)
