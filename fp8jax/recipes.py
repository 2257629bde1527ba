"""Recipes: the one place that decides the precision of every GEMM.

A linear layer y = x W runs three GEMMs:

* **fprop**  y  = x  @ W     contraction over K (features in)
* **dgrad**  dx = dy @ W^T   contraction over N (features out)
* **wgrad**  dW = x^T @ dy   contraction over M (tokens)

A :class:`Recipe` gives, for each GEMM, a :class:`QuantSpec` for each of its
two operands.  Granularities are *relative to that GEMM's contraction axis*:

* ``"tensor"``: one scale for the whole operand;
* ``"row"``: one scale per index of the non-contracted axis (a row of x, a
  column of W), i.e. reduced over the whole contraction axis;
* ``"tile"``: one scale per 1 x ``tile`` slice along the contraction axis
  (DeepSeek-V3's 1x128 activation tiles; for wgrad the contraction axis is the
  token axis, so these are the 128x1 tiles of the paper);
* ``"block"``: one scale per ``tile`` x ``tile`` block over (contraction,
  non-contracted) -- the 128x128 weight blocks, which serve W and W^T alike.

``fmt=None`` means "no quantization": the operand is cast to
``Recipe.compute_dtype`` (bfloat16 in the bf16 baseline).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import jax.numpy as jnp

from fp8jax.formats import BLOCK_FORMATS, check_scale_fmt

GRANULARITIES = ("tensor", "row", "tile", "block")
SCALINGS = ("current", "delayed")
# The implementations a recipe may name, per scheme of its operands
# (fp8jax.schemes); "auto" lets the GEMM core choose among them per platform
# (fp8jax.gemm.AUTO), and the core refuses a name its operands' scheme lacks.
IMPLS: dict[str, tuple[str, ...]] = {
    "fp8": ("xla", "chunked", "fp8", "fp8_fast", "pallas"),
    "mx": ("xla",),
    "nvfp4": ("xla",),
}
CACHE_FORMATS = (None, "e5m6", "e5m6_unscaled")
# The GEMM sites a recipe treats apart (:func:`for_site`); the activation sites a
# study may change are fp8jax.nn.taps.ACTIVATION_SITES.
GEMM_SITES = ("attn_out", "dispatch", "expert_down")
PROMOTE_ROUNDINGS = ("fma", "separate")
SCALE_ROUNDINGS = ("floor", "ceil")


@dataclass(frozen=True)
class QuantSpec:
    """How one operand of one GEMM is quantized.

    Attributes:
      fmt: format name ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz") or None for no
        quantization (cast to the recipe's compute dtype).
      granularity: one of GRANULARITIES, relative to the GEMM's contraction axis.
      tile: tile / block edge (128 in DeepSeek-V3).
      scaling: "current" (scale from this tensor's own amax, every step) or
        "delayed" (scale from an amax history of previous steps).
      pow2: round every scale up to a power of two (UE8M0 scales).
      amax_floor: amax is clamped to at least this before dividing by the
        format max (0, every training preset: off, only the amax == 0 guard;
        ``fp8jax.scaling.DEEPSEEK_AMAX_FLOOR``, 1e-4: DeepSeek's inference
        act_quant since 2025-08 and DeepGEMM, see :mod:`fp8jax.scaling`).
      hadamard, stochastic: block formats only ("mxfp8", "nvfp4",
        ``fp8jax.microscaling``; ``tile`` is then their block, 32 / 16, and
        the scales are the format's own, online): apply the 16-point random
        Hadamard transform along the contraction axis before quantizing (for
        both Wgrad operands, where it cancels), and round the elements
        stochastically instead of to nearest.
      scale_rounding: MXFP8 only: how the E8M0 block scale is rounded from
        the block's amax: "floor" (OCP MX v1.0: floor(log2 amax) - 8, which
        can put a block's top values above 448, where they clip) or "ceil"
        (the smallest power of two that keeps the amax at or below 448, as
        NVIDIA's MXFP8 recipe and Transformer Engine do: nothing clips).
      scale_fmt: how the scales are stored and carried (FP8 formats):
        "float32", or "ue8m0" (DeepSeek-V3.1's config name: one E8M0 byte,
        2^(c - 127), per scale; needs ``pow2``).  Same codes, scale values and
        GEMM results as "float32" with ``pow2`` (fp8jax.quant), a quarter of
        the scale bytes in the FP8 cache and on the wire.
    """

    fmt: str | None = "e4m3"
    granularity: str = "tile"
    tile: int = 128
    scaling: str = "current"
    pow2: bool = False
    amax_floor: float = 0.0
    hadamard: bool = False
    stochastic: bool = False
    scale_rounding: str = "floor"
    scale_fmt: str = "float32"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}"
            )
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if self.tile <= 0:
            raise ValueError(f"tile must be positive, got {self.tile}")
        if self.scaling == "delayed" and self.granularity != "tensor":
            # A delayed history is one amax per tensor; per-tile histories would
            # need shape-dependent state. Fine-grained scaling is online.
            raise ValueError("delayed scaling is supported for granularity='tensor' only")
        if self.fmt in BLOCK_FORMATS:
            block = BLOCK_FORMATS[self.fmt]
            if self.tile != block or self.granularity not in ("tile", "block"):
                raise ValueError(
                    f"{self.fmt} scales 1x{block} runs ('tile') or {block}x{block} blocks "
                    f"('block') with tile={block}; got {self.granularity!r}, tile={self.tile}"
                )
            if self.fmt == "mxfp8" and self.granularity == "block":
                raise ValueError("mxfp8 scales 1x32 runs only: granularity must be 'tile'")
            if self.scaling != "current" or self.pow2 or self.amax_floor:
                raise ValueError(
                    f"{self.fmt} computes its own online scales (current, no pow2/floor)"
                )
        elif self.hadamard or self.stochastic:
            raise ValueError("hadamard / stochastic apply to the block formats 'mxfp8' and 'nvfp4'")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(
                f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {self.scale_rounding!r}"
            )
        if self.scale_rounding != "floor" and self.fmt != "mxfp8":
            raise ValueError("scale_rounding applies to 'mxfp8' only (its E8M0 block scales)")
        check_scale_fmt(self.scale_fmt, self.pow2)
        if self.scale_fmt != "float32" and (self.fmt is None or self.fmt in BLOCK_FORMATS):
            raise ValueError(
                f"scale_fmt={self.scale_fmt!r} applies to the FP8 formats "
                f"(e4m3, e5m2, ...), got fmt={self.fmt!r}"
            )

    @property
    def quantized(self) -> bool:
        return self.fmt is not None


@dataclass(frozen=True)
class GemmSpec:
    """Quantization of the two operands of one GEMM (lhs @ rhs)."""

    lhs: QuantSpec
    rhs: QuantSpec


@dataclass(frozen=True)
class Accumulation:
    """Limited-precision accumulation model of an FP8 tensor core (fp8jax.accumulate).

    Attributes:
      block: products per block: a block's products (exponent e_a + e_b of
        the FP8 codes) and the running chain accumulator are aligned to their
        largest exponent.  32 on Hopper.
      frac_bits: fraction bits kept below that exponent (each term truncated
        toward zero), and kept by the block's exact sum below its own leading
        bit.  13 on Hopper.
      promote_every: every this many elements of K the chain times its scales
        is added to an FP32 accumulator (round to nearest) and a new chain
        starts; None: only where the scales change.  A multiple of ``block``.
        128: DeepSeek-V3's N_C.
      promote_rounding: how a promotion adds the chain c, times its scale
        s = fl32(s_a * s_b), into the FP32 accumulator acc.  "fma": one
        rounding, fl32(acc + c * s), as DeepGEMM's ``final_accum += scale *
        accum`` compiles (nvcc emits FFMA).  "separate": the product rounded
        first, fl32(acc + fl32(c * s)).
    """

    block: int = 32
    frac_bits: int = 13
    promote_every: int | None = 128
    promote_rounding: str = "fma"

    def __post_init__(self) -> None:
        if self.promote_rounding not in PROMOTE_ROUNDINGS:
            raise ValueError(
                f"promote_rounding must be one of {PROMOTE_ROUNDINGS}, "
                f"got {self.promote_rounding!r}"
            )


MAX_MARGIN = 64


def _is_int(v) -> bool:
    # numpy integers count; bools do not (True is not a margin).
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class DelayedConfig:
    """Amax-history settings for delayed scaling (Transformer Engine style).

    scale = 2^margin * amax_from_history / fmt_max, with amax_from_history the
    max over the history ("max") or its newest entry ("most_recent");
    non-finite history entries are ignored.  ``margin`` is an integer with
    |margin| <= MAX_MARGIN (64): beyond that the scale leaves FP8's range
    for any float32 amax, and the output is all zeros or all saturated.
    """

    history_len: int = 16
    algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"amax algo must be 'max' or 'most_recent', got {self.algo!r}")
        if not _is_int(self.history_len):
            raise ValueError(f"history_len must be an integer, got {self.history_len!r}")
        if self.history_len < 1:
            raise ValueError("history_len must be >= 1")
        if not _is_int(self.margin):
            raise ValueError(
                f"margin must be an integer power-of-two exponent, got {self.margin!r}"
            )
        if abs(self.margin) > MAX_MARGIN:
            raise ValueError(
                f"margin must be within [-{MAX_MARGIN}, {MAX_MARGIN}], got {self.margin}"
            )


@dataclass(frozen=True)
class Recipe:
    """Precision of the three GEMMs of a linear layer, and how they run.

    fprop: (x, w); dgrad: (dy, w); wgrad: (x, dy).

    ``compute_dtype``: what unquantized operands are cast to (the bf16
    baseline's bfloat16); their dots run as ``BF16_BF16_F32`` (bfloat16;
    ``Precision.HIGHEST`` on XLA CPU, the same computation there) or
    ``F32_F32_F32`` (float32), so the baseline is the same computation on
    every backend (``fp8jax.gemm.dot_algorithm``).

    ``impl``: how a quantized GEMM runs (``fp8jax.gemm`` decides, in one place):

    * ``"xla"``: dequantize both operands (``data * scale``, one float32
      rounding) to ``dequant_dtype`` and run one dot with float32
      accumulation, named ``F32_F32_F32`` (or ``BF16_BF16_F32`` for bfloat16
      dequantization, exact only for power-of-two scales).  Equal to FP8 x FP8
      products with FP32 accumulation up to the rounding of data * scale.
    * ``"chunked"``: the contraction in runs over which both scales are
      constant (128 for 1x128 tiles / 128x128 blocks; per tensor or row one
      run of all of K); each run is one dot of the unscaled FP8 codes, exact
      in bfloat16, as ``BF16_BF16_F32``: exact products, summed in float32
      (round to nearest) in the order XLA's dot kernel chooses.  Runs are
      promoted as DeepGEMM does: acc + run_sum * fl32(s_a * s_b), which XLA
      fuses into one FMA (one rounding); whether it fuses is XLA's code
      generation, so the last bits of a result can change with XLA's version
      or the CPU.  A one-run GEMM is multiplied by its scale once.
    * ``"fp8"`` / ``"fp8_fast"``: as "chunked" with the runs as hardware FP8
      dots (``ANY_F8_ANY_F8_F32`` / ``..._FAST_ACCUM``; GPUs with FP8 only).
    * ``"pallas"``: the block-scaled Pallas kernel: Triton on a Hopper GPU,
      Mosaic on a TPU, interpret mode elsewhere.
    * ``"auto"``: the Pallas kernel on a Hopper GPU or a TPU where it
      applies, else "chunked"; on a CPU without bfloat16 dot instructions
      "xla" (see ``fp8jax.gemm.AUTO``).

    ``accumulation``: when set, every quantized GEMM the recipe covers (dense
    and expert) runs on the tensor-core accumulation emulator instead
    (``fp8jax.accumulate``), whatever ``impl`` says.

    Sites (DeepSeek-V3 section 3.3.3), switched per recipe and applied by
    :func:`for_site`: ``attn_out_pow2`` / ``attn_out_cache="e5m6"`` give the
    input of the linear after attention power-of-two scales and an E5M6
    cache for its Wgrad; ``dispatch_pow2`` gives the tokens dispatched to the
    routed experts power-of-two scales; ``down_grad_pow2`` gives the
    activation gradient before the routed experts' down-projection
    power-of-two scales.  ``x_cache`` is what a GEMM's Wgrad re-quantizes x
    from: None, its cached FP8 operand; "e5m6", x in E5M6 in 1x128 tiles
    along K with power-of-two scales (the smallest 2^k with tile amax / 2^k
    <= 65024, so nothing clips; :func:`fp8jax.operands.e5m6_tiles`), the
    paper's cache; "e5m6_unscaled", x rounded to E5M6 with no scale
    (saturating at +-65024; the ``attn_out_e5m6_unscaled`` variant).  Both
    are emulated in bfloat16, which holds every value of either exactly.

    ``high_precision_last``: the fraction of the model's blocks, the last
    ones, whose GEMMs skip quantization and run as the bf16 baseline does
    (``ceil(fraction * n_layers)`` blocks; 0 = none).  Applied by
    :func:`for_layer`; a GEMM outside a model's blocks never sees it.
    """

    name: str
    fprop: GemmSpec
    dgrad: GemmSpec
    wgrad: GemmSpec
    compute_dtype: str = "bfloat16"
    accumulation: Accumulation | None = None
    delayed: DelayedConfig = field(default_factory=DelayedConfig)
    impl: str = "auto"
    dequant_dtype: str = "float32"
    x_cache: str | None = None
    dispatch_pow2: bool = False
    attn_out_cache: str | None = None
    attn_out_pow2: bool = False
    down_grad_pow2: bool = False
    # Seed of the Hadamard signs and the stochastic-rounding keys (block formats).
    seed: int = 0
    high_precision_last: float = 0.0

    def __post_init__(self) -> None:
        names = ("auto", *dict.fromkeys(i for impls in IMPLS.values() for i in impls))
        if self.impl not in names:
            raise ValueError(f"impl must be one of {names}, got {self.impl!r}")
        if self.dequant_dtype not in ("float32", "bfloat16"):
            raise ValueError("dequant_dtype must be 'float32' or 'bfloat16'")
        if not 0.0 <= self.high_precision_last <= 1.0:
            raise ValueError(
                f"high_precision_last must be a fraction in [0, 1], got {self.high_precision_last}"
            )
        for name in ("x_cache", "attn_out_cache"):
            if getattr(self, name) not in CACHE_FORMATS:
                raise ValueError(
                    f"{name} must be one of {CACHE_FORMATS}, got {getattr(self, name)!r}"
                )

    @property
    def compute(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def specs(self) -> dict[str, QuantSpec]:
        """All six operand specs by name: fprop_x, fprop_w, dgrad_dy, ..."""
        return {
            name: getattr(getattr(self, kind), side) for name, (kind, side) in _OPERANDS.items()
        }

    @property
    def is_fp8(self) -> bool:
        return any(s.quantized for s in self.specs().values())


# Operand name (as in Recipe.specs) -> (GEMM, side).
_OPERANDS = {
    "fprop_x": ("fprop", "lhs"),
    "fprop_w": ("fprop", "rhs"),
    "dgrad_dy": ("dgrad", "lhs"),
    "dgrad_w": ("dgrad", "rhs"),
    "wgrad_x": ("wgrad", "lhs"),
    "wgrad_dy": ("wgrad", "rhs"),
}


def _pow2_specs(recipe: Recipe, *operands: str) -> Recipe:
    """``recipe`` with power-of-two scales for the named operands that are quantized.

    Operand names as in :meth:`Recipe.specs`.  Block formats compute their
    own scales (E8M0 / E4M3) and are left as they are.
    """
    gemms = {"fprop": recipe.fprop, "dgrad": recipe.dgrad, "wgrad": recipe.wgrad}
    for name in operands:
        kind, field_name = _OPERANDS[name]
        gemm = gemms[kind]
        spec = getattr(gemm, field_name)
        if spec.quantized and spec.fmt not in BLOCK_FORMATS:
            gemms[kind] = dataclasses.replace(
                gemm, **{field_name: dataclasses.replace(spec, pow2=True)}
            )
    return dataclasses.replace(recipe, **gemms)


def for_site(recipe: Recipe, site: str) -> Recipe:
    """The recipe a GEMM at ``site`` runs with.

    DeepSeek-V3 (section 3.3.3) treats three tensors apart from the general
    rule (amax scales, FP8 cache); each is a switch of the recipe:

    ============== ====================================== ==========================
    site           the GEMM                               rule (when switched on)
    ============== ====================================== ==========================
    "attn_out"     the linear after attention             ``attn_out_pow2``: x with
                                                          power-of-two scales at
                                                          Fprop and in its 128x1
                                                          Wgrad tiles;
                                                          ``attn_out_cache``: x
                                                          cached for Wgrad in
                                                          E5M6, 1x128 tiles with
                                                          power-of-two scales
    "dispatch"     the routed experts' up-projection,     ``dispatch_pow2``: x with
                   whose input is dispatched in FP8       power-of-two scales at
                                                          Fprop and in its 128x1
                                                          Wgrad tiles
    "expert_down"  the routed experts' down-projection    ``down_grad_pow2``: the
                                                          gradient dy with
                                                          power-of-two scales in
                                                          Dgrad and Wgrad
    ============== ====================================== ==========================

    Every other GEMM, and every operand not named here, uses the recipe as
    it is.  A power-of-two tensor keeps power-of-two scales in both of its
    tilings (1x128 where it is produced, 128x1 for Wgrad), which is why the
    paper gives them to the tensors that are re-tiled or sent in FP8.
    """
    if site not in GEMM_SITES:
        raise ValueError(f"unknown site {site!r}; sites: {GEMM_SITES}")
    if site == "attn_out":
        r = _pow2_specs(recipe, "fprop_x", "wgrad_x") if recipe.attn_out_pow2 else recipe
        if recipe.attn_out_cache is not None:
            r = dataclasses.replace(r, x_cache=recipe.attn_out_cache)
        return r
    if site == "dispatch" and recipe.dispatch_pow2:
        return _pow2_specs(recipe, "fprop_x", "wgrad_x")
    if site == "expert_down" and recipe.down_grad_pow2:
        return _pow2_specs(recipe, "dgrad_dy", "wgrad_dy")
    return recipe


def high_precision_layers(recipe: Recipe, n_layers: int) -> int:
    """How many of a model's last ``n_layers`` blocks run unquantized: ceil(fraction * n_layers)."""
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    # The product is rounded first so 0.16 * 50 (8.000000000000002) gives 8, not 9.
    return min(n_layers, math.ceil(round(recipe.high_precision_last * n_layers, 9)))


def for_layer(recipe: Recipe, layer: int, n_layers: int) -> Recipe:
    """The recipe of block ``layer`` (0-based) of a model with ``n_layers`` blocks.

    The last :func:`high_precision_layers` blocks get every operand
    unquantized (cast to ``compute_dtype``, as :func:`bf16`), the rest the
    recipe as it is.
    """
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer {layer} is outside [0, {n_layers})")
    if layer < n_layers - high_precision_layers(recipe, n_layers):
        return recipe
    plain = QuantSpec(None, "tensor")
    return dataclasses.replace(
        recipe,
        fprop=GemmSpec(plain, plain),
        dgrad=GemmSpec(plain, plain),
        wgrad=GemmSpec(plain, plain),
        high_precision_last=0.0,
    )


def needs_state(recipe: Recipe) -> bool:
    """True when the recipe uses delayed scaling (a DelayedGemmState is needed)."""
    return any(s.quantized and s.scaling == "delayed" for s in recipe.specs().values())


def _uniform(name: str, spec_x: QuantSpec, spec_w: QuantSpec, spec_dy: QuantSpec, **kw) -> Recipe:
    return Recipe(
        name=name,
        fprop=GemmSpec(spec_x, spec_w),
        dgrad=GemmSpec(spec_dy, spec_w),
        wgrad=GemmSpec(spec_x, spec_dy),
        **kw,
    )


def deepseek_v3(
    pow2: bool = False, accumulation: Accumulation | None = None, *, x_pow2: bool = False
) -> Recipe:
    """DeepSeek-V3's FP8 recipe (arXiv 2412.19437, sections 3.3.2-3.3.3), site by site.

    Unified E4M3 for every operand, forward and backward.  Granularity and
    scales, section 3.3.2: "for activations, we group and scale elements on
    a 1x128 tile basis ... for weights, we group and scale elements on a
    128x128 block basis"; "we calculate the maximum absolute value online
    for each 1x128 activation tile or 128x128 weight block".  So activations
    and gradients get 1x128 tiles along each GEMM's contraction axis (128x1
    along the tokens for Wgrad, re-quantized from the cached FP8 activation),
    weights 128x128 blocks, and every scale is amax / 448, so a tile's
    largest element lands on 448.  No amax floor.

    Power-of-two scales only where section 3.3.3 puts them (see
    :func:`for_site` for the sites and what each changes):

    * the input of the linear after attention, "a customized E5M6 data
      format exclusively for these activations ... these activations will be
      converted from an 1x128 quantization tile to an 128x1 tile in the
      backward pass.  To avoid introducing extra quantization error, all the
      scaling factors are round scaled, i.e., integral power of 2"
      (``attn_out_pow2``, ``attn_out_cache="e5m6"``);
    * "we quantize the activation before MoE up-projections into FP8 and
      then apply dispatch components ... scaling factors for this activation
      are integral power of 2" (``dispatch_pow2``);
    * "A similar strategy is applied to the activation gradient before MoE
      down-projections" (``down_grad_pow2``).

    ``accumulation`` runs every quantized GEMM on the Hopper accumulation
    emulator (promotion every 128, FFMA promotion by default: DeepGEMM's).
    Named variants, not the paper's recipe: ``x_pow2`` gives every linear's
    activation x power-of-two scales (at Fprop and in its Wgrad tiles; see
    :func:`deepseek_v3_pow2x`); ``pow2`` gives every operand power-of-two
    scales (UE8M0, as DeepSeek-V3.1 checkpoints and MX hardware use).
    """
    act = QuantSpec("e4m3", "tile", 128, "current", pow2)
    x = QuantSpec("e4m3", "tile", 128, "current", pow2 or x_pow2)
    wgt = QuantSpec("e4m3", "block", 128, "current", pow2)
    return Recipe(
        name="deepseek_v3",
        fprop=GemmSpec(x, wgt),
        dgrad=GemmSpec(act, wgt),
        wgrad=GemmSpec(x, act),
        accumulation=accumulation,
        attn_out_pow2=True,
        attn_out_cache="e5m6",
        dispatch_pow2=True,
        down_grad_pow2=True,
    )


def deepseek_v3_pow2x() -> Recipe:
    """Variant of :func:`deepseek_v3`: power-of-two scales for every linear's activation x.

    x gets power-of-two 1x128 tiles at Fprop and power-of-two 128x1 tiles for
    Wgrad in every linear, not only at the paper's sites, so re-tiling the
    cached activation adds no error but no tile's largest element lands on
    448.  The gradient before the experts' down-projection keeps amax scales.
    """
    r = deepseek_v3(x_pow2=True)
    return dataclasses.replace(r, name="deepseek_v3_pow2x", down_grad_pow2=False)


def with_ue8m0(recipe: Recipe) -> Recipe:
    """``recipe`` with every power-of-two scale stored as UE8M0 (E8M0 bytes).

    Specs with ``pow2`` get ``scale_fmt="ue8m0"``; the others (amax scales,
    unquantized, block formats) are left as they are.  Codes, scale values
    and every GEMM output and gradient are those of ``recipe`` bit for bit;
    only the bytes of the stored and carried scales change (a quarter).
    """

    def ue8m0(spec: QuantSpec) -> QuantSpec:
        return dataclasses.replace(spec, scale_fmt="ue8m0") if spec.pow2 else spec

    gemms = {
        kind: GemmSpec(ue8m0(g.lhs), ue8m0(g.rhs))
        for kind, g in (("fprop", recipe.fprop), ("dgrad", recipe.dgrad), ("wgrad", recipe.wgrad))
    }
    return dataclasses.replace(recipe, **gemms)


def deepseek_v3_1(accumulation: Accumulation | None = None) -> Recipe:
    """DeepSeek-V3.1's FP8 recipe as far as it is public: :func:`deepseek_v3` with
    power-of-two scales everywhere, stored as UE8M0 bytes.

    Known: the DeepSeek-V3.1 model card says the model "is trained using the
    UE8M0 FP8 scale data format to ensure compatibility with microscaling data
    formats", and its checkpoint's config.json has ``"quantization_config":
    {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}``: E4M3 weights in
    128x128 blocks with power-of-two scales, activations quantized online
    (its inference code rounds each 1x128 activation scale up to a power of
    two when ``scale_fmt`` is set).
    Assumed (not published): the training recipe is otherwise DeepSeek-V3's
    (1x128 activation and gradient tiles, 128x128 weight blocks, E4M3 for
    every operand forward and backward, the E5M6 cache at the attention
    output, promotion every 128), with every scale, gradients included, a
    power of two.  Each GEMM equals ``deepseek_v3(pow2=True)`` bit for bit;
    the FP8 cache and the expert dispatch hold one byte per scale.
    """
    r = with_ue8m0(deepseek_v3(pow2=True, accumulation=accumulation))
    return dataclasses.replace(r, name="deepseek_v3_1")


def hybrid_delayed(history_len: int = 16, algo: str = "max", margin: int = 0) -> Recipe:
    """Transformer Engine / Flax default: per-tensor delayed scaling, E4M3 fwd, E5M2 grads."""
    fwd = QuantSpec("e4m3", "tensor", scaling="delayed")
    bwd = QuantSpec("e5m2", "tensor", scaling="delayed")
    return _uniform(
        "hybrid_delayed", fwd, fwd, bwd, delayed=DelayedConfig(history_len, algo, margin)
    )


def current_tensor(fmt_grad: str = "e4m3") -> Recipe:
    """Per-tensor current scaling (scale from this step's amax), E4M3 everywhere."""
    fwd = QuantSpec("e4m3", "tensor")
    return _uniform("current_tensor", fwd, fwd, QuantSpec(fmt_grad, "tensor"))


def rowwise() -> Recipe:
    """Per-row (activations, gradients) / per-column (weights) current scaling, E4M3."""
    spec = QuantSpec("e4m3", "row")
    return _uniform("rowwise", spec, spec, spec)


def bf16() -> Recipe:
    """The baseline: every GEMM in bfloat16 with float32 accumulation."""
    spec = QuantSpec(None, "tensor")
    return _uniform("bf16", spec, spec, spec)


def fp32() -> Recipe:
    """Everything in float32 (a reference for numerics experiments)."""
    spec = QuantSpec(None, "tensor")
    return _uniform("fp32", spec, spec, spec, compute_dtype="float32")


def mxfp8(scale_rounding: str = "floor") -> Recipe:
    """MXFP8 (OCP MX v1.0): E4M3 elements, one E8M0 power-of-two scale per 32
    elements along every GEMM's contraction axis (32x1 along the tokens for
    Wgrad; the weight re-quantized along N for Dgrad).

    ``scale_rounding``: "floor", the OCP rule (preset ``mxfp8``), or "ceil",
    the scale rounded up as NVIDIA's MXFP8 recipe and Transformer Engine do
    (preset ``mxfp8_ceil``); see :class:`QuantSpec`.
    """
    spec = QuantSpec("mxfp8", "tile", 32, scale_rounding=scale_rounding)
    name = "mxfp8" if scale_rounding == "floor" else f"mxfp8_{scale_rounding}"
    return _uniform(name, spec, spec, spec)


def mxfp8_ceil() -> Recipe:
    """MXFP8 with the E8M0 scales rounded up (no element clips): :func:`mxfp8` ("ceil")."""
    return mxfp8("ceil")


NVFP4_HIGH_PRECISION_LAST = 0.16


def nvfp4_all_layers() -> Recipe:
    """:func:`nvfp4` with every block's GEMMs in NVFP4 (no high-precision last blocks)."""
    return dataclasses.replace(nvfp4(high_precision_last=0.0), name="nvfp4_all_layers")


def nvfp4(
    hadamard: bool = True,
    stochastic: bool = True,
    weight_2d: bool = True,
    high_precision_last: float = NVFP4_HIGH_PRECISION_LAST,
) -> Recipe:
    """NVIDIA's NVFP4 training recipe ("Pretraining LLMs with NVFP4", 2025).

    E2M1 elements, one E4M3 scale per 16 elements along the contraction axis
    and a float32 scale per tensor.  ``weight_2d``: weights in 16x16 blocks,
    which serve W and W^T alike (else 1x16 runs, and Dgrad re-quantizes the
    cached FP4 weight along N).  ``hadamard``: the 16-point random Hadamard
    transform on both Wgrad operands along the tokens.  ``stochastic``:
    stochastic rounding of the gradient dy (Dgrad and Wgrad); activations
    and weights round to nearest.  ``high_precision_last``: the paper keeps
    about 16% of its linear layers in BF16, the final blocks' (its ablations
    find the last layers the most sensitive to FP4); here the last
    ``ceil(0.16 * n_layers)`` blocks of the model run their GEMMs as the
    bf16 baseline does (:func:`for_layer`).  ``nvfp4_all_layers`` quantizes
    every block.  The embedding, head, router and attention core are high
    precision in every recipe.
    """
    act = QuantSpec("nvfp4", "tile", 16)
    wgt = QuantSpec("nvfp4", "block" if weight_2d else "tile", 16)
    dy = QuantSpec("nvfp4", "tile", 16, stochastic=stochastic)
    return Recipe(
        name="nvfp4",
        high_precision_last=high_precision_last,
        fprop=GemmSpec(act, wgt),
        dgrad=GemmSpec(dy, wgt),
        wgrad=GemmSpec(
            dataclasses.replace(act, hadamard=hadamard), dataclasses.replace(dy, hadamard=hadamard)
        ),
    )


PRESETS = {
    "deepseek_v3": deepseek_v3,
    "deepseek_v3_pow2x": deepseek_v3_pow2x,
    "deepseek_v3_1": deepseek_v3_1,
    "mxfp8": mxfp8,
    "mxfp8_ceil": mxfp8_ceil,
    "nvfp4": nvfp4,
    "nvfp4_all_layers": nvfp4_all_layers,
    "hybrid_delayed": hybrid_delayed,
    "current_tensor": current_tensor,
    "rowwise": rowwise,
    "bf16": bf16,
    "fp32": fp32,
}
