"""GEMM benchmark cases: shapes, implementations (variants) and the jitted functions.

A *case* is (shape, variant, pass):

* shape: y[M, N] = x[M, K] @ w[K, N] (x the activation, w the weight);
* variant: a recipe preset (``fp8jax.recipes.PRESETS``) with one of the GEMM
  core's implementations (``Recipe.impl``) -- ``"xla"`` with ``dequant_dtype``
  float32 or bfloat16 and ``"chunked"`` for FP8 recipes, ``"fp8"`` /
  ``"fp8_fast"`` on a GPU, ``"pallas"`` where the Pallas kernel is usable --
  or the hand-written reference :func:`fp8_per_tensor_matmul`;
* pass: "fwd" (y only: one GEMM, 2MKN flops) or "fwd_bwd" (y, dx, dw for a
  given dy: Fprop + Dgrad + Wgrad, 6MKN flops), both through
  ``fp8jax.dot_general``'s custom VJP (quantization included in the time).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import fp8jax
from fp8jax import recipes as recipes_lib
from fp8jax import registry, scaling
from fp8jax.formats import E4M3, E5M2, saturating_cast
from fp8jax.kernels import kernel_available

PASSES = ("fwd", "fwd_bwd")
SHAPE_GROUPS = ("square", "dsv3", "moe")

#: DeepSeek-V3 linear shapes: K = d_model = 7168; N = 2112 (attention down-projections,
#: 1536 + 576), 24576 (a wide up-projection), 4096 and 7168.
DSV3_K = 7168
DSV3_N = (2112, 24576, 4096, 7168)
#: DeepSeek-V3 routed-expert GEMMs: fused gate+up (7168 -> 2 x 2048) and down (2048 -> 7168).
MOE_KN = ((7168, 4096), (2048, 7168))
SQUARE_SIZES = (1024, 2048, 4096, 8192)
#: Routed experts and rows (tokens) per expert of the grouped expert-GEMM shapes:
#: full (DeepSeek-V3's expert (K, N) pairs) and small (CPU, K = N = 256).
GROUPED_FULL = (8, 512)
GROUPED_SMALL = (4, 32)

REFERENCE_NAME = "xla_fp8_per_tensor"
_MM_DIMS = (((1,), (0,)), ((), ()))


@dataclass(frozen=True)
class Shape:
    """One GEMM shape: x[M, K] @ w[K, N]."""

    name: str
    group: str
    m: int
    k: int
    n: int

    def flops(self, pass_: str) -> int:
        """2MKN for the forward GEMM; 6MKN for Fprop + Dgrad + Wgrad."""
        if pass_ not in PASSES:
            raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
        return (2 if pass_ == "fwd" else 6) * self.m * self.k * self.n


def gemm_shapes(
    groups: Sequence[str] = SHAPE_GROUPS,
    *,
    m_tokens: int = 4096,
    expert_m: int | None = None,
    square_sizes: Sequence[int] = SQUARE_SIZES,
    dsv3_n: Sequence[int] = DSV3_N,
) -> list[Shape]:
    """The benchmark shapes of the requested groups, in group order.

    square: M = K = N = s for s in ``square_sizes``; dsv3: M = ``m_tokens``,
    K = 7168, N in ``dsv3_n``; moe: M = ``expert_m`` (default ``m_tokens``)
    tokens routed to one expert, (K, N) in MOE_KN.
    """
    out: list[Shape] = []
    for g in groups:
        if g == "square":
            out += [Shape(f"sq{s}", g, s, s, s) for s in square_sizes]
        elif g == "dsv3":
            out += [Shape(f"dsv3_k{DSV3_K}_n{n}", g, m_tokens, DSV3_K, n) for n in dsv3_n]
        elif g == "moe":
            me = expert_m or m_tokens
            out += [Shape(f"moe_k{k}_n{n}", g, me, k, n) for k, n in MOE_KN]
        else:
            raise ValueError(f"unknown shape group {g!r}; known: {SHAPE_GROUPS}")
    return out


@dataclass(frozen=True)
class GroupedShape:
    """One grouped expert GEMM: ``experts`` groups of ``rows`` tokens, x[rows, K] @ w_e[K, N]."""

    name: str
    experts: int
    rows: int
    k: int
    n: int

    @property
    def m(self) -> int:
        return self.experts * self.rows


def grouped_shapes(small: bool) -> list[GroupedShape]:
    """DeepSeek-V3's expert GEMMs (MOE_KN) on GROUPED_FULL, or one K = N = 256 case."""
    if small:
        e, rows = GROUPED_SMALL
        return [GroupedShape(f"grouped_e{e}_k256_n256", e, rows, 256, 256)]
    e, rows = GROUPED_FULL
    return [GroupedShape(f"grouped_e{e}_k{k}_n{n}", e, rows, k, n) for k, n in MOE_KN]


def kernel_shapes(small: bool) -> list[Shape]:
    """The Pallas kernel benchmark's dense shapes.

    Full: 4096^3 and every DeepSeek-V3 and expert shape at M = 4096 tokens.
    Small (CPU): 256^3 and one odd shape (K, N not multiples of 128).
    """
    if small:
        return [*gemm_shapes(("square",), square_sizes=(256,)), parse_shape("128x896x264")]
    return gemm_shapes(SHAPE_GROUPS, square_sizes=(4096,))


#: Mosaic GPU interpret mode is a correctness tool: one tiny shape shows the kernel runs.
INTERPRET_SHAPE = Shape("interpret_tiny", "custom", 64, 256, 128)


def parse_shape(text: str) -> Shape:
    """'MxKxN' (e.g. '4096x7168x2112') -> Shape in group 'custom'."""
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape must be MxKxN with integers, got {text!r}") from None
    if min(m, k, n) <= 0:
        raise ValueError(f"shape dims must be positive, got {text!r}")
    return Shape(f"m{m}_k{k}_n{n}", "custom", m, k, n)


# --------------------------------------------------------------------------
# The hand-written canonical per-tensor FP8 GEMM (what XLA's GPU GEMM rewriter matches)
# --------------------------------------------------------------------------


def _quantize_per_tensor(x: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    # Current scaling: scale = amax / fmt_max in float32 from this tensor.
    scale = scaling.scale_from_amax(scaling.finite_amax(x), fmt)
    # Divide in float32 (bf16 inputs are exact in it), then saturate: values past
    # the range clip to +-max instead of turning into NaN.
    return saturating_cast(x.astype(jnp.float32) / scale, fmt), scale


def dequantized_dot(a, sa, b, sb, dims, out_dtype):
    # The canonical pattern XLA rewrites into a cuBLASLt FP8 GEMM on Hopper:
    # dot(convert(a_f8) * scale_a, convert(b_f8) * scale_b), the convert and the
    # scalar multiply in the output dtype (bf16), bf16 result.  The scale is
    # rounded to bf16 here (<= 2^-9 relative, uniform over the tensor).
    ad = a.astype(out_dtype) * sa.astype(out_dtype)
    bd = b.astype(out_dtype) * sb.astype(out_dtype)
    return lax.dot_general(ad, bd, dims, preferred_element_type=out_dtype)


@jax.custom_vjp
def fp8_per_tensor_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """y = x @ w with per-tensor current-scaled FP8 GEMMs in the canonical XLA pattern.

    A reference implementation for the benchmark, independent of
    ``fp8jax.dot_general``: x, w (2-D) quantized per tensor to E4M3 and dy
    to E5M2 (the hybrid recipe of Transformer Engine), every GEMM written as
    ``dot(convert(a) * sa, convert(b) * sb)`` in the input dtype with that
    dtype as output.  Fprop, Dgrad and Wgrad are all FP8.
    """
    y, _ = _ref_fwd(x, w)
    return y


def _ref_fwd(x, w):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"fp8_per_tensor_matmul takes 2-D x and w, got {x.shape}, {w.shape}")
    xq, sx = _quantize_per_tensor(x, E4M3)
    wq, sw = _quantize_per_tensor(w, E4M3)
    y = dequantized_dot(xq, sx, wq, sw, _MM_DIMS, x.dtype)
    # Residuals: FP8 data + float32 scales only.
    return y, (xq, sx, wq, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _ref_bwd(res, g):
    xq, sx, wq, sw, x_proto, w_proto = res
    gq, sg = _quantize_per_tensor(g, E5M2)
    # dgrad: dx = dy @ w^T (contract N); wgrad: dw = x^T @ dy (contract M).
    dx = dequantized_dot(gq, sg, wq, sw, (((1,), (1,)), ((), ())), x_proto.dtype)
    dw = dequantized_dot(xq, sx, gq, sg, (((0,), (0,)), ((), ())), w_proto.dtype)
    return dx, dw


fp8_per_tensor_matmul.defvjp(_ref_fwd, _ref_bwd)


# --------------------------------------------------------------------------
# Variants: recipe x implementation
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One implementation of the GEMM: a recipe preset + impl, or the reference."""

    name: str
    recipe: str  # preset name, or REFERENCE_NAME
    impl: str  # one of SWEEP_IMPLS
    dequant_dtype: str | None = None  # FP8 recipes on the XLA path

    def make_recipe(self) -> recipes_lib.Recipe | None:
        if self.impl == "reference":
            return None
        r = registry.get(self.recipe)
        changes: dict[str, Any] = {"impl": self.impl}
        if self.dequant_dtype is not None:
            changes["dequant_dtype"] = self.dequant_dtype
        return dataclasses.replace(r, **changes)


def _pallas_probe(recipe: recipes_lib.Recipe) -> str | None:
    """None if ``recipe`` with impl='pallas' runs fwd+bwd on a small GEMM, else the reason."""
    if not kernel_available():
        return f"fp8jax.kernels.kernel_available() is False on {jax.default_backend()}"
    r = dataclasses.replace(recipe, impl="pallas")
    x = jnp.ones((256, 256), jnp.bfloat16)
    w = jnp.ones((256, 256), jnp.bfloat16)
    state = scaling.init_delayed_gemm_state(r) if recipes_lib.needs_state(r) else None
    try:

        def loss(x, w):
            return jnp.sum(
                fp8jax.dot_general(x, w, _MM_DIMS, recipe=r, state=state).astype(jnp.float32)
            )

        jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w))
    except Exception as e:  # the kernel does not apply to this recipe / backend
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


#: Implementations the sweep knows: the GEMM core's (Recipe.impl) and the hand-written reference.
SWEEP_IMPLS = ("xla", "chunked", "fp8", "fp8_fast", "pallas", "reference")


def backend_variants(
    recipe_names: Sequence[str] | None = None,
    impls: Sequence[str] | None = None,
    *,
    dequant_dtypes: Sequence[str] = ("float32", "bfloat16"),
    include_reference: bool = True,
) -> tuple[list[Variant], dict[str, str]]:
    """Every (recipe, implementation) this backend offers.

    FP8 recipes: impl "xla" (dequantize, then one dot) once per
    ``dequant_dtypes`` entry; "chunked" (dots of the FP8 codes per run of
    constant scales); "fp8" / "fp8_fast" (the same as hardware FP8 dots) on a
    GPU; "pallas" when the Pallas kernel compiles and runs for that recipe
    here (checked by a small fwd+bwd probe; on CPU it is never offered:
    interpret mode is for tests, not timing).  Non-FP8 recipes (bf16, fp32):
    impl "xla".  ``impls`` filters (see SWEEP_IMPLS).

    Returns (variants, skipped) with skipped: variant name -> reason.
    """
    names = list(recipe_names) if recipe_names else list(recipes_lib.PRESETS)
    want = set(impls) if impls else set(SWEEP_IMPLS)
    bad = want - set(SWEEP_IMPLS)
    if bad:
        raise ValueError(f"unknown impls {sorted(bad)}; known: {', '.join(SWEEP_IMPLS)}")
    on_gpu = jax.default_backend() == "gpu"
    out: list[Variant] = []
    skipped: dict[str, str] = {}
    for name in names:
        r = registry.get(name)
        if not r.is_fp8:
            if "xla" in want:
                out.append(Variant(f"{name}/xla", name, "xla"))
            continue
        if "xla" in want:
            for dd in dequant_dtypes:
                tag = {"float32": "f32", "bfloat16": "bf16"}[dd]
                out.append(Variant(f"{name}/xla-deq{tag}", name, "xla", dd))
        if "chunked" in want:
            out.append(Variant(f"{name}/chunked", name, "chunked"))
        for impl in ("fp8", "fp8_fast"):
            if impl in want:
                if on_gpu:
                    out.append(Variant(f"{name}/{impl}", name, impl))
                else:
                    skipped[f"{name}/{impl}"] = (
                        f"hardware FP8 dots need a GPU, not {jax.default_backend()}"
                    )
        if "pallas" in want:
            reason = _pallas_probe(r)
            if reason is None:
                out.append(Variant(f"{name}/pallas", name, "pallas"))
            else:
                skipped[f"{name}/pallas"] = reason
                logging.info("skip %s/pallas: %s", name, reason)
    if include_reference and "reference" in want:
        out.append(Variant(f"{REFERENCE_NAME}/xla", REFERENCE_NAME, "reference"))
    return out, skipped


# --------------------------------------------------------------------------
# Jitted functions and their inputs
# --------------------------------------------------------------------------


def make_inputs(shape: Shape, dtype=jnp.bfloat16, seed: int = 0) -> dict[str, jax.Array]:
    """x ~ N(0, 1), w ~ N(0, 1/K), dy ~ N(0, 1) in ``dtype`` (LLM-like magnitudes)."""
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (shape.m, shape.k), jnp.float32)
    w = jax.random.normal(kw, (shape.k, shape.n), jnp.float32) / jnp.sqrt(jnp.float32(shape.k))
    dy = jax.random.normal(kg, (shape.m, shape.n), jnp.float32)
    return {"x": x.astype(dtype), "w": w.astype(dtype), "dy": dy.astype(dtype)}


def build_case(
    variant: Variant, pass_: str, inputs: dict[str, jax.Array]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function to jit for (variant, pass) and its positional arguments.

    Delayed-scaling recipes get a DelayedGemmState argument, primed by one
    fwd+bwd call so the timed calls use a populated amax history.
    """
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    recipe = variant.make_recipe()
    x, w, dy = inputs["x"], inputs["w"], inputs["dy"]
    state_args: tuple[Any, ...] = ()
    if recipe is None:
        f = fp8_per_tensor_matmul
    elif recipes_lib.needs_state(recipe):

        def f(x, w, state):
            return fp8jax.dot_general(x, w, _MM_DIMS, recipe=recipe, state=state)

        state = scaling.init_delayed_gemm_state(recipe)
        # One fwd+bwd: the state's gradient is the state holding these tensors' amaxes.
        state_args = (jax.jit(_fwd_bwd(f))(x, w, state, dy)[3],)
    else:

        def f(x, w):
            return fp8jax.dot_general(x, w, _MM_DIMS, recipe=recipe)

    if pass_ == "fwd":
        return f, (x, w, *state_args)
    return _fwd_bwd(f), (x, w, *state_args, dy)


def _fwd_bwd(f: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
    """``(*primals, dy) -> (y, *cotangents of the primals)`` through ``f``'s VJP.

    For a delayed recipe the state's cotangent is the new state (overwrite with gradient).
    """

    def fb(*args):
        *primals, dy = args
        y, vjp = jax.vjp(f, *primals)
        return (y, *vjp(dy))

    return fb
