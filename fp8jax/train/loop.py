"""``train(config, workdir)``: one training run, resumable from its workdir.

The config is an ``ml_collections.ConfigDict`` (see ``configs/tiny.py`` for
every field).  A run:

1. builds the corpus (:mod:`fp8jax.data`), the model
   (``fp8jax.models.MoETransformer`` from a ``ModelConfig`` preset plus
   overrides) and the recipe (:mod:`fp8jax.train.variants`);
2. restores the latest checkpoint in ``<workdir>/checkpoints`` if there is
   one (then continues from its step; batches depend only on the step);
3. runs the jitted step, logging train metrics every ``log_every`` steps and
   validation cross-entropy every ``eval_every`` steps and at the end;
4. checkpoints every ``checkpoint_every`` steps and at the end.

It returns a summary dict (final losses, throughput, FP8 telemetry).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8jax.data import corpus as data_lib
from fp8jax.parallel.mesh import maybe_initialize_distributed, put_batch
from fp8jax.parallel.training import in_mesh, setup_training
from fp8jax.train import checkpoint as ckpt_lib
from fp8jax.train import metrics as metrics_lib
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import TrainState, count_params, create_train_state
from fp8jax.train.step import make_eval_step, make_train_step
from fp8jax.train.variants import get_recipe


def model_config(config) -> Any:
    """ModelConfig preset named by ``config.model`` with ``config.model_overrides`` applied."""
    from fp8jax.models import ModelConfig

    preset = getattr(ModelConfig, str(config.model), None)
    if preset is None:
        raise ValueError(f"unknown model preset {config.model!r} (ModelConfig has no such method)")
    cfg = preset()
    overrides = dict(config.get("model_overrides", {}) or {})
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return cfg


def build_model(config, recipe) -> tuple[Any, nnx.Module]:
    from fp8jax.models import MoETransformer

    cfg = model_config(config)
    return cfg, MoETransformer(cfg, recipe, rngs=nnx.Rngs(int(config.seed)))


def load_data(config) -> data_lib.Corpus:
    d = config.data
    max_bytes = int(d.get("max_bytes", 0) or 0) or None
    return data_lib.load_corpus(
        str(d.source),
        path=str(d.get("path", "") or "") or None,
        val_fraction=float(d.val_fraction),
        max_bytes=max_bytes,
        seed=int(d.get("seed", 0)),
    )


def _loss_fn():
    from fp8jax.models import loss_fn

    return loss_fn


def git_state() -> dict | None:
    """Commit and dirty flag of the fp8jax source tree (None outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "fp8jax"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    # Runs record the code they ran: the shared tree changes while experiments run.
    return {"commit": commit, "fp8jax_dirty": bool(dirty)}


def _host(tree) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(tree).items()}


def summarize(rows: list[dict], final_window: int) -> dict:
    """Final losses and telemetry from metrics.jsonl rows."""
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    last = train_rows[-final_window:] if train_rows else []
    out: dict[str, Any] = {
        "steps": train_rows[-1]["step"] if train_rows else 0,
        # Mean of the last few steps' training loss: one step's loss is noisy.
        "final_train_loss": float(np.mean([r["loss"] for r in last])) if last else math.nan,
        "final_val_loss": val_rows[-1]["val_loss"] if val_rows else math.nan,
    }
    tps = [r["tokens_per_s"] for r in train_rows if "tokens_per_s" in r]
    out["tokens_per_s"] = tps[-1] if tps else math.nan
    tel = {}
    for key, red in (
        ("fp8/amax_max", max),
        ("fp8/saturated_max", max),
        ("fp8/saturated_mean", np.mean),
        ("fp8/flushed_max", max),
        ("fp8/flushed_mean", np.mean),
    ):
        vals = [r[key] for r in train_rows if key in r]
        if vals:
            tel[key.split("/", 1)[1]] = float(red(vals))
    first = [r for r in train_rows if r["step"] == 1]
    if first and "fp8/saturated_max" in first[0]:
        tel["saturated_max_step1"] = first[0]["fp8/saturated_max"]
    out["fp8_telemetry"] = tel
    out["train_curve"] = [(r["step"], r["loss"]) for r in train_rows]
    out["val_curve"] = [(r["step"], r["val_loss"]) for r in val_rows]
    return out


# Jitted step/eval functions of this process, keyed by everything they close
# over: a resumed run or another seed of the same config reuses the compiled
# code instead of recompiling (the init seed and batch order are inputs).
_COMPILED: dict[str, tuple] = {}
_MAX_COMPILED = 8
_NOT_IN_STEP = (
    "seed",
    "data_seed",
    "data",
    "eval_every",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "final_window",
)


def _compile_key(config, recipe, mcfg) -> str:
    cfg = {k: v for k, v in metrics_lib.to_jsonable(config).items() if k not in _NOT_IN_STEP}
    blob = {"config": cfg, "recipe": repr(recipe), "model": repr(mcfg)}
    return json.dumps(blob, sort_keys=True, default=str)


def train(config, workdir: str | Path, *, stop_at: int | None = None, stream=None) -> dict:
    """Train (or resume) the run described by ``config`` in ``workdir``.

    ``stop_at``: stop after this step (checkpointing it), as if interrupted;
    the learning-rate schedule still spans ``config.steps``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # Several processes: before anything touches a device.
    maybe_initialize_distributed(config.mesh)
    recipe = get_recipe(str(config.recipe))
    corpus = load_data(config)
    mcfg, model = build_model(config, recipe)
    seq_len = int(config.seq_len) if int(config.get("seq_len", 0) or 0) > 0 else mcfg.max_seq_len
    if seq_len > mcfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
    total = int(config.steps)
    tx, schedule = make_optimizer(
        peak_lr=float(config.lr),
        total_steps=total,
        warmup_steps=int(config.warmup_steps),
        min_lr_ratio=float(config.min_lr_ratio),
        b1=float(config.b1),
        b2=float(config.b2),
        eps=float(config.eps),
        weight_decay=float(config.weight_decay),
        clip_norm=float(config.clip_norm),
        moment_dtype=str(config.moment_dtype),
    )
    graphdef, state = create_train_state(model, tx)
    mesh, state, loss_fn = setup_training(
        config.mesh,
        state,
        model,
        recipe,
        mcfg.n_routed_experts,
        _loss_fn(),
        (int(config.batch_size), int(config.eval_batch_size)),
    )
    del model
    fresh_fp8 = jax.tree.map(jnp.copy, state.fp8)
    from fp8jax.models import update_router_bias

    key = _compile_key(config, recipe, mcfg)
    if key not in _COMPILED:
        step_fn = make_train_step(
            graphdef,
            tx,
            loss_fn,
            microbatches=int(config.microbatches),
            bias_rate=float(getattr(mcfg, "bias_update_rate", 0.0)),
            update_bias_fn=update_router_bias,
            schedule=schedule,
            fp8_fresh=fresh_fp8,
            fp8_reset_every=int(config.get("fp8_reset_every", 0)),
            fp8_amax_growth=float(config.get("fp8_amax_growth", 1.0)),
        )
        if len(_COMPILED) >= _MAX_COMPILED:
            _COMPILED.pop(next(iter(_COMPILED)))
        eval_fn = make_eval_step(graphdef, loss_fn)
        _COMPILED[key] = (in_mesh(mesh, step_fn), in_mesh(mesh, eval_fn))
    step_fn, eval_fn = _COMPILED[key]
    val = put_batch(
        data_lib.val_batches(
            corpus, int(config.eval_batches), int(config.eval_batch_size), seq_len
        ),
        mesh,
        batch_axis=1,
    )

    ckpt = ckpt_lib.Checkpointer(
        workdir, every=int(config.checkpoint_every), keep=int(config.keep_checkpoints)
    )
    start = 0
    if ckpt.latest_step() is not None:
        state = ckpt.restore(state)
        start = int(jax.device_get(state.step))
    else:
        metrics_lib.write_config(
            workdir,
            config,
            {
                "corpus": corpus.summary(),
                "recipe": dataclasses.asdict(recipe),
                "model_config": dataclasses.asdict(mcfg),
                "n_params": count_params(state.params),
                "seq_len": seq_len,
                "jax_version": jax.__version__,
                "backend": jax.default_backend(),
                "git": git_state(),
            },
        )
    batch_size = int(config.batch_size)
    data_seed = int(config.data_seed) if int(config.get("data_seed", -1)) >= 0 else int(config.seed)
    writer = metrics_lib.MetricsWriter(
        workdir,
        total_steps=total,
        # Predicted tokens per step (each row of seq_len tokens gives seq_len - 1).
        tokens_per_step=batch_size * (seq_len - 1),
        start_step=start,
        tensorboard=bool(config.get("tensorboard", True)),
        print_every=int(config.log_every),
        stream=stream,
    )
    end = total if stop_at is None else min(int(stop_at), total)
    log_every = max(int(config.log_every), 1)
    eval_every = int(config.eval_every)
    t_start = time.perf_counter()
    try:
        for step in range(start, end):
            tokens = put_batch(
                data_lib.train_batch(corpus, step, batch_size, seq_len, data_seed), mesh
            )
            state, m = step_fn(state, tokens)
            done = step + 1
            if step == start:
                # Exclude compilation from the throughput clock.
                jax.block_until_ready(state.step)
                writer.reset_clock(done)
            # Step 1 always: it shows what a fresh delayed-scaling state does.
            if done % log_every == 0 or done == total or done == 1:
                row = _host(m)
                if not math.isfinite(row["loss"]):
                    writer.write(done, row)
                    raise FloatingPointError(f"non-finite loss {row['loss']} at step {done}")
                writer.write(done, row)
            if (eval_every > 0 and done % eval_every == 0) or done == total:
                t_eval = time.perf_counter()
                val_loss = float(eval_fn(state, val))
                # Evaluation time (and its compilation) is not training throughput.
                writer.exclude_time(time.perf_counter() - t_eval)
                writer.write(done, {"val_loss": val_loss})
            ckpt.save(state, force=(done == end))
    finally:
        writer.close()
        ckpt.close()
    rows = metrics_lib.read_jsonl(workdir / "metrics.jsonl")
    summary = summarize(rows, max(1, int(config.get("final_window", 10))))
    summary["wall_s"] = time.perf_counter() - t_start
    summary["recipe"] = recipe.name
    summary["seed"] = int(config.seed)
    return summary


def final_state(config, workdir: str | Path) -> tuple[Any, TrainState]:
    """(graphdef, TrainState) restored from the latest checkpoint of a run."""
    recipe = get_recipe(str(config.recipe))
    _, model = build_model(config, recipe)
    tx, _ = make_optimizer(
        peak_lr=float(config.lr),
        total_steps=int(config.steps),
        warmup_steps=int(config.warmup_steps),
        moment_dtype=str(config.moment_dtype),
        clip_norm=float(config.clip_norm),
    )
    graphdef, state = create_train_state(model, tx)
    ckpt = ckpt_lib.Checkpointer(workdir)
    try:
        return graphdef, ckpt.restore(state)
    finally:
        ckpt.close()
