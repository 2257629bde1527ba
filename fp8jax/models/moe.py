"""Feed-forward blocks: dense SwiGLU and the DeepSeek-V3 MoE (shared + routed experts).

Routed experts are computed dropless: every (token, expert) pair selected by
the router is one row of the grouped expert GEMM (rows sorted by expert, see
:func:`fp8jax.ragged_dot`, ``lax.ragged_dot``'s signature; the bf16 baseline
is ``lax.ragged_dot`` itself); nothing is dropped and no capacity factor
exists.  Outputs are combined with the router's gate weights in float32.
One pipeline on one device and on any mesh (:class:`MoE`): route ->
dispatch -> up-projection -> SwiGLU -> down-projection -> collect, the
(dispatch, collect) pair from :mod:`fp8jax.parallel.experts`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax import platforms
from fp8jax.formats import IEEE_FP8
from fp8jax.kernels import tpu_swiglu
from fp8jax.kernels.tpu_quantize import subnormal_scales
from fp8jax.layout import Layout, pad_axis
from fp8jax.models.config import ModelConfig
from fp8jax.models.router import Router, expert_load, route, seq_balance_loss
from fp8jax.monitors import channel_amax, swiglu_monitors, swiglu_monitors_of_amax
from fp8jax.nn import Dense, taps
from fp8jax.nn.dense import fan_in_init
from fp8jax.nn.grad_noise import init_grad_noise
from fp8jax.nn.observed import record_gemm, run_gemm, value_of
from fp8jax.nn.recording import record
from fp8jax.nn.variables import FP8State
from fp8jax.operands import source_values
from fp8jax.parallel.experts import (
    ExpertRows,
    expert_parallel_size,
    row_experts,
    run_expert_parallel,
    run_local,
)
from fp8jax.quant import QTensor, scale_values
from fp8jax.ragged_dot import ragged_dot_with_stats
from fp8jax.recipes import Recipe, for_site, needs_state
from fp8jax.rounding import floor_log2, pow2_int
from fp8jax.scaling import init_delayed_gemm_state
from fp8jax.schemes import dequantize, quantize, requantizes_codes


def first_token_rows(batch: int, seq: int) -> jax.Array:
    """bool (batch * seq,): the rows of position 0 in a flattened (B, T) layout."""
    return (jnp.arange(batch * seq) % seq) == 0


def _swiglu_f32(h: jax.Array) -> jax.Array:
    # The nonlinearity runs in float32; its output is the next GEMM's input.
    hf = h.astype(jnp.float32)
    return tpu_swiglu.silu_times(hf[..., 0, :], hf[..., 1, :])


def swiglu(h: jax.Array, dtype, recipe: Recipe | None = None) -> jax.Array:
    """silu(gate) * up on a (..., 2, F) tensor, in float32, returned in ``dtype``.

    With a recipe whose activations are FP8 in 1 x tile tiles, the backward
    pass keeps only ``h`` quantized that way (E4M3 codes + one float32 scale
    per tile) and recomputes SwiGLU from it, as DeepSeek-V3 caches the
    SwiGLU input: the forward output is unchanged, the gradient is that of
    SwiGLU at the dequantized ``h``.  Otherwise plain autodiff (``h`` kept
    in its own dtype), also for the block formats (MXFP8 / NVFP4), whose
    elements this cache does not hold.
    """
    spec = recipe.fprop.lhs if recipe is not None else None
    if (
        spec is None
        or not (spec.quantized and Layout.of(spec).tiled)
        or not requantizes_codes(spec.fmt)
    ):
        return _swiglu_f32(h).astype(dtype)
    return _swiglu_cached(h, jnp.dtype(dtype).name, spec)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _swiglu_cached(h, dtype, spec):
    return _swiglu_f32(h).astype(dtype)


def _swiglu_cached_fwd(h, dtype, spec):
    # Tiles along F within each of gate / up (the last axis), scaled as the
    # spec says (power-of-two scales included).
    q = quantize(h, spec, -1)
    # An empty array carries h's dtype to the backward pass.
    return _swiglu_f32(h).astype(dtype), (q, jnp.zeros((0,), h.dtype))


def _swiglu_cached_bwd(dtype, spec, res, g):
    q, h_like = res
    kernel = _grad_kernel_fits(q)
    # A TPU's kernel where it takes the cache; XLA's gradient elsewhere.
    dh = platforms.choose(
        lambda p: "tpu kernel" if kernel and p == "tpu" else "xla",
        lambda how: partial(
            _cached_grad_tpu if how == "tpu kernel" else _cached_grad, h_like.dtype
        ),
        (q, g),
    )
    return (dh,)


def _cached_grad(dtype, q: QTensor, g: jax.Array) -> jax.Array:
    """The gradient of SwiGLU at the dequantized cache ``q``, float32, returned as ``dtype``."""
    _, vjp = jax.vjp(_swiglu_f32, dequantize(q, jnp.float32))
    (dh,) = vjp(g.astype(jnp.float32))
    return dh.astype(dtype)


def _grad_kernel_fits(q: QTensor) -> bool:
    """Whether :mod:`fp8jax.kernels.tpu_swiglu` takes the cache ``q``: IEEE FP8 codes in
    1x128 tiles along F of a (..., 2, F) tensor, one level of scales."""
    lay = q.layout
    return (
        q.scheme == "fp8"
        and q.tensor_scale is None
        and q.ndim >= 2
        and q.shape[-2] == 2
        and lay.tiled
        and lay.tile == tpu_swiglu.GROUP
        and lay.axis == q.ndim - 1
        and q.data.dtype in IEEE_FP8
    )


def _cached_grad_kernel(dtype, q: QTensor, g: jax.Array, interpret: bool = False) -> jax.Array:
    """:func:`_cached_grad` by the Pallas TPU kernel (``interpret``: its interpret mode)."""
    f = q.shape[-1]
    scales = scale_values(q)
    # Zero codes and cotangents pad F to whole tiles: their gradient is
    # zero, and cropped.
    codes = pad_axis(q.data, -1, tpu_swiglu.GROUP)
    fp = codes.shape[-1]
    codes = codes.reshape(-1, 2, fp)
    gp = pad_axis(g, -1, tpu_swiglu.GROUP).reshape(-1, fp)
    dh = tpu_swiglu.swiglu_grad(
        codes,
        scales.reshape(-1, 2, fp // tpu_swiglu.GROUP),
        gp,
        subnormal_scales(scales),
        dtype=jnp.dtype(dtype).name,
        interpret=interpret,
    )
    return dh[..., :f].reshape(q.shape)


def _cached_grad_tpu(dtype, q: QTensor, g: jax.Array) -> jax.Array:
    """:func:`_cached_grad_kernel`, traced and lowered for TPU only."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.dtype(dtype))
    return platforms.only_on(("tpu",), partial(_cached_grad_kernel, dtype), q, g, out_shape=out)


_swiglu_cached.defvjp(_swiglu_cached_fwd, _swiglu_cached_bwd)


def smooth_swiglu_scales(
    h: jax.Array, segments: jax.Array | None = None, n_segments: int = 1
) -> jax.Array:
    """Smooth-SwiGLU's per-channel scales: 2^floor(log2 amax_c), float32, no gradient.

    ``h``: a SwiGLU output (..., F); with ``segments`` (int (rows,), the expert
    of each row of a 2-d ``h``) one scale per (segment, channel), shape
    (n_segments, F); else (F,).  Dividing channel c by its scale puts its
    amax in [1, 2).  Powers of two, so that dividing h and multiplying the
    down-projection's rows by them is exact in every float format (the
    function is unchanged bit for bit before quantization, barring float
    overflow); channels with no finite non-zero value (and empty segments)
    get 1.
    """
    amax = jax.lax.stop_gradient(channel_amax(h, segments, n_segments))
    amax = amax if segments is not None else amax.reshape(h.shape[-1])
    ok = jnp.isfinite(amax) & (amax > 0)
    # Exponents kept in [-126, 126] so both 2^e and 2^-e are normal float32.
    e = jnp.clip(jnp.where(ok, floor_log2(jnp.where(ok, amax, 1.0)), 0), -126, 126)
    return pow2_int(e)


def _smooth_rows(h: jax.Array, scale: jax.Array) -> jax.Array:
    # h / scale as a product by the exact reciprocal power of two, in h's dtype.
    inv = pow2_int(-floor_log2(scale))
    return (h.astype(jnp.float32) * inv).astype(h.dtype)


class SwiGLU(nnx.Module):
    """Dense SwiGLU FFN: W_down (silu(x W_gate) * (x W_up)), gate/up fused in one GEMM.

    With ``cfg.smooth_swiglu`` (Smooth-SwiGLU, Fishman et al. 2024): the
    down-projection's input is divided per channel by
    :func:`smooth_swiglu_scales` before it is quantized, and the same scales
    multiply the matching rows of W_down, so every channel of the quantized
    input has amax in [1, 2) and the layer computes the same function.
    Sows its monitors (:func:`fp8jax.monitors.swiglu_monitors`) under
    ``name/swiglu``.
    """

    def __init__(self, cfg: ModelConfig, recipe: Recipe, d_ff: int, *, name: str, rngs: nnx.Rngs):
        kw = dict(recipe=recipe, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.cfg = cfg
        self.name = name
        self.w13 = Dense(cfg.d_model, (2, d_ff), name=f"{name}/w13", **kw)
        self.w2 = Dense(d_ff, cfg.d_model, name=f"{name}/w2", **kw)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        h = swiglu(self.w13(x_BxTxD), self.cfg.dtype, self.w2.recipe)
        if taps.site_open("ffn_hidden"):
            b, t, f = h.shape
            h = taps.site("ffn_hidden", h.reshape(b * t, f), first_token_rows(b, t))
            h = h.reshape(b, t, f)
        w13 = self.w13.kernel_values()
        record(self, self.name, {"swiglu": swiglu_monitors(h, w13[:, 0], w13[:, 1])})
        if not self.cfg.smooth_swiglu:
            return self.w2(h)
        scale = smooth_swiglu_scales(h)
        return self.w2(_smooth_rows(h, scale), kernel_scale=scale)


class MoE(nnx.Module):
    """Shared experts + dropless routed SwiGLU experts (DeepSeek-V3 style).

    One pipeline: route -> dispatch -> up-projection -> SwiGLU ->
    down-projection -> collect.  The middle (:meth:`_expert_ffn`) is one
    pure function of the rows sorted by expert; the (dispatch, collect) pair
    around it is :func:`fp8jax.parallel.experts.run_local` on one device or
    :func:`~fp8jax.parallel.experts.run_expert_parallel` on a mesh with an
    "expert" axis (:meth:`_exchange` picks).  Either returns the experts'
    telemetry, which :meth:`_record` sows in one place: the two GEMMs'
    operands and noise ratios (``<name>/experts_w13``, ``<name>/experts_w2``)
    and the SwiGLU monitors (``<name>/experts/swiglu``), the same keys on
    every mesh.
    """

    def __init__(self, cfg: ModelConfig, recipe: Recipe, *, name: str, rngs: nnx.Rngs):
        e, d, f = cfg.n_routed_experts, cfg.d_model, cfg.d_expert
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.recipe = recipe
        # The routed experts' up-projection (its input is dispatched in FP8) and
        # down-projection (its activation gradient is sent back) are sites of
        # their own (fp8jax.recipes.for_site).
        self.dispatch_recipe = for_site(recipe, "dispatch")
        self.down_recipe = for_site(recipe, "expert_down")
        self.name = name
        self.router = Router(d, e, rngs=rngs)
        self.w13 = nnx.Param(fan_in_init(d)(rngs.params(), (e, d, 2 * f), pdt))
        self.w2 = nnx.Param(fan_in_init(f)(rngs.params(), (e, f, d), pdt))
        delayed = needs_state(recipe)
        self.w13_state = FP8State(init_delayed_gemm_state(recipe)) if delayed else None
        self.w2_state = FP8State(init_delayed_gemm_state(recipe)) if delayed else None
        self.w13_noise = init_grad_noise(self.dispatch_recipe)
        self.w2_noise = init_grad_noise(self.down_recipe)
        self.shared = (
            SwiGLU(cfg, recipe, cfg.n_shared_experts * f, name=f"{name}/shared", rngs=rngs)
            if cfg.n_shared_experts > 0
            else None
        )

    def gemm_weights(self) -> dict[str, Recipe]:
        """{parameter name: the recipe of the GEMM it is the weight of} (FSDP gathers read it)."""
        return {"w13": self.dispatch_recipe, "w2": self.down_recipe}

    def _values(self, w: nnx.Param) -> jax.Array:
        """An expert weight's values (an FSDP-gathered QTensor dequantized; one quantized
        once per step, the values it was made from)."""
        return source_values(w.get_value(), self.cfg.param_dtype)

    def _expert_ffn(
        self,
        rows: ExpertRows,
        w13: jax.Array | QTensor,
        w2: jax.Array | QTensor,
        noise13: jax.Array | None,
        noise2: jax.Array | None,
    ) -> tuple[jax.Array, dict]:
        """Up-projection -> SwiGLU -> [activation site] -> down-projection on ``rows``.

        Pure (it may run inside ``shard_map``): returns (y (R, D) in the rows'
        order, {"experts_w13": GEMM stats, "experts_w2": GEMM stats,
        "channel_amax": (E_here, F) of the SwiGLU output}).  ``w13`` / ``w2``:
        the experts' (E_here, K, N) weights, arrays or FSDP-gathered QTensors
        (the grouped GEMM takes their codes as they are); ``noise13`` /
        ``noise2``: the GEMMs' GradNoise values (None: no probe).
        """
        cfg = self.cfg
        e, f = rows.group_sizes.shape[0], cfg.d_expert
        kw = dict(preferred_element_type=cfg.dtype)
        h, st13 = run_gemm(
            "expert",
            ragged_dot_with_stats,
            rows.rows,
            w13,
            rows.group_sizes,
            recipe=self.dispatch_recipe,
            state=value_of(self.w13_state),
            noise=noise13,
            **kw,
        )
        act = swiglu(h.reshape(-1, 2, f), cfg.dtype, self.recipe)
        if rows.first is not None and taps.site_open("ffn_hidden"):
            # The routed experts' down-projection inputs too: rows of first tokens.
            act = taps.site("ffn_hidden", act, rows.first)
        expert = row_experts(rows.group_sizes, act.shape[0])
        amax = channel_amax(jax.lax.stop_gradient(act), expert, e)
        if cfg.smooth_swiglu:
            scale_ExF = smooth_swiglu_scales(act, expert, e)
            act = _smooth_rows(act, scale_ExF[expert])
            # The same powers of two on W_down's rows: exact, the product unchanged.
            w2 = source_values(w2, cfg.param_dtype) * scale_ExF[:, :, None]
        y, st2 = run_gemm(
            "expert",
            ragged_dot_with_stats,
            act,
            w2,
            rows.group_sizes,
            recipe=self.down_recipe,
            state=value_of(self.w2_state),
            noise=noise2,
            **kw,
        )
        return y, {"experts_w13": st13, "experts_w2": st2, "channel_amax": amax}

    def _exchange(self, seq: int):
        """The (dispatch, collect) pair this call runs: expert-parallel on an "expert" mesh axis."""
        cfg = self.cfg
        ep = expert_parallel_size(self.recipe)
        if cfg.smooth_swiglu and ep > 1:
            raise ValueError(
                "smooth_swiglu runs the routed experts on one device; use a mesh with expert=1"
            )
        # A hook on the experts' down-projection inputs needs each row's
        # token position, which the dispatched rows do not carry: it runs locally.
        if ep > 1 and not taps.site_open("ffn_hidden"):
            return partial(
                run_expert_parallel,
                n_experts=cfg.n_routed_experts,
                up_recipe=self.dispatch_recipe,
                # BF16 on the wire (the compute dtype of every recipe but fp32's).
                wire_dtype=self.down_recipe.compute,
            )
        return partial(run_local, n_experts=cfg.n_routed_experts, seq=seq)

    def _record(self, stats: dict) -> None:
        """Sow the routed experts' telemetry (the same keys from either exchange)."""
        f = self.cfg.d_expert
        record_gemm(self, f"{self.name}/experts_w13", stats["experts_w13"], self.w13_noise)
        w13 = self._values(self.w13)
        monitors = swiglu_monitors_of_amax(stats["channel_amax"], w13[..., :f], w13[..., f:])
        record(self, f"{self.name}/experts", {"swiglu": monitors})
        record_gemm(self, f"{self.name}/experts_w2", stats["experts_w2"], self.w2_noise)

    def __call__(
        self, x_BxTxD: jax.Array, bias_E: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns (output (B, T, D) in cfg.dtype, {"load": (E,), "balance_loss": ()})."""
        cfg = self.cfg
        b, t, d = x_BxTxD.shape
        e, k = cfg.n_routed_experts, cfg.top_k
        x = x_BxTxD.reshape(b * t, d)
        scores = self.router(x)  # float32 (BT, E)
        idx, gates = route(scores, bias_E, k, n_groups=cfg.n_groups, topk_groups=cfg.topk_groups)
        gates = gates * cfg.routed_scaling
        noise = (value_of(self.w13_noise), value_of(self.w2_noise))
        # An FSDP-gathered expert weight may be a QTensor: the grouped GEMMs
        # take its codes as they are.
        out, stats = self._exchange(t)(
            self._expert_ffn, x, idx, gates, self.w13.get_value(), self.w2.get_value(), noise
        )
        self._record(stats)
        if self.shared is not None:
            # Shared experts' output joins the float32 combine.
            out = out + self.shared(x_BxTxD).reshape(b * t, d).astype(jnp.float32)
        aux = {"load": expert_load(idx, e)}
        # Tokens routed to each expert, logged per layer next to the FP8 telemetry.
        record(self, self.name, {"tokens": {"count": aux["load"].astype(jnp.float32)}})
        if cfg.seq_aux_loss_coef > 0:
            aux["balance_loss"] = seq_balance_loss(scores.reshape(b, t, e), idx.reshape(b, t, k))
        else:
            aux["balance_loss"] = jnp.zeros((), jnp.float32)
        # One rounding of the combined output to the activation dtype.
        return out.reshape(b, t, d).astype(cfg.dtype), aux
