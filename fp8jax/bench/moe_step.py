"""Benchmark of one MoE training step per recipe (needs fp8jax.models).

The step is the training engineer's jitted step (``fp8jax.train``: forward,
backward, microbatch merge, AdamW, FP8-state overwrite, router-bias update)
when that package is importable, else a minimal equivalent written here
(value_and_grad over (Param, FP8State), optax AdamW on Params, FP8State
replaced by its gradient).  Tokens are uniform random ids: the time of a step
does not depend on the data.

If ``fp8jax.models`` cannot be imported the sweep records why and skips.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import recipes as recipes_lib
from fp8jax.bench.hlo import kernel_path, summarize_hlo
from fp8jax.bench.timing import memory_stats, time_call


def _import_models():
    try:
        import fp8jax.models as models

        models.ModelConfig, models.MoETransformer, models.loss_fn  # noqa: B018
        return models, None
    except Exception as e:  # not written yet, or broken: skip with the reason
        return None, f"fp8jax.models not importable ({type(e).__name__}: {e})"


def _minimal_step(model, loss_fn):
    """(step_fn, state) without fp8jax.train: AdamW on Params, FP8State overwrite."""
    import optax
    from flax import nnx

    from fp8jax.nn import FP8State

    graphdef, params, fp8, rest = nnx.split(model, nnx.Param, FP8State, ...)
    tx = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    opt = tx.init(params)

    def loss_of(params, fp8, rest, tokens):
        return loss_fn(nnx.merge(graphdef, params, fp8, rest), tokens)

    def step(state, tokens):
        params, fp8, rest, opt = state
        (loss, _), (g_p, g_f) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(
            params, fp8, rest, tokens
        )
        updates, opt = tx.update(g_p, opt, params)
        params = jax.tree.map(jnp.add, params, updates)
        # Overwrite-with-gradient: the FP8 state's gradient is its new value.
        return (params, g_f, rest, opt), loss

    return step, (params, fp8, rest, opt), "minimal step (fp8jax.bench.moe_step)"


def _train_step(model, loss_fn):
    """(step_fn, state, name) from fp8jax.train, or the minimal step if it is missing."""
    try:
        from fp8jax.train.optimizer import make_optimizer
        from fp8jax.train.state import create_train_state
        from fp8jax.train.step import make_train_step
    except Exception as e:
        logging.info("fp8jax.train not importable (%s); using the minimal step", e)
        return _minimal_step(model, loss_fn)
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=1000, warmup_steps=10)
    graphdef, state = create_train_state(model, tx)
    # No donation: the same state is fed to every timed call.
    step = make_train_step(graphdef, tx, loss_fn, donate=False)
    return step, state, "fp8jax.train.step.make_train_step"


def run_moe_step_sweep(
    recipe_names: Sequence[str] | None = None,
    *,
    preset: str = "tiny",
    batch: int = 8,
    seq: int | None = None,
    warmup: int = 1,
    iters: int = 5,
    over_budget: Callable[[], bool] = lambda: False,
    log=print,
) -> tuple[list[dict[str, Any]], str]:
    """Time one training step of ModelConfig.<preset>() for every recipe.

    Returns (records, note); records are empty and the note says why when
    fp8jax.models is not importable.
    """
    models, why = _import_models()
    if models is None:
        return [], f"skipped: {why}"
    from flax import nnx

    make_cfg = getattr(models.ModelConfig, preset, None)
    if make_cfg is None:
        raise ValueError(f"unknown ModelConfig preset {preset!r}")
    mcfg = make_cfg()
    t = min(seq or mcfg.max_seq_len, mcfg.max_seq_len)
    if t < 2:
        raise ValueError(f"seq must be >= 2 (next-token loss), got {t}")
    names = list(recipe_names) if recipe_names else list(recipes_lib.PRESETS)
    # loss_fn predicts tokens[:, 1:] from tokens[:, :-1] inside one [B, T] row.
    tokens = jax.random.randint(jax.random.key(0), (batch, t), 0, mcfg.vocab_size, jnp.int32)
    backend = jax.default_backend()
    records: list[dict[str, Any]] = []
    step_impl = ""
    for name in names:
        rec: dict[str, Any] = {
            "kind": "moe_step",
            "shape": f"moe_{preset}_b{batch}_t{t}",
            "group": "moe_step",
            "variant": f"{name}/auto",
            "recipe": name,
            "impl": "auto",
            "pass": "train_step",
            "tokens": batch * (t - 1),  # predicted tokens per step
        }
        if over_budget():
            rec.update(status="skipped", error="time budget exhausted")
            records.append(rec)
            continue
        try:
            recipe = recipes_lib.get(name)
            model = models.MoETransformer(dataclasses.replace(mcfg), recipe, rngs=nnx.Rngs(0))
            step, state, step_impl = _train_step(model, models.loss_fn)
            t0 = time.perf_counter()
            compiled = jax.jit(step).lower(state, tokens).compile()
            rec["compile_s"] = time.perf_counter() - t0
            summary = summarize_hlo(compiled.as_text())
            rec["kernel_path"] = kernel_path(summary, backend)
            rec["fp8_gemm"] = summary["fp8_gemm"]
            rec["cublaslt_fp8"] = (
                "n/a" if backend != "gpu" else ("found" if summary["cublaslt_fp8"] else "not found")
            )
            rec["n_gemms"] = len(summary["gemms"])
            rec.update(memory_stats(compiled))
            rec.update(time_call(compiled, (state, tokens), warmup=warmup, iters=iters))
            rec["tokens_per_s"] = rec["tokens"] / rec["median_s"]
            rec["step_impl"] = step_impl
            rec["status"] = "ok"
            log(
                f"{rec['shape']:>22s} {rec['variant']:>34s} train_step "
                f"{rec['median_s'] * 1e3:10.2f} ms {rec['tokens_per_s']:10.0f} tok/s"
            )
        except Exception as e:
            logging.exception("MoE step %s failed", name)
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"{rec['shape']:>22s} {rec['variant']:>34s} train_step ERROR {rec['error']}")
        records.append(rec)
    base = next(
        (r["median_s"] for r in records if r["recipe"] == "bf16" and r["status"] == "ok"), None
    )
    for r in records:
        if base and r["status"] == "ok":
            r["time_ratio_to_bf16"] = r["median_s"] / base
            r["speedup_vs_bf16"] = base / r["median_s"]
    return records, f"ran ModelConfig.{preset}() batch {batch} seq {t} with {step_impl}"
