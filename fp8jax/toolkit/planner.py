"""Deployment planner: memory, cards, nodes and a decode-throughput bound.

Given a model (total and active parameters, layers and KV-cache geometry), a
weight precision, an accelerator and a serving budget (context length,
concurrent sequences, KV-cache precision), :func:`plan` computes:

* **weights**: ``total_params * bytes_per_param`` plus the scales of group
  formats (:class:`fp8jax.toolkit.catalog.GroupFormat`): FP8 and INT8 as
  DeepSeek-V3 / the block-INT8 R1 ship them (one float32 per 128x128 block,
  4 / 16384 bytes per parameter), INT4 as W4A16 (an FP16 scale and a 4-bit
  zero point per 128 weights, 2.5 / 128 bytes), FP4 as NVFP4 (an E4M3 scale
  per 16, 1 / 16 bytes) or MXFP4 (an E8M0 scale per 32, 1 / 32 bytes).
  Every parameter is counted at the weight precision; DeepSeek's BF16
  leftovers (embeddings, norms, router) are under 2% of its parameters and
  are covered by the overhead.  With ``weights="auto"`` on a card with
  native FP8, a named model with a published checkpoint layout
  (``ModelSpec.layout``, :data:`CHECKPOINT_LAYOUTS`) is priced at that
  layout's bytes instead: DeepSeek-V4's routed experts in FP4 + E8M0 per 32,
  the rest in FP8 + E8M0 per 128x128 (:func:`published_format`,
  :func:`active_bytes`);
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
switches to BF16 on such cards and says so.  INT8, INT4 and FP4 weights are
planned on every card; a note says whether the card multiplies them natively
(its ``native`` formats, :mod:`fp8jax.toolkit.hardware`) or dequantizes them
to BF16/FP16 inside the GEMM, which saves memory and bandwidth but no FLOPs.
W4A16 is always dequantized (its activations are BF16/FP16).

:func:`compare` plans one model on every card of the table side by side.

Units: GB = 1e9 bytes; card memory is the vendor figure read as 1e9 bytes.

Card counts are exact: the bytes, the overhead and the card memory are taken
as the decimals they were written as (:func:`exact`: 0.1 is 1/10, not the
float just above it) and the ceiling is taken of their rational quotient
(:func:`cards_for`), so a total that fills whole cards exactly (V4-Pro in BF16:
1.1 x 3,200 GB = 44 x 80 GB) is not pushed one card up by a rounding error.
The other figures (GB, tokens/s) are floats.

Inputs are refused (ValueError, one line) outside :data:`LIMITS`: ranges
three or more orders of magnitude wider than any model or card in the
tables, inside which every byte count and rate is a finite float64.  Beyond
them a number is a typo or a unit mistake (``--memory-gb 1e308`` made
"0 x inf GB" cards), and a plan that needs more than ``MAX_CARDS`` cards is
refused for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from fp8jax.toolkit import catalog
from fp8jax.toolkit.hardware import Accelerator

BLOCK = 128

# (lowest, highest) accepted value of each input; see the module docstring.
LIMITS: dict[str, tuple[float, float]] = {
    "parameters": (1.0, 1e15),
    "layers": (1, 100_000),
    "KV elements per layer": (0, 1e9),
    "context": (1, 1e12),
    "batch": (1, 1e9),
    "node size": (1, 100_000),
    "memory_gb": (1e-3, 1e6),
    "bandwidth_gbs": (1e-3, 1e7),
}
MAX_CARDS = 10**9

# Checkpoint layouts as published: (format of the non-expert weights, format
# of the routed experts).  DeepSeek-V4 stores FP8 E4M3 with one E8M0 byte per
# 128x128 block and routed experts in FP4 E2M1 with one E8M0 byte per 32
# (MXFP4's bytes); its BF16 conversion is 2 bytes per parameter throughout.
# DeepSeek-V4.1 the same with one E8M0 byte per 32x32 FP8 block, and its
# Engram lookup tables in FP8 (ModelSpec.table_params, one byte each, also in
# the BF16 conversion, which passes them through).
CHECKPOINT_LAYOUTS: dict[str, tuple[str, str]] = {
    "bf16": ("bf16", "bf16"),
    "deepseek-v3": ("fp8", "fp8"),
    "deepseek-v4": ("fp8-e8m0", "mxfp4"),
    "deepseek-v4.1": ("fp8-e8m0-32", "mxfp4"),
}


def _check_range(what: str, v: float) -> None:
    lo, hi = LIMITS[what]
    if not lo <= v <= hi:
        try:
            shown = f"{v:g}"
        except OverflowError:  # an integer beyond float range
            shown = f"a {len(str(v))}-digit number"
        raise ValueError(
            f"{what} must be between {lo:g} and {hi:g}, got {shown}: outside what the planner "
            "plans (a typo or a unit mistake?)"
        )


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
    # Routed experts' parameters (0: not split), where a checkpoint layout
    # stores experts in another format than the rest (DeepSeek-V4: FP4).
    expert_params: float = 0.0
    # The published checkpoint's layout (a CHECKPOINT_LAYOUTS key; "": none
    # named), which "auto" weights plan with on cards with native FP8.
    layout: str = ""
    # Lookup-table parameters within total_params (DeepSeek-V4.1's Engram
    # n-gram memory): FP8 rows, one byte each in every layout (``fp8jax convert``
    # passes them through), read per token only for the rows a token hits.
    table_params: float = 0.0

    def __post_init__(self) -> None:
        for what, v in (("total", self.total_params), ("active", self.active_params)):
            if not math.isfinite(v) or v <= 0:
                raise ValueError(
                    f"{what} parameter count must be a positive finite number, got {v}"
                )
        if not 0 <= self.expert_params <= self.total_params:
            raise ValueError("expert parameters must be between 0 and the total parameters")
        if not 0 <= self.table_params <= self.total_params - self.expert_params:
            raise ValueError("table parameters must be between 0 and the non-expert parameters")
        if self.layout and self.layout not in CHECKPOINT_LAYOUTS:
            raise ValueError(
                f"unknown checkpoint layout {self.layout!r}; one of {sorted(CHECKPOINT_LAYOUTS)}"
            )
        if self.active_params > self.total_params:
            raise ValueError("active parameters cannot exceed total parameters")
        if self.n_layers <= 0 or self.kv_elems_per_layer < 0:
            raise ValueError("layers must be positive and KV elements non-negative")
        _check_range("parameters", self.total_params)
        _check_range("parameters", self.active_params)
        _check_range("layers", self.n_layers)
        _check_range("KV elements per layer", self.kv_elems_per_layer)


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
        layout="deepseek-v3",
    )


def _deepseek_v4(
    name: str, total: float, active: float, layers: int, hidden: int, inter: int, experts: int
) -> ModelSpec:
    # Routed-expert parameters: layers x experts x 3 projections (w1, w2, w3)
    # of hidden x moe_intermediate_size, every layer MoE.
    expert = float(layers * experts * 3 * hidden * inter)
    return ModelSpec(
        name=name,
        total_params=total,
        active_params=active,
        n_layers=layers,
        # Assumption: the DeepSeek-V4 report gives its KV cache at 1M tokens as 10% of
        # DeepSeek-V3.2's; taken here as 10% of V3.2's 576 MLA elements per token per layer.
        kv_elems_per_layer=58,
        kv_kind="assumed 58 elements (10% of V3.2's MLA 576)",
        source=f"DeepSeek-V4 report (arXiv 2606.19348): {total / 1e9:g}B total, "
        f"{active / 1e9:g}B activated; config.json: {layers} layers, hidden {hidden}, "
        f"{experts} routed experts of moe_intermediate_size {inter}; routed experts "
        f"{expert / 1e9:.1f}B (computed), the rest assumed = total - experts",
        expert_params=expert,
        layout="deepseek-v4",
    )


def _deepseek_v41_flash() -> ModelSpec:
    # 40 layers, every one MoE: 384 routed experts x 3 projections of hidden
    # 5120 x moe_intermediate_size 2304.
    expert = float(40 * 384 * 3 * 5120 * 2304)
    return ModelSpec(
        name="DeepSeek-V4.1-Flash",
        total_params=552e9 + 197e9,
        active_params=16e9,
        n_layers=40,
        # Assumption: the published 890 bytes of global KV cache per token, over
        # 40 layers, read as 11 BF16 elements per layer (880 bytes).
        kv_elems_per_layer=11,
        kv_kind="assumed 11 elements (890 bytes per token published, over 40 layers)",
        source="DeepSeek-V4.1-Flash (2026-09) as its config.json and safetensors headers "
        "are summarised in public deployment notes (vLLM Ascend's DeepSeek-V4.1-Flash "
        "tutorial; sqliteai/warp docs/DS41.md), not read from the files here: 552B "
        "backbone + 197B Engram n-gram memory (FP8 lookup tables), 16B activated per "
        "decode token (8B per prefill token), 40 layers, hidden 5120, 384 routed experts "
        "of moe_intermediate_size 2304, 890 bytes of global KV cache per token; routed "
        f"experts {expert / 1e9:.1f}B (computed), the rest assumed = total - experts - "
        "tables; the published 510 GB also hold the vision tower, BF16 leftovers and the "
        "DSpark draft module, not modelled",
        expert_params=expert,
        layout="deepseek-v4.1",
        table_params=197e9,
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
    "deepseek-v4-flash": _deepseek_v4("DeepSeek-V4-Flash", 284e9, 13e9, 43, 4096, 2048, 256),
    "deepseek-v4-pro": _deepseek_v4("DeepSeek-V4-Pro", 1.6e12, 49e9, 61, 7168, 3072, 384),
    "deepseek-v4.1-flash": _deepseek_v41_flash(),
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
    """Bytes per parameter of a weight format, and of its scales.

    ``group`` is the catalog group format behind a scaled format (None for
    plain BF16/FP16/FP32).  ``needs_fp8``: the format is only planned on cards
    with native E4M3 (others get the BF16 conversion).
    """

    name: str
    bytes_per_param: float
    scale_bytes_per_param: float
    needs_fp8: bool
    describe: str
    group: catalog.GroupFormat | None = None
    # A published checkpoint layout of two formats (see published_format);
    # expert_format: the routed experts' format in it.
    layout: str = ""
    expert_format: WeightFormat | None = None


def _scaled(name: str, group: str, needs_fp8: bool, describe: str) -> WeightFormat:
    g = catalog.group_format(group)
    # Bits to bytes: a parameter costs element_bits / 8 plus its share of the
    # group's scale and zero point, overhead_bits / 8.
    return WeightFormat(name, g.element_bits / 8, g.overhead_bits / 8, needs_fp8, describe, g)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", 4.0, 0.0, False, "FP32"),
    "bf16": WeightFormat("bf16", 2.0, 0.0, False, "BF16"),
    "fp16": WeightFormat("fp16", 2.0, 0.0, False, "FP16"),
    "fp8": _scaled("fp8", "fp8-b128", True, "FP8 E4M3 + float32 scale per 128x128 block"),
    "int8": _scaled("int8", "int8-b128", False, "INT8 (W8A8) + float32 scale per 128x128 block"),
    "int4": _scaled("int4", "w4a16-g128", False, "INT4 (W4A16) + FP16 scale, 4-bit zero per 128"),
    "fp4": _scaled("fp4", "nvfp4", False, "NVFP4: FP4 E2M1 + E4M3 scale per 16"),
    "mxfp4": _scaled("mxfp4", "mxfp4", False, "MXFP4: FP4 E2M1 + E8M0 scale per 32"),
}


def _layout_parts(layout: str) -> tuple[WeightFormat, WeightFormat]:
    """(format of the non-expert weights, format of the routed experts) of a layout."""
    if layout not in CHECKPOINT_LAYOUTS:
        raise ValueError(
            f"unknown checkpoint layout {layout!r}; one of {sorted(CHECKPOINT_LAYOUTS)}"
        )
    dense, expert = (_layout_format(f) for f in CHECKPOINT_LAYOUTS[layout])
    return dense, expert


def _split_bytes(
    rest: float, experts: float, dense: WeightFormat, expert: WeightFormat
) -> tuple[float, float]:
    """(element bytes, scale bytes) of ``rest`` parameters in ``dense`` and ``experts`` in ``expert``."""
    return (
        rest * dense.bytes_per_param + experts * expert.bytes_per_param,
        rest * dense.scale_bytes_per_param + experts * expert.scale_bytes_per_param,
    )


def exact(x: float) -> Fraction:
    """``x`` as the decimal it was written as, exactly (its shortest repr): 0.1 -> 1/10.

    Scales per parameter such as 1 / 16384 are powers of two, exact either way.
    """
    return Fraction(repr(x)) if isinstance(x, float) else Fraction(x)


# Lookup tables (ModelSpec.table_params): FP8 E4M3 rows, one byte per parameter.
TABLE_BYTES = 1


def _model_bytes(
    model: ModelSpec, dense: WeightFormat, expert: WeightFormat
) -> tuple[Fraction, Fraction]:
    """(element bytes, scale bytes), exactly: routed experts in ``expert``, lookup
    tables at TABLE_BYTES, the rest in ``dense``."""
    experts, tables = exact(model.expert_params), exact(model.table_params)
    rest = exact(model.total_params) - experts - tables
    elements = rest * exact(dense.bytes_per_param) + experts * exact(expert.bytes_per_param)
    scales = rest * exact(dense.scale_bytes_per_param) + experts * exact(
        expert.scale_bytes_per_param
    )
    return elements + tables * TABLE_BYTES, scales


def exact_checkpoint_bytes(model: ModelSpec, layout: str) -> Fraction:
    """:func:`checkpoint_bytes` in rational arithmetic (what card counts use)."""
    return sum(_model_bytes(model, *_layout_parts(layout)), Fraction(0))


def checkpoint_bytes(model: ModelSpec, layout: str) -> float:
    """Bytes of ``model``'s weights, scales included, in a checkpoint layout.

    Experts (``model.expert_params``) in the layout's expert format, lookup
    tables (``model.table_params``) at one byte, the rest in its other format;
    see :data:`CHECKPOINT_LAYOUTS`.
    """
    return float(exact_checkpoint_bytes(model, layout))


def cards_for(nbytes: float | Fraction, card_gb: float, overhead: float = 0.10) -> int:
    """Cards of ``card_gb`` GB that hold ``nbytes`` plus ``overhead`` of it:
    ceil(nbytes x (1 + overhead) / (card_gb x 1e9)), exactly (:func:`exact`)."""
    total = (nbytes if isinstance(nbytes, Fraction) else exact(nbytes)) * (1 + exact(overhead))
    return math.ceil(total / (exact(card_gb) * 10**9))


def active_bytes(model: ModelSpec, wf: WeightFormat) -> float:
    """Bytes one decode step reads per sequence for the active weights, scales included.

    A single-format ``wf``: ``active_params`` at its bytes.  A published
    layout of two formats (``wf.layout``): every non-expert parameter is
    taken as active (attention, shared experts, dense layers run for every
    token), the rest of ``active_params`` as routed experts in the experts'
    format; an assumption, since the models' cards give the active count only.
    """
    if not wf.layout:
        return model.active_params * (wf.bytes_per_param + wf.scale_bytes_per_param)
    dense, expert = _layout_parts(wf.layout)
    # Lookup tables are read a few rows per token: not counted.
    rest = min(model.total_params - model.expert_params - model.table_params, model.active_params)
    return sum(_split_bytes(rest, model.active_params - rest, dense, expert))


def published_format(model: ModelSpec) -> WeightFormat:
    """The weight format of ``model``'s published checkpoint (``model.layout``).

    One format throughout (DeepSeek-V3: FP8 with float32 block scales) is
    that format; two (DeepSeek-V4: FP4 experts, FP8 rest) give a format of
    the layout's name whose bytes per parameter are the checkpoint's
    averages (:func:`checkpoint_bytes` / parameters), so weights and scales
    total exactly the checkpoint's bytes.
    """
    dense, expert = _layout_parts(model.layout)
    if dense == expert or not model.expert_params:
        return dense
    rest = model.total_params - model.expert_params - model.table_params
    elements, scales = (float(b) for b in _model_bytes(model, dense, expert))
    tables = (
        f", lookup tables ({model.table_params / 1e9:.1f}B) in FP8" if model.table_params else ""
    )
    return WeightFormat(
        model.layout,
        elements / model.total_params,
        scales / model.total_params,
        dense.needs_fp8 or expert.needs_fp8,
        f"{model.layout} checkpoint: routed experts ({model.expert_params / 1e9:.1f}B) in "
        f"{expert.describe}{tables}, the rest ({rest / 1e9:.1f}B) in {dense.describe}",
        layout=model.layout,
        expert_format=expert,
    )


def _layout_format(name: str) -> WeightFormat:
    if name == "fp8-e8m0":
        # One E8M0 byte (not a float32) per 128x128 block.
        return WeightFormat(name, 1.0, 1 / (BLOCK * BLOCK), True, "FP8 E4M3 + E8M0 per 128x128")
    if name == "fp8-e8m0-32":
        # DeepSeek-V4.1: one E8M0 byte per 32x32 block.
        return WeightFormat(name, 1.0, 1 / (32 * 32), True, "FP8 E4M3 + E8M0 per 32x32")
    return WEIGHT_FORMATS[name]


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
    execution: str = ""
    # How the card runs the routed experts' own format (a published layout of two formats).
    expert_execution: str = ""

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
    WEIGHT_FORMATS; "fp8" on a card without FP8 becomes BF16 with a note;
    int8 / int4 / fp4 / mxfp4 are kept on every card, with a note (and
    ``Plan.execution``) saying whether the card multiplies them natively or
    dequantizes them.  ``memory_gb`` / ``bandwidth_gbs`` override the table
    (e.g. for a card whose figure is not in it).  Raises ValueError for
    non-positive, NaN or infinite numbers.
    """
    for what, v in (("context", context), ("batch", batch), ("node size", node_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    if not (math.isfinite(overhead) and 0 <= overhead < 10):
        raise ValueError(
            f"overhead is a fraction of weights + KV cache (0 <= x < 10), got {overhead}"
        )
    for what, v in (("memory_gb", memory_gb), ("bandwidth_gbs", bandwidth_gbs)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{what} must be a positive finite number, got {v}")
        if v is not None:
            _check_range(what, v)
    for what, v in (("context", context), ("batch", batch), ("node size", node_size)):
        _check_range(what, v)
    notes: list[str] = []
    card_gb = memory_gb if memory_gb is not None else accel.memory_gb
    if card_gb is None:
        raise ValueError(f"{accel.name}: no memory figure in the table; pass memory_gb")
    bw_gbs = bandwidth_gbs if bandwidth_gbs is not None else accel.bandwidth_gbs

    wname = weights.lower()
    layout_wf = None
    if wname == "auto" and accel.fp8_native and model.layout:
        # The published checkpoint as it is (DeepSeek-V4: FP4 experts, FP8 rest).
        layout_wf = published_format(model)
        wname = layout_wf.name if layout_wf.name in WEIGHT_FORMATS else "layout"
    elif wname == "auto":
        wname = "fp8" if accel.fp8_native else "bf16"
        if not accel.fp8_native:
            notes.append(
                f"{accel.name} has no native FP8"
                + (" (its formats are unknown)" if accel.native is None else "")
                + ": weights held in BF16 (an FP8 checkpoint is converted with "
                "`fp8jax convert fp8-to-bf16`), twice the bytes of FP8."
            )
    if wname not in WEIGHT_FORMATS and layout_wf is None:
        raise ValueError(
            f"unknown weight precision {weights!r}; one of auto, {sorted(WEIGHT_FORMATS)}"
        )
    wf = layout_wf if layout_wf is not None else WEIGHT_FORMATS[wname]
    if wf.needs_fp8 and not accel.fp8_native:
        notes.append(
            f"{accel.name} has no native FP8: FP8 weights must be converted to BF16 "
            "(`fp8jax convert fp8-to-bf16`), twice the bytes; planned in BF16."
        )
        wf = WEIGHT_FORMATS["bf16"]
    if wf.needs_fp8:
        exec_mode = "native"
        if not accel.supports("fp8_e4m3"):
            # FNUZ-only cards (MI300 series): E4M3FN codes above 240 do not exist
            # in e4m3fnuz, so the re-encode halves the codes and doubles the scales.
            notes.append(
                f"{accel.name} runs FP8 as e4m3fnuz (max 240): DeepSeek's e4m3fn weights are "
                "re-encoded (values halved, scales doubled), same 3 mantissa bits."
            )
    elif wf.group is not None:
        exec_mode, note = execution(wf, accel)
        notes.append(note)
    else:
        exec_mode = ""
    if wf.expert_format is not None and wf.expert_format.group is not None:
        # The experts' format runs as the card allows (FP4: Blackwell multiplies it).
        expert_exec, note = execution(wf.expert_format, accel)
        notes.append(f"routed experts: {note}")
    else:
        expert_exec = ""

    if wf.layout:
        notes.append(
            f"planned as {model.name}'s published checkpoint "
            f"({checkpoint_bytes(model, wf.layout) / 1e9:,.1f} GB; its BF16 conversion is "
            f"{checkpoint_bytes(model, 'bf16') / 1e9:,.1f} GB)."
        )
    elif model.expert_params:
        notes.append(
            f"{model.name}'s published checkpoint (FP4 experts, FP8 rest, E8M0 scales) is "
            f"{checkpoint_bytes(model, model.layout or 'deepseek-v4') / 1e9:,.1f} GB; this plan "
            "prices every "
            f"parameter as {wf.describe} (planner.checkpoint_bytes gives each layout's bytes)."
        )

    kv = kv_dtype.lower()
    if kv not in KV_BYTES:
        raise ValueError(f"unknown KV cache precision {kv_dtype!r}; one of {sorted(KV_BYTES)}")
    if kv == "fp8" and not accel.fp8_native:
        notes.append(f"{accel.name} has no native FP8: KV cache planned in BF16.")
        kv = "bf16"

    # Memory.
    if wf.layout:
        weight_bytes = model.total_params * wf.bytes_per_param
        scale_bytes = model.total_params * wf.scale_bytes_per_param
    else:  # lookup tables stay FP8 whatever the weights' format
        weight_bytes, scale_bytes = (float(b) for b in _model_bytes(model, wf, wf))
    kv_per_token = model.n_layers * model.kv_elems_per_layer * KV_BYTES[kv]
    kv_bytes = batch * context * kv_per_token
    sub = weight_bytes + scale_bytes + kv_bytes
    overhead_bytes = overhead * sub
    total = sub + overhead_bytes
    card_bytes = card_gb * 1e9
    if total / card_bytes > MAX_CARDS:
        raise ValueError(
            f"{model.name} needs {total / 1e9:.3g} GB, over {MAX_CARDS:,} cards of "
            f"{card_gb:g} GB: outside what the planner plans (a unit mistake?)"
        )
    # Exact: weights (a published layout's two formats each), KV and overhead as written.
    exact_weights = (
        exact_checkpoint_bytes(model, wf.layout)
        if wf.layout
        else sum(_model_bytes(model, wf, wf), Fraction(0))
    )
    cards = cards_for(exact_weights + exact(kv_bytes), card_gb, overhead)
    nodes = math.ceil(cards / node_size)
    if cards <= node_size:
        layout_cards = _next_pow2(cards)
    else:
        layout_cards = _next_pow2(nodes) * node_size
    layout_nodes = math.ceil(layout_cards / node_size)

    # Decode bound.
    active = active_bytes(model, wf)
    kv_seq = context * kv_per_token
    per_token = active + kv_seq
    bw = None if bw_gbs is None else bw_gbs * 1e9
    if bw is None:
        one = all_ = batch_tps = None
        notes.append(
            f"{accel.name}: no bandwidth figure in the table; pass --bandwidth for a decode bound."
        )
    else:
        one = bw / per_token
        all_ = bw * layout_cards / per_token
        step_bytes = min(weight_bytes + scale_bytes, batch * active) + batch * kv_seq
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
        active_weight_bytes=active,
        kv_bytes_per_seq=kv_seq,
        bytes_per_token=per_token,
        tokens_per_s_one_card=one,
        tokens_per_s_all_cards=all_,
        batch_tokens_per_s=batch_tps,
        notes=tuple(notes),
        execution=exec_mode,
        expert_execution=expert_exec,
    )


_ELEMENT_LABELS = {"fp4_e2m1": "FP4 (E2M1)", "fp8_e4m3": "FP8 E4M3"}


def execution(wf: WeightFormat, accel: Accelerator) -> tuple[str, str]:
    """What the card does with a scaled weight format, as (mode, note).

    mode is "native" (its matrix units multiply the stored elements),
    "dequantized" (weights widened to BF16/FP16 inside the GEMM) or "unknown"
    (the card's formats are not known).
    """
    g = wf.group
    assert g is not None
    elem = _ELEMENT_LABELS.get(g.element, g.element.upper())
    if accel.native is None:
        return "unknown", (
            f"{accel.name}: supported formats unknown, so whether it multiplies {elem} "
            "natively is unknown; planned by storage bytes only."
        )
    if not g.native:
        extra = (
            f" ({accel.name} does multiply {elem} natively: a W4A4 scheme could use it.)"
            if accel.supports(g.element)
            else ""
        )
        return "dequantized", (
            f"{g.name} is weight-only: {accel.name} dequantizes the {elem} weights to "
            "BF16/FP16 inside the GEMM; memory and bandwidth shrink, FLOPs do not." + extra
        )
    if accel.supports(*g.native):
        return "native", (
            f"{accel.name} multiplies {elem} natively ({g.name}, activations: {g.activations})."
        )
    return "dequantized", (
        f"{accel.name} has no native {elem}: the {g.name} weights are dequantized to BF16/FP16 "
        "inside the GEMM (weight-only); memory and bandwidth shrink, FLOPs do not."
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
        + f", native FP8: {'unknown' if a.native is None else ('yes' if a.fp8_native else 'no')}",
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


@dataclass(frozen=True)
class CompareRow:
    """One card of :func:`compare`: its plan, or why there is none (``reason``)."""

    accel: Accelerator
    plan: Plan | None
    reason: str = ""

    def asdict(self) -> dict:
        p = self.plan
        d: dict = {"accelerator": self.accel.key, "name": self.accel.name}
        if p is None:
            d.update(planned=False, reason=self.reason)
            return d
        d.update(
            planned=True,
            weights=p.weights.name,
            execution=p.execution,
            expert_execution=p.expert_execution,
            kv_cache=p.kv_dtype,
            card_gb=p.card_bytes / 1e9,
            total_gb=p.total_bytes / 1e9,
            cards=p.cards,
            nodes=p.nodes,
            layout_cards=p.layout_cards,
            layout_nodes=p.layout_nodes,
            gb_per_card=p.total_bytes / p.layout_cards / 1e9,
            tokens_per_s_one_card=p.tokens_per_s_one_card,
            tokens_per_s_all_cards=p.tokens_per_s_all_cards,
            batch_tokens_per_s=p.batch_tokens_per_s,
            notes=list(p.notes),
        )
        return d


# Sort keys of :func:`compare`: (key function on a planned row, descending?).
SORT_KEYS: dict[str, tuple] = {
    "table": (None, False),
    "name": (lambda r: r.accel.key, False),
    "cards": (lambda r: (r.plan.layout_cards, r.plan.cards), False),
    "nodes": (lambda r: (r.plan.layout_nodes, r.plan.cards), False),
    "memory": (lambda r: r.plan.total_bytes / r.plan.layout_cards, False),
    "decode": (lambda r: r.plan.tokens_per_s_all_cards, True),
    "batch": (lambda r: r.plan.batch_tokens_per_s, True),
}


def compare(
    model: ModelSpec,
    accels: tuple[Accelerator, ...] | list[Accelerator],
    weights: str = "auto",
    sort: str = "table",
    **kw,
) -> list[CompareRow]:
    """Plan ``model`` on every card of ``accels`` with the same budget (``kw`` as :func:`plan`).

    ``sort``: "table" (the table's order), "name", "cards" / "nodes" (fewest
    first, by the power-of-two layout, then by cards), "memory" (least per card
    first), "decode" / "batch" (highest per-sequence / total decode bound
    first).  Except for "name", cards that cannot be planned (no memory
    figure) and, for "decode" / "batch", cards without a bandwidth figure come
    last, in table order.
    """
    if sort not in SORT_KEYS:
        raise ValueError(f"unknown sort {sort!r}; one of {sorted(SORT_KEYS)}")
    rows = []
    for a in accels:
        if a.memory_gb is None and kw.get("memory_gb") is None:
            rows.append(CompareRow(a, None, "no memory figure in the table"))
            continue
        rows.append(CompareRow(a, plan(model, a, weights=weights, **kw)))
    key, descending = SORT_KEYS[sort]
    if key is None:
        return rows

    def sortable(r: CompareRow) -> bool:
        if sort == "name":
            return True
        return r.plan is not None and (
            sort not in ("decode", "batch") or r.plan.tokens_per_s_all_cards is not None
        )

    head = sorted((r for r in rows if sortable(r)), key=key, reverse=descending)
    return head + [r for r in rows if not sortable(r)]


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def format_compare(rows: list[CompareRow], model: ModelSpec) -> str:
    """The compare table (what ``fp8jax plan --compare`` prints)."""
    head = [
        "card",
        "weights",
        "cards",
        "nodes",
        "layout",
        "GB/card",
        "of card",
        "tok/s/seq",
        "tok/s batch",
        "notes",
    ]
    body = []
    for r in rows:
        p = r.plan
        if p is None:
            body.append([r.accel.key, "-", "-", "-", "-", "-", "-", "-", "-", r.reason])
            continue
        per_card = p.total_bytes / p.layout_cards
        flags = []
        if any("no native FP8" in n for n in p.notes):
            flags.append("no FP8: BF16")
        if p.weights.group is not None and p.execution:
            flags.append({"unknown": "formats unknown"}.get(p.execution, p.execution))
        if p.expert_execution:
            flags.append(f"FP4 experts {p.expert_execution}")
        if p.tokens_per_s_one_card is None:
            flags.append("no bandwidth figure")
        body.append(
            [
                r.accel.key,
                p.weights.name,
                str(p.cards),
                str(p.nodes),
                f"{p.layout_cards}={p.layout_nodes}x{min(p.layout_cards, p.node_size)}",
                f"{per_card / 1e9:,.1f}",
                f"{per_card / p.card_bytes:.0%}",
                _tps(p.tokens_per_s_all_cards),
                "-" if p.batch_tokens_per_s is None else f"{p.batch_tokens_per_s:,.0f}",
                "; ".join(dict.fromkeys(flags)),
            ]
        )
    right = {2, 3, 5, 6, 7, 8}
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    first = next((r.plan for r in rows if r.plan is not None), None)
    out = [
        f"model   {model.name}: {_params(model.total_params)} parameters, "
        f"{_params(model.active_params)} active, {model.n_layers} layers, KV: {model.kv_kind}",
    ]
    if first is not None:
        out.append(
            f"budget  {first.batch} sequences x {first.context} tokens, KV cache "
            f"{first.kv_dtype.upper()} where the card allows, overhead {first.overhead_frac:.0%}, "
            f"{first.node_size} cards per node"
        )
    out += ["", line(head), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    out += [
        "",
        "cards: ceil(total / card memory); layout: the power-of-two number of cards that holds it "
        "(= nodes x cards per node); GB/card and 'of card' on that layout.",
        "tok/s/seq: decode bound per sequence with the reads split over the layout; "
        "tok/s batch: total bound at the batch size.  Bounds from memory bandwidth only.",
        "Details and notes per card: fp8jax plan --model ... --gpu KEY",
    ]
    return "\n".join(out)
