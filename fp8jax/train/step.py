"""The jitted training step and the evaluation step.

One step on a batch ``tokens [B, T]`` split into ``M`` microbatches:

1. ``lax.scan`` over microbatches: loss and gradients w.r.t. (params, fp8).
   Param gradients are *averaged* (equal microbatch sizes, so this is the
   gradient of the full-batch mean loss); FP8State "gradients" -- which
   ``fp8jax.dot_general`` defines as the *updated* delayed-scaling states --
   are merged with ``fp8jax.scaling.merge_delayed_states`` (elementwise max:
   every microbatch rolls the same history and writes its own amax; summing
   them would multiply the amax by M).  Expert loads are summed.
2. AdamW (clipping inside, on Param gradients only) updates the params.
3. The FP8 state is replaced by the merged gradient.  A state whose merged
   scale is 0 belongs to a GEMM that did not run this step (its cotangent is
   the zero default); it is kept as it was instead of being zeroed.
4. Router biases move by ``update_router_bias(bias, load, rate)``.

All of it is one ``jax.jit``-compiled function of (TrainState, tokens).  Its
metrics include ``finite``: whether the step's loss and global gradient norm
are finite (the training loop stops at the first step where it is not and
never checkpoints the state that follows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from fp8jax import scaling
from fp8jax.parallel.fsdp import kernel_layouts
from fp8jax.train import weight_codes
from fp8jax.train.state import TrainState

LossFn = Callable[[nnx.Module, jax.Array], tuple[jax.Array, dict]]


def fp8_telemetry(fp8_aux: Any) -> dict[str, jax.Array]:
    """Summarize per-GEMM telemetry: max amax, max/mean saturated and flushed fractions."""
    groups: dict[str, list[jax.Array]] = {"amax": [], "saturated": [], "flushed": []}
    for path, leaf in jax.tree_util.tree_leaves_with_path(fp8_aux):
        key = path[-1]
        name = getattr(key, "key", getattr(key, "name", None))
        if name in groups:
            # Telemetry in float32 whatever the activation dtype.
            groups[name].append(jnp.max(jnp.asarray(leaf, jnp.float32)))
    out: dict[str, jax.Array] = {}
    if groups["amax"]:
        out["fp8/amax_max"] = jnp.max(jnp.stack(groups["amax"]))
    for k in ("saturated", "flushed"):
        if groups[k]:
            v = jnp.stack(groups[k])
            out[f"fp8/{k}_max"] = jnp.max(v)
            out[f"fp8/{k}_mean"] = jnp.mean(v)
    return out


# Per-site statistics that combine over microbatches by max (the rest: mean,
# except token counts, which add up).
_MAX_STATS = ("amax", "outlier_ratio", "align_max")
_SUM_STATS = ("count",)


def site_telemetry(fp8_aux: Any) -> dict[str, jax.Array]:
    """Every sown statistic by site: ``layers/<site>/<stat>`` float32 scalars.

    ``fp8_aux``: {site: {stat: value [M, ...]}} stacked over M microbatches
    (sites like "layer1/moe/experts_w13/x", "layer0/ffn/swiglu",
    "layer1/moe/tokens").  Microbatches combine by max for amaxes, outlier
    ratios and alignment maxima, by sum for token counts, by mean otherwise
    (fractions of equal-size microbatches).  A vector statistic (the tokens
    per expert) gives one key per entry: ``layers/<site>/<stat>/<i>``.
    """
    out: dict[str, jax.Array] = {}
    for site, stats in (fp8_aux or {}).items():
        for stat, v in stats.items():
            # Telemetry in float32 whatever the activation dtype.
            v = jnp.asarray(v, jnp.float32)
            if stat in _MAX_STATS:
                v = jnp.max(v, axis=0)
            elif stat in _SUM_STATS:
                v = jnp.sum(v, axis=0)
            else:
                v = jnp.mean(v, axis=0)
            if v.ndim == 0:
                out[f"layers/{site}/{stat}"] = v
            else:
                for i, vi in enumerate(v.reshape(-1)):
                    out[f"layers/{site}/{stat}/{i}"] = vi
    return out


def _keep_unused(new_state, old_state):
    """Keep the old delayed state where the merged new one has scale 0 (GEMM not run)."""

    def pick(new, old):
        if isinstance(new, scaling.DelayedState):
            ran = new.scale > 0
            return scaling.DelayedState(
                jnp.where(ran, new.amax_history, old.amax_history),
                jnp.where(ran, new.scale, old.scale),
            )
        return new

    return jax.tree.map(
        pick, new_state, old_state, is_leaf=lambda x: isinstance(x, scaling.DelayedState)
    )


def update_bias_state(bias_state, expert_load: jax.Array, rate: float, update_fn) -> Any:
    """Apply ``update_fn(bias [L,E], load [L,E], rate)`` to the RouterBias state (one [L, E] leaf)."""
    leaves, treedef = jax.tree.flatten(bias_state)
    if not leaves:
        return bias_state
    if len(leaves) != 1 or leaves[0].shape != expert_load.shape:
        raise ValueError(
            f"router bias leaves {[x.shape for x in leaves]} do not match expert_load "
            f"{expert_load.shape}"
        )
    return jax.tree.unflatten(treedef, [update_fn(leaves[0], expert_load, rate)])


def make_train_step(
    graphdef,
    tx: optax.GradientTransformation,
    loss_fn: LossFn,
    *,
    microbatches: int = 1,
    bias_rate: float = 0.0,
    update_bias_fn: Callable | None = None,
    schedule: optax.Schedule | None = None,
    fp8_update: Callable[[Any, jax.Array], Any] | None = None,
    donate: bool = True,
    optimizer_for: Callable[[jax.Array], tuple[optax.GradientTransformation, Any]] | None = None,
    weights_once: bool = True,
):
    """A jitted ``step(state, tokens [B, T]) -> (state, metrics)``.

    ``weights_once``: with more than one microbatch, the GEMM weights that
    their recipes quantize in FP8 blocks are quantized once, before the
    microbatch loop, and every microbatch's GEMMs take those codes
    (:mod:`fp8jax.train.weight_codes`; the same bits, telemetry included).
    False: each microbatch's GEMMs quantize them again.

    ``optimizer_for``: a function of the run's length (an int32 scalar) that
    builds ``(tx, schedule)`` (``fp8jax.train.optimizer.make_optimizer`` with
    the other arguments bound).  The step is then ``step(state, tokens,
    total_steps)``: the length is an input, so runs of any length share one
    compiled program; ``tx`` (whose state has the same structure) is used
    only outside the step.

    ``fp8_update``: ``fp8_update(fp8, step) -> fp8``, applied to the new
    delayed-scaling state (``step``: the int32 step it was computed at) before
    it is stored; an experiment that perturbs the state passes it (e.g.
    :func:`fp8jax.train.injection.fp8_state_stress`).  None: stored as computed.
    """
    if microbatches < 1:
        raise ValueError("microbatches must be >= 1")

    def loss_of(params, fp8, bias, rest, tokens, codes):
        model = nnx.merge(graphdef, weight_codes.with_codes(params, codes), fp8, bias, rest)
        loss, aux = loss_fn(model, tokens)
        return loss, aux

    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)

    def step(state: TrainState, tokens: jax.Array, total_steps: jax.Array | None = None):
        opt, sched = tx, schedule
        if optimizer_for is not None:
            opt, sched = optimizer_for(total_steps)
        b = tokens.shape[0]
        if b % microbatches:
            raise ValueError(f"batch {b} not divisible by microbatches {microbatches}")
        toks_M = tokens.reshape(microbatches, b // microbatches, *tokens.shape[1:])
        # The weights' FP8 codes, made once for all microbatches (a loop
        # invariant the compilers leave inside the loop).
        codes = {}
        if weights_once and microbatches > 1:
            model = nnx.merge(graphdef, state.params, state.fp8, state.bias, state.rest)
            codes = weight_codes.quantize_weights(state.params, kernel_layouts(model))

        # A jit of its own: the scan below needs the shapes of its outputs
        # first (eval_shape), and a jitted function is traced once for both,
        # not twice (tracing an FP8 model's GEMMs, every platform's branch of
        # each, is most of what building the step costs).  Inlined when
        # lowered: the same program.
        @jax.jit
        def one(toks):
            (loss, aux), (g_params, g_fp8) = grad_fn(
                state.params, state.fp8, state.bias, state.rest, toks, codes
            )
            return loss, aux, g_params, g_fp8

        # Shapes of one microbatch's outputs, for the scan carry.
        loss0, aux0, gp0, gf0 = jax.eval_shape(one, toks_M[0])
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
        load0 = aux0.get("expert_load")

        def body(carry, toks):
            loss_sum, aux_sum, gp_sum, gf_max, load_sum = carry
            loss, aux, gp, gf = one(toks)
            aux_l = aux.get("aux_loss", jnp.zeros((), jnp.float32))
            gp_sum = jax.tree.map(jnp.add, gp_sum, gp)
            # Delayed-scaling states: merged with max (valid states are >= 0).
            gf_max = scaling.merge_delayed_states(gf_max, gf)
            if load_sum is not None:
                load_sum = load_sum + aux["expert_load"].astype(jnp.float32)
            return (loss_sum + loss, aux_sum + aux_l, gp_sum, gf_max, load_sum), aux.get("fp8", {})

        init = (
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
            zeros(gp0),
            zeros(gf0),
            None if load0 is None else jnp.zeros(load0.shape, jnp.float32),
        )
        (loss_sum, aux_sum, gp_sum, gf_max, load_sum), fp8_aux = lax.scan(body, init, toks_M)
        inv = 1.0 / microbatches
        # Mean over equal-size microbatches == gradient of the full-batch mean loss.
        g_params = jax.tree.map(lambda g: g * inv, gp_sum)
        updates, opt_state = opt.update(g_params, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        fp8 = _keep_unused(gf_max, state.fp8)
        if fp8_update is not None:
            fp8 = fp8_update(fp8, state.step)
        bias = state.bias
        if load_sum is not None and update_bias_fn is not None and bias_rate > 0:
            bias = update_bias_state(state.bias, load_sum, bias_rate, update_bias_fn)
        loss = loss_sum * inv
        grad_norm = optax.global_norm(g_params)
        metrics = {
            "loss": loss,
            "aux_loss": aux_sum * inv,
            "ce": loss - aux_sum * inv,
            "grad_norm": grad_norm,
            "param_norm": optax.global_norm(params),
            # Divergence flag, computed on device every step: the loop fetches
            # it only where it syncs anyway (logging, checkpoints, the end).
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
        }
        if sched is not None:
            metrics["lr"] = sched(state.step)
        if load_sum is not None:
            mean_load = jnp.mean(load_sum, axis=-1, keepdims=True)
            # max/mean expert load per layer, worst layer (1.0 = perfectly balanced).
            metrics["load_imbalance"] = jnp.max(
                jnp.max(load_sum, -1) / jnp.maximum(mean_load[..., 0], 1e-9)
            )
        if fp8_aux is not None:
            metrics.update(fp8_telemetry(fp8_aux))
            metrics.update(site_telemetry(fp8_aux))
        new_state = TrainState(state.step + 1, params, fp8, bias, state.rest, opt_state)
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_eval_step(graphdef, loss_fn: LossFn):
    """A jitted ``eval(state, tokens [N, B, T]) -> mean cross-entropy`` (aux loss excluded)."""

    def ce_of(state: TrainState, toks):
        model = nnx.merge(graphdef, state.params, state.fp8, state.bias, state.rest)
        loss, aux = loss_fn(model, toks)
        return loss - aux.get("aux_loss", jnp.zeros((), jnp.float32))

    def evaluate(state: TrainState, batches):
        losses = lax.map(lambda t: ce_of(state, t), batches)
        return jnp.mean(losses)

    return jax.jit(evaluate)
