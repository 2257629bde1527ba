"""``train(config, workdir)``: one training run, resumable from its workdir.

The config is an ``ml_collections.ConfigDict`` (every field, with its meaning:
``fp8jax/train/defaults.py``).  A run:

1. checks the config, the workdir and (once loaded) the corpus before it
   creates anything: a mistake raises :class:`~fp8jax.train.defaults.ConfigError`
   with one line naming the fix, and no workdir is made;
2. refuses a workdir whose ``config.json`` holds another config (only the
   ``RESUMABLE_FIELDS`` of :mod:`fp8jax.train.defaults` may change; ``steps``
   may only grow), so a workdir never mixes two runs;
3. reports "already complete: <summary>" when the run's records show all the
   steps done (:func:`completed_run`: its config, a usable newest checkpoint of
   ``steps``, its metrics), before building model, data or step; otherwise
   restores the latest readable, finite checkpoint in ``<workdir>/checkpoints``
   if there is one ("resuming from step N"; batches depend only on the step);
4. runs the jitted step, logging train metrics every ``log_every`` steps and
   validation cross-entropy every ``eval_every`` steps and at the end, one
   progress line per logged step;
5. checkpoints every ``checkpoint_every`` steps, at the end, and when SIGINT or
   SIGTERM arrives (then raises :class:`TrainingInterrupted`).

Divergence: each step computes, on device, whether its loss and global
gradient norm are finite.  The loop reads those flags only where it syncs with
the device anyway (logged steps, evaluations, checkpoints, the end), so finding
the first non-finite step costs no extra sync; it then writes that step's
metrics row (NaN/Inf as null), never checkpoints the state, and raises
:class:`TrainingDiverged` naming the step.  The checkpoints already kept are
all finite.

It returns a summary dict (losses, throughput, FP8 telemetry, curves).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from fp8jax.data import corpus as data_lib
from fp8jax.data.batches import describe_val_set
from fp8jax.data.loader import train_batches
from fp8jax.data.shards import DataError
from fp8jax.models import ModelConfig, MoETransformer, loss_fn, update_router_bias
from fp8jax.parallel.mesh import (
    maybe_initialize_distributed,
    process_rows,
    put_batch,
    put_process_rows,
)
from fp8jax.parallel.training import in_mesh, setup_training
from fp8jax.recipes import Recipe
from fp8jax.train import checkpoint as ckpt_lib
from fp8jax.train import injection, preflight, provenance, run_log
from fp8jax.train.compiled import StepCache, step_key
from fp8jax.train.defaults import (
    RESUMABLE_FIELDS,
    ConfigError,
    check_workdir,
    is_resumable,
    model_config,
    seq_len,
    validate,
)
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import TrainState, count_params, create_train_state
from fp8jax.train.step import make_eval_step, make_train_step
from fp8jax.train.workdir import removed_unless_checkpointed


class TrainingDiverged(FloatingPointError):
    """The loss or gradient norm of a step was NaN or Inf; ``step`` is the first such step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM arrived; a checkpoint of ``step`` was saved in ``workdir``."""

    def __init__(self, message: str, step: int, signum: int):
        super().__init__(message)
        self.step = step
        self.signum = signum


def load_data(config: ml_collections.ConfigDict, n: int) -> data_lib.Corpus | data_lib.TokenFiles:
    """The corpus of ``config.data``, checked to hold batches of ``n``-token rows.

    Raises ConfigError (one line) for a missing, bad or too small corpus.
    """
    d = config.data
    try:
        corpus = data_lib.load_corpus(
            str(d.source),
            path=str(d.path) or None,
            val_fraction=float(d.val_fraction),
            max_bytes=int(d.max_bytes) or None,
            seed=int(d.seed),
        )
        data_lib.check_corpus(corpus, n, int(config.batch_size))
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return corpus


# The summary's final train-loss key; the window it covers is the "final_window" field.
TRAIN_LOSS_KEY = "train_loss_final_window_mean"


def summarize(rows: list[dict], final_window: int) -> dict:
    """Final losses and telemetry from metrics.jsonl rows (null values read as NaN).

    The keys are the same for every config.  ``train_loss_final_window_mean``:
    mean training loss of the last ``final_window`` logged steps (one step's
    loss is noisy); the summary's ``final_window`` field is the number of
    logged steps that mean covers (fewer than asked when fewer were logged);
    ``final_val_loss``: the validation loss after the last step;
    ``tokens_per_s``: mean throughput from the first step after compilation
    to the last logged one, evaluations excluded.
    """
    f = run_log.as_float
    train_rows = [r for r in rows if "loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    last = train_rows[-final_window:]
    out: dict[str, Any] = {
        "steps": train_rows[-1]["step"] if train_rows else 0,
        TRAIN_LOSS_KEY: float(np.mean([f(r["loss"]) for r in last])) if last else math.nan,
        "final_window": len(last),
        "final_val_loss": f(val_rows[-1]["val_loss"]) if val_rows else math.nan,
    }
    tps = [f(r["tokens_per_s"]) for r in train_rows if "tokens_per_s" in r]
    out["tokens_per_s"] = tps[-1] if tps else math.nan
    tel = {}
    for key, red in (
        ("fp8/amax_max", np.max),
        ("fp8/saturated_max", np.max),
        ("fp8/saturated_mean", np.mean),
        ("fp8/flushed_max", np.max),
        ("fp8/flushed_mean", np.mean),
    ):
        vals = [f(r[key]) for r in train_rows if key in r]
        if vals:
            tel[key.split("/", 1)[1]] = float(red(vals))
    first = [r for r in train_rows if r["step"] == 1]
    if first and "fp8/saturated_max" in first[0]:
        tel["saturated_max_step1"] = f(first[0]["fp8/saturated_max"])
    out["fp8_telemetry"] = tel
    out["train_curve"] = [(r["step"], f(r["loss"])) for r in train_rows]
    out["val_curve"] = [(r["step"], f(r["val_loss"])) for r in val_rows]
    return out


def train_loss_key(summary: dict) -> str:
    """The final-window train-loss key of ``summary``.

    ``TRAIN_LOSS_KEY`` for summaries of this version; a summary saved by an
    older version names the window in the key (``train_loss_last{n}_mean``).
    """
    if TRAIN_LOSS_KEY in summary:
        return TRAIN_LOSS_KEY
    return next(k for k in summary if k.startswith("train_loss_last") and k.endswith("_mean"))


def summary_line(summary: dict) -> str:
    """The summary's headline fields as one JSON object (NaN as null)."""
    keys = ("recipe", "steps", train_loss_key(summary), "final_window", "final_val_loss")
    keys += ("tokens_per_s",)
    head = {k: summary[k] for k in keys if k in summary}
    if "wall_s" in summary:
        head["wall_s"] = summary["wall_s"]
    return json.dumps(run_log.to_jsonable(head))


# --- resume checks -----------------------------------------------------------


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "model_overrides":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted field -> (old, new) for every field that differs between two config dicts."""
    a, b = _flat(old), _flat(new)
    missing = object()
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    }


def check_resumable(workdir: Path, config: ml_collections.ConfigDict) -> dict[str, tuple]:
    """Refuse (ConfigError) a workdir whose config.json holds another run's config.

    Returns the resumable fields that change (empty for a fresh workdir).
    """
    path = workdir / "config.json"
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path} is unreadable ({type(e).__name__}); use a new --workdir"
        ) from None
    new = json.loads(json.dumps(run_log.to_jsonable(config)))
    changes = config_changes(old, new)
    fixed = {k: v for k, v in changes.items() if not is_resumable(k)}
    if fixed:
        shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(fixed.items())[:4])
        more = f" (+{len(fixed) - 4} more)" if len(fixed) > 4 else ""
        raise ConfigError(
            f"workdir {str(workdir)!r} holds a run with another config ({shown}{more}); "
            f"use a new --workdir, or change only {', '.join(RESUMABLE_FIELDS)}"
        )
    if "steps" in changes and changes["steps"][1] < changes["steps"][0]:
        raise ConfigError(
            f"workdir {str(workdir)!r} holds a run of {changes['steps'][0]} steps; steps may only "
            f"grow on resume (got {changes['steps'][1]}): use a new --workdir"
        )
    return changes


def check_data_fingerprint(workdir: Path, corpus) -> None:
    """Refuse (ConfigError) a workdir whose run was trained on other data than ``corpus``.

    The run's data is recorded in config.json (``corpus.sha256``).  A workdir
    that holds checkpoints but no such record is refused too: its data cannot
    be checked, and resuming might train on other data without a word.
    """
    path = workdir / "config.json"
    if not path.exists():
        return
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # an unreadable config.json is refused by check_resumable
    # "corpus" of the wrong type (null, a string, a list) is no record either.
    held = record.get("corpus") if isinstance(record, dict) else None
    old = held.get("sha256") if isinstance(held, dict) else None
    if not isinstance(old, str):
        if not ckpt_lib.Checkpointer.steps_in(workdir):
            return  # nothing trained yet: the record is written at the start
        found = json.dumps(held)[:40] if "corpus" in record else "missing"
        raise ConfigError(
            f"{path} holds no record of the data the run was trained on (its corpus.sha256; "
            f"corpus is {found}), so resuming cannot check it: restore that config.json, or "
            "use a new --workdir"
        )
    if old != corpus.sha256:
        raise ConfigError(
            f"workdir {str(workdir)!r} holds a run trained on other data (corpus "
            f"{corpus.name!r} now has fingerprint {corpus.sha256[:12]}, the run's was "
            f"{old[:12]}); restore the data or use a new --workdir"
        )


def with_data_vocab(
    mcfg: ModelConfig, config: ml_collections.ConfigDict, vocab: int
) -> ModelConfig:
    """``mcfg`` with the data's vocabulary, or the override's if it is at least as large."""
    override = config.model_overrides.get("vocab_size")
    if override is None:
        return dataclasses.replace(mcfg, vocab_size=vocab)
    if int(override) < vocab:
        raise ConfigError(
            f"model_overrides.vocab_size {override} is smaller than the data's vocabulary "
            f"{vocab}; drop the override (the data sets it) or raise it"
        )
    return mcfg


# --- setup -------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """Everything a run needs before its first step (nothing on disk yet)."""

    config: ml_collections.ConfigDict
    workdir: Path
    recipe: Recipe
    mcfg: ModelConfig
    corpus: data_lib.Corpus | data_lib.TokenFiles
    seq_len: int
    graphdef: Any
    mesh: Any
    state: TrainState
    step_fn: Callable
    eval_fn: Callable
    val: jax.Array | None
    changes: dict[str, tuple]
    gemm_paths: dict[str, str]
    # What the run resolved (mesh sizes, device and process counts), and the
    # compiled functions it shares with later runs of the same process.
    placement: dict
    steps: StepCache
    key: str
    val_set: dict | None = None


def setup(
    config: ml_collections.ConfigDict, workdir: str | Path, *, steps: StepCache | None = None
) -> Run:
    """Check everything, then build corpus, model, state and jitted functions.

    Writes nothing: every user mistake (config, workdir, data, a mesh or batch
    that does not fit the machine) raises ConfigError before anything exists
    on disk.  ``steps``: jitted functions to reuse (default: a new cache).
    """
    recipe = validate(config)
    workdir = check_workdir(workdir)
    changes = check_resumable(workdir, config)
    # Several processes: before anything touches a device.
    maybe_initialize_distributed(config.mesh)
    mcfg = model_config(config)
    n = seq_len(config, mcfg)
    sizes = preflight.resolve_mesh(config)
    preflight.check_batches(config, sizes)
    preflight.check_memory(config, mcfg, n, math.prod(sizes.values()))
    corpus = load_data(config, n)
    check_data_fingerprint(workdir, corpus)
    # The data decides the vocabulary: embedding and output head match its ids.
    mcfg = with_data_vocab(mcfg, config, corpus.vocab_size)
    model = MoETransformer(mcfg, recipe, rngs=nnx.Rngs(int(config.seed)))
    optimizer_for = functools.partial(
        make_optimizer,
        peak_lr=float(config.lr),
        warmup_steps=int(config.warmup_steps),
        min_lr_ratio=float(config.min_lr_ratio),
        b1=float(config.b1),
        b2=float(config.b2),
        eps=float(config.eps),
        weight_decay=float(config.weight_decay),
        clip_norm=float(config.clip_norm),
        moment_dtype=str(config.moment_dtype),
    )
    tx, _ = optimizer_for(total_steps=int(config.steps))
    graphdef, state = create_train_state(model, tx)
    # The state placed on the mesh; the loss gathers FSDP-split parameters.
    mesh, state, mesh_loss_fn = setup_training(
        config.mesh,
        state,
        model,
        recipe,
        mcfg.n_routed_experts,
        # An experiment's injected activations (none without an inject block).
        injection.with_injection(loss_fn, config.get("inject")),
        (int(config.batch_size), int(config.eval_batch_size)),
    )
    del model
    steps = StepCache() if steps is None else steps

    def build() -> tuple[Callable, Callable, dict[str, str]]:
        step_fn = make_train_step(
            graphdef,
            tx,
            mesh_loss_fn,
            microbatches=int(config.microbatches),
            # An FSDP mesh gathers its weights inside the loss, as shards, and in
            # FP8 there already (fp8jax.parallel.fsdp): no codes to share.
            weights_once=bool(config.get("weights_once", True)) and mesh.shape["fsdp"] == 1,
            bias_rate=float(mcfg.bias_update_rate),
            update_bias_fn=update_router_bias,
            fp8_update=injection.fp8_state_stress(
                jax.tree.map(jnp.copy, state.fp8), config.get("inject")
            ),
            # The run's length is an input of the step: no recompiling when it changes.
            optimizer_for=lambda total: optimizer_for(total_steps=total),
        )
        eval_fn = make_eval_step(graphdef, mesh_loss_fn)
        # The GEMM paths are recorded while the step is first traced (abstractly).
        tokens = jax.ShapeDtypeStruct((int(config.batch_size), n), jnp.int32)
        total = jax.ShapeDtypeStruct((), jnp.int32)
        with jax.set_mesh(mesh):
            paths = provenance.gemm_paths(step_fn, state, tokens, total)
        return in_mesh(mesh, step_fn), in_mesh(mesh, eval_fn), paths

    key = step_key(config, recipe, mcfg)
    step_fn, eval_fn, paths = steps.get(key, build)
    val, val_set = None, None
    if int(config.eval_batches) > 0:
        batches = data_lib.val_batches(
            corpus, int(config.eval_batches), int(config.eval_batch_size), n
        )
        val = put_batch(batches, mesh, batch_axis=1)
        val_set = describe_val_set(corpus, batches)
    return Run(
        config,
        workdir,
        recipe,
        mcfg,
        corpus,
        n,
        graphdef,
        mesh,
        state,
        step_fn,
        eval_fn,
        val,
        changes,
        paths,
        preflight.mesh_facts(sizes),
        steps,
        key,
        val_set,
    )


def _run_facts(run: Run) -> dict:
    return {
        "corpus": run.corpus.summary(),
        "validation_set": run.val_set,
        "recipe": dataclasses.asdict(run.recipe),
        "model_config": dataclasses.asdict(run.mcfg),
        "n_params": count_params(run.state.params),
        "seq_len": run.seq_len,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "provenance": {**provenance.record(), "gemm_paths": run.gemm_paths},
        **run.placement,
    }


def _placement_changed(run: Run) -> bool:
    """Whether config.json records another mesh, device or process count than this run's."""
    try:
        recorded = json.loads((run.workdir / "config.json").read_text())
    except (OSError, ValueError):
        return True
    return any(recorded.get(k) != v for k, v in run_log.to_jsonable(run.placement).items())


# --- the loop ----------------------------------------------------------------


@contextmanager
def _stop_signals() -> Iterator[list[int]]:
    """Record SIGINT / SIGTERM in the yielded list instead of raising mid-step.

    Only the main thread may install handlers; elsewhere the list stays empty
    and signals keep their usual effect.
    """
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Divergence:
    """Per-step finiteness flags, left on device until the loop syncs anyway."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, dict]] = []

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def first_bad(self) -> tuple[int, dict] | None:
        """(step, host metrics) of the first non-finite pending step, else None; clears."""
        flags = jax.device_get([m["finite"] for _, m in self.pending])
        bad = next((i for i, ok in enumerate(flags) if not ok), None)
        found = None
        if bad is not None:
            step, m = self.pending[bad]
            found = (step, _host(m))
        self.pending = []
        return found


def _host(tree) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(tree).items() if k != "finite"}


def _diverged(
    run: Run, step: int, row: dict, ckpt: ckpt_lib.Checkpointer, writer, *, logged: bool = False
) -> TrainingDiverged:
    if not logged:
        writer.write(step, row)
    kept = ckpt.all_steps()
    where = (
        f"the workdir keeps the finite checkpoints of steps {', '.join(map(str, kept))}"
        if kept
        else "no checkpoint was saved"
    )
    return TrainingDiverged(
        f"training diverged at step {step}: loss {row['loss']}, gradient norm "
        f"{row['grad_norm']} (first non-finite step; {where}); lower --config.lr or raise "
        "--config.warmup_steps and use a new --workdir",
        step,
    )


def run_loop(
    run: Run,
    ckpt: ckpt_lib.Checkpointer,
    writer: run_log.MetricsWriter,
    start: int,
    end: int,
    say: Callable[[str], None] = lambda line: None,
) -> TrainState:
    """Steps ``start+1 .. end``: log, evaluate, checkpoint; stop on divergence or a signal.

    ``say`` gets the status lines: "compiling the training step ..." and the
    time it took (the first step's run included) when this process has not
    run the step yet.
    """
    c = run.config
    total = int(c.steps)
    # An input of the step (int32), not a constant compiled into it.
    total_steps = np.int32(total)
    compiling = run.steps.first_use(run.key)
    batch_size = int(c.batch_size)
    data_seed = int(c.data_seed) if int(c.data_seed) >= 0 else int(c.seed)
    log_every = int(c.log_every)
    eval_every = int(c.eval_every)
    state = run.state
    watch = _Divergence()
    shape = (batch_size, run.seq_len)
    # This process reads only the rows its devices hold.
    rows = process_rows(shape, run.mesh)
    batches = train_batches(run.corpus, start, end, batch_size, run.seq_len, data_seed, rows)
    data_wait = 0.0
    with _stop_signals() as caught:
        for step in range(start, end):
            t_data = time.perf_counter()
            try:
                local = next(batches)
            except DataError as e:
                kept = ckpt.all_steps()
                where = f"checkpoint of step {kept[-1]} kept" if kept else "no checkpoint saved"
                raise ConfigError(f"step {step + 1}: {e} ({where})") from None
            data_wait += time.perf_counter() - t_data
            tokens = put_process_rows(local, shape, run.mesh)
            if step == start and compiling:
                say("compiling the training step ...")
                t_compile = time.perf_counter()
            state, m = run.step_fn(state, tokens, total_steps)
            done = step + 1
            watch.add(done, m)
            if step == start:
                # Exclude compilation from the throughput clock.
                jax.block_until_ready(state.step)
                writer.reset_clock(done)
                if compiling:
                    took = time.perf_counter() - t_compile
                    say(f"compiled the training step in {took:.1f} s (with step {done})")
            # Step 1 always: it shows what a fresh delayed-scaling state does.
            log = done % log_every == 0 or done == total or done == 1
            evaluate = run.val is not None and (
                (eval_every > 0 and done % eval_every == 0) or done == total
            )
            if not (log or evaluate or ckpt.due(done) or done == end or caught):
                continue
            bad = watch.first_bad()
            if bad is not None:
                raise _diverged(run, bad[0], bad[1], ckpt, writer)
            if log:
                # Seconds the step loop waited for input since the last logged step.
                row = writer.write(done, {**_host(m), "data_wait_s": data_wait})
                data_wait = 0.0
            if evaluate:
                t_eval = time.perf_counter()
                val_loss = float(run.eval_fn(state, run.val))
                # Evaluation time (and its compilation) is not training throughput.
                writer.exclude_time(time.perf_counter() - t_eval)
                writer.write(done, {"val_loss": val_loss})
            if log:
                writer.progress(done, row["loss"])
            # Decided after the syncs above: a signal that arrived while the
            # host waited for the device is seen here, not one step late.
            if ckpt.due(done) or done == end or caught:
                if not ckpt_lib.all_finite(state):
                    raise _diverged(run, done, _host(m), ckpt, writer, logged=log)
                ckpt.save(state, force=True)
            if caught:
                name = signal.Signals(caught[0]).name
                raise TrainingInterrupted(
                    f"{name} at step {done}/{total}: checkpoint saved in {run.workdir}",
                    done,
                    caught[0],
                )
    return state


def train(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    stop_at: int | None = None,
    stream=None,
    steps: StepCache | None = None,
) -> dict:
    """Train (or resume) the run described by ``config`` in ``workdir``.

    ``stop_at``: stop after this step (checkpointing it), as if interrupted;
    the learning-rate schedule still spans ``config.steps``.  Status lines
    ("mesh ...", "compiling ...", "resuming from step N", "already complete:
    <summary>", warnings) and progress lines go to ``stream`` (default
    stdout), from JAX process 0 only.  The summary's ``already_complete`` is
    True when the workdir already held every step; its ``wall_s`` counts the
    seconds from this call to the end (start-up, compilation and steps).  ``steps``: compiled
    functions shared with other runs of this process (a comparison passes one).

    A run that fails before its first checkpoint removes what it created in
    the workdir (a divergence keeps its log).  Running out of memory raises
    ConfigError; a workdir that cannot be written (read-only, full disk)
    raises :class:`~fp8jax.train.checkpoint.CheckpointError`, one line each,
    keeping every checkpoint.
    """

    t_start = time.perf_counter()

    def say(line: str) -> None:
        if jax.process_index() == 0:
            print(line, file=stream, flush=True)

    try:
        done = completed_run(config, workdir)
    except run_log.DamagedLog as e:
        raise ConfigError(f"{e} (checkpoints are untouched)") from None
    if done is not None:
        say(f"already complete: {summary_line(done)}")
        return done
    run = setup(config, workdir, steps=steps)
    try:
        with removed_unless_checkpointed(
            run.workdir, keep_on=(TrainingDiverged, ckpt_lib.RunInUse)
        ):
            with ckpt_lib.run_lock(run.workdir, jax.process_index()):
                return _train_locked(run, config, say, stop_at, stream, t_start)
    except run_log.DamagedLog as e:
        raise ConfigError(f"{e} (checkpoints are untouched)") from None
    except MemoryError:
        raise ConfigError(out_of_memory(config)) from None
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ConfigError(out_of_memory(config)) from None
    except OSError as e:
        raise ckpt_lib.CheckpointError(unwritable(run.workdir, e)) from None


def completed_run(config: ml_collections.ConfigDict, workdir: str | Path) -> dict | None:
    """The summary of the run in ``workdir`` if its records show it complete, else None.

    Read from the run's records alone (config.json, the checkpoint folders,
    metrics.jsonl), before any model, data or compiled step is built: the
    config must be the run's (:func:`check_resumable` refuses another), and
    its newest checkpoint must hold ``config.steps`` or more and be usable
    (read as saved, finite).  Anything else (no run, fewer steps, a damaged
    newest checkpoint) is None: training decides, falling back as it does.
    """
    recipe = validate(config)
    path = check_workdir(workdir)
    if not (path / "config.json").exists():
        return None
    check_resumable(path, config)
    kept = ckpt_lib.Checkpointer.steps_in(path)
    if not kept or kept[-1] < int(config.steps):
        return None
    # Several processes: before anything touches a device.
    maybe_initialize_distributed(config.mesh)
    ckpt = ckpt_lib.Checkpointer(path)
    try:
        if not ckpt.holds_usable(kept[-1]):
            return None
    finally:
        ckpt.close()
    summary = summarize(run_log.read_jsonl(path / "metrics.jsonl"), int(config.final_window))
    summary.update(
        recipe=recipe.name,
        seed=int(config.seed),
        already_complete=True,
    )
    return summary


def out_of_memory(config: ml_collections.ConfigDict) -> str:
    """The one-line message for a run that ran out of memory, with the fix."""
    return (
        f"out of memory with batch_size {config.batch_size} (microbatches "
        f"{config.microbatches}, eval_batch_size {config.eval_batch_size}): lower "
        "--config.batch_size or --config.eval_batch_size, or raise --config.microbatches"
    )


def unwritable(workdir: Path, e: OSError) -> str:
    """The one-line message for a workdir that could not be written (read-only, disk full)."""
    what = e.strerror or type(e).__name__
    where = f" ({e.filename})" if e.filename else ""
    if isinstance(e, ckpt_lib.DiskFull):
        free = "" if e.free is None else f", {_mb(e.free)} free"
        where += f": the checkpoint needs about {_mb(e.needed)}{free}"
    kept = ckpt_lib.Checkpointer.steps_in(workdir)
    saved = (
        f"checkpoints of steps {', '.join(map(str, kept))} are kept" if kept else "no checkpoint"
    )
    return (
        f"cannot write to workdir {str(workdir)!r}: {what}{where}; {saved}: free space or make "
        "the workdir writable, then run the same command again to resume"
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _train_locked(run, config, say, stop_at, stream, t_start: float) -> dict:
    """The body of :func:`train`, run while holding the run directory's lock.

    ``t_start``: when :func:`train` was called (``time.perf_counter``); the
    summary's ``wall_s`` counts from there, so it includes the start-up
    (data, model, tracing, restore) and the compilation, not only the steps.
    """
    total = int(config.steps)
    final_window = int(config.final_window)
    ckpt = ckpt_lib.Checkpointer(
        run.workdir, every=int(config.checkpoint_every), keep=int(config.keep_checkpoints)
    )
    try:
        restored = ckpt.restore_latest(run.state, say)
        start = 0 if restored is None else int(jax.device_get(restored.step))
        if restored is not None:
            run.state = restored
        if start >= total:
            rows = run_log.read_jsonl(run.workdir / "metrics.jsonl")
            summary = summarize(rows, final_window)
            summary.update(recipe=run.recipe.name, seed=int(config.seed), already_complete=True)
            say(f"already complete: {summary_line(summary)}")
            return summary
        if start > 0:
            changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in run.changes.items())
            say(f"resuming from step {start}" + (f" (changed: {changed})" if changed else ""))
        say(preflight.mesh_line(run.placement))
        primary = jax.process_index() == 0
        if primary and (start == 0 or run.changes or _placement_changed(run)):
            run_log.write_config(run.workdir, config, _run_facts(run))
        writer = run_log.MetricsWriter(
            run.workdir,
            total_steps=total,
            # Predicted tokens per step (each row of seq_len tokens gives seq_len - 1).
            tokens_per_step=int(config.batch_size) * (run.seq_len - 1),
            start_step=start,
            tensorboard=bool(config.tensorboard),
            stream=stream,
            primary=primary,
        )
        end = total if stop_at is None else min(int(stop_at), total)
        try:
            run_loop(run, ckpt, writer, start, end, say)
        finally:
            writer.close()
    finally:
        ckpt.close()
    # The rows this process logged (every process holds them; only one wrote them).
    summary = summarize(writer.rows, final_window)
    summary.update(
        wall_s=time.perf_counter() - t_start,
        recipe=run.recipe.name,
        seed=int(config.seed),
        already_complete=False,
    )
    return summary
