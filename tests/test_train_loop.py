"""Whole runs: configs/tiny.py trains and its loss goes down; a run stopped at step k
and resumed from its workdir reaches step n with exactly the uninterrupted losses;
divergence stops at the first non-finite step and keeps finite checkpoints; resume
refuses another config, reports "resuming from step N" / "already complete", skips a
torn metrics line and falls back past an unreadable checkpoint; user mistakes raise a
one-line ConfigError before any workdir exists."""

import errno
import io
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from fp8jax.train.checkpoint import Checkpointer, CheckpointError, all_finite
from fp8jax.train.compiled import StepCache
from fp8jax.train.defaults import ConfigError, config_file, tiny_config
from fp8jax.train.loop import TrainingDiverged, setup, train
from fp8jax.train.run_log import MetricsWriter, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
# Compiled steps shared by the runs of these tests (one compilation per config).
STEPS = StepCache()


def _config(name):
    return config_file(ROOT / "configs" / f"{name}.py")


def _fast(**overrides):
    """A few steps of the tiny model on short rows (one compilation shared by the tests)."""
    c = tiny_config()
    c.steps, c.batch_size, c.seq_len, c.warmup_steps = 6, 4, 32, 2
    c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 3, 1, 4
    c.tensorboard = False
    for k, v in overrides.items():
        c[k] = v
    return c


def test_tiny_config_trains_and_loss_goes_down(tmp_path):
    c = _config("tiny")
    out = io.StringIO()
    s = train(c, tmp_path, stream=out, steps=STEPS)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    # Starts near ln(256) = 5.55 (uniform over bytes); must fall well below it.
    assert losses[0] > 4.0
    assert s["final_window"] == 3
    assert s["train_loss_final_window_mean"] < losses[0] - 1.0
    assert s["train_loss_final_window_mean"] == pytest.approx(np.mean(losses[-3:]), rel=1e-12)
    assert vals[-1] < vals[0] and s["final_val_loss"] < 4.0
    assert s["steps"] == c.steps and np.isfinite(s["tokens_per_s"])
    assert s["already_complete"] is False
    # Logs: config.json, metrics.jsonl, TensorBoard events, progress lines, a checkpoint.
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["config"]["recipe"] == "deepseek_v3" and cfg["corpus"]["name"] == "stdlib"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / str(c.steps)).exists()
    lines = out.getvalue().splitlines()
    # The resolved mesh, then compilation and the time it took.
    assert lines[0] == "mesh data=1 x fsdp=1 x expert=1 on 1 cpu device(s), 1 process(es)"
    assert lines[1] == "compiling the training step ..."
    assert re.fullmatch(r"compiled the training step in \d+\.\d s \(with step 1\)", lines[2])
    lines = lines[3:]
    assert cfg["mesh"] == {"data": 1, "fsdp": 1, "expert": 1}
    assert cfg["device_count"] == 1 and cfg["process_count"] == 1
    # One line per logged step (1, 10, ..., 60): evaluations add no line of their own.
    logged = [r["step"] for r in rows if "loss" in r]
    assert [int(line.split()[1].split("/")[0]) for line in lines] == logged
    assert lines[-1].startswith(f"step {c.steps}/{c.steps} | loss")
    assert f"| val {vals[-1]:.4f} @{c.steps} |" in lines[-1]
    # Between evaluations the validation loss shown is the latest one, marked with its step.
    assert "@20 |" in lines[3] and lines[3].startswith("step 30/")
    assert all("steps/s" in line and "tok/s" in line and "ETA" in line for line in lines)
    # FP8 telemetry is logged for the FP8 recipe.
    assert "fp8/flushed_mean" in rows[0]
    # And per site: every GEMM operand, every SwiGLU's monitors, the tokens per expert.
    for key in (
        "layers/layer0/attn/wo/x/saturated",
        "layers/layer1/moe/experts_w2/x/flushed",
        "layers/layer1/moe/experts_w13/w/amax",
        "layers/layer0/ffn/swiglu/align_max",
        "layers/layer1/moe/experts/swiglu/outlier_ratio",
    ):
        assert key in rows[0], key
    counts = [v for k, v in rows[0].items() if k.startswith("layers/layer1/moe/tokens/count/")]
    assert sum(counts) == c.batch_size * c.seq_len * 2  # top-2 routing
    # The same command again: nothing trained, the summary reported.
    again = io.StringIO()
    s2 = train(c, tmp_path, stream=again, steps=STEPS)
    assert again.getvalue().startswith("already complete: {")
    assert len(again.getvalue().splitlines()) == 1
    assert s2["already_complete"] is True and s2["final_val_loss"] == s["final_val_loss"]


def test_resume_is_exact_with_delayed_scaling_state_and_microbatches(tmp_path):
    c = _config("tiny")
    c.recipe = "hybrid_delayed"  # FP8 delayed-scaling state must be checkpointed too
    c.steps, c.batch_size, c.microbatches, c.seq_len = 6, 4, 2, 32
    c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 3, 1, 4
    c.tensorboard = False
    whole = train(c, tmp_path / "a", stream=io.StringIO(), steps=STEPS)
    part = train(c, tmp_path / "b", stop_at=3, stream=io.StringIO(), steps=STEPS)
    assert part["steps"] == 3
    out = io.StringIO()
    resumed = train(c, tmp_path / "b", stream=out, steps=STEPS)
    assert out.getvalue().splitlines()[0] == "resuming from step 3"
    # Bit-for-bit: same losses at every step, same validation losses.
    assert resumed["train_curve"] == whole["train_curve"]
    assert resumed["val_curve"] == whole["val_curve"]
    assert len(whole["train_curve"]) == 6


def test_divergence_stops_at_first_nonfinite_step_and_keeps_finite_checkpoints(tmp_path):
    # The reproduction: a huge learning rate, sparse logging, frequent checkpoints.
    c = _fast(lr=1e3, steps=40, log_every=20, checkpoint_every=3, eval_every=0)
    with pytest.raises(TrainingDiverged) as info:
        train(c, tmp_path, stream=io.StringIO(), steps=STEPS)
    step = info.value.step
    msg = str(info.value)
    assert "\n" not in msg and f"diverged at step {step}" in msg
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    # The first non-finite step is logged, NaN/Inf written as JSON null.
    bad = [r for r in rows if r["step"] == step]
    assert bad and (bad[0]["loss"] is None or bad[0]["grad_norm"] is None)
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()
    # Every kept checkpoint predates the divergence and is finite; the newest resumes.
    ck = Checkpointer(tmp_path)
    kept = ck.all_steps()
    template = setup(c, tmp_path / "fresh").state
    assert kept and all(s < step for s in kept)
    assert all(all_finite(ck.restore(template, s)) for s in kept)
    ck.close()
    out = io.StringIO()
    with pytest.raises(TrainingDiverged) as again:
        train(c, tmp_path, stream=out, steps=STEPS)
    assert out.getvalue().splitlines()[0] == f"resuming from step {kept[-1]}"
    assert again.value.step == step


def test_summary_of_a_diverged_log_has_nan_not_errors(tmp_path):
    from fp8jax.train.loop import summarize

    rows = [
        {"step": 1, "loss": 5.0, "fp8/saturated_max": 0.0},
        {"step": 2, "loss": None, "fp8/saturated_max": None},
        {"step": 2, "val_loss": None},
    ]
    s = summarize(rows, 3)
    # The key stays the same whatever the window; the window covers the 2 logged steps.
    assert math.isnan(s["train_loss_final_window_mean"]) and math.isnan(s["final_val_loss"])
    assert s["final_window"] == 2
    assert s["train_curve"][1][0] == 2 and math.isnan(s["train_curve"][1][1])


def test_summary_keys_do_not_depend_on_the_window_and_old_keys_still_read():
    from fp8jax.train.loop import summarize, train_loss_key

    rows = [{"step": s, "loss": float(s)} for s in range(1, 6)]
    keys = {frozenset(summarize(rows, w)) for w in (1, 3, 10)}
    assert len(keys) == 1
    assert summarize(rows, 3)["train_loss_final_window_mean"] == pytest.approx(4.0)
    assert summarize(rows, 10)["final_window"] == 5
    # A summary written before the key was fixed still names its train loss.
    assert train_loss_key({"steps": 5, "train_loss_last3_mean": 4.0}) == "train_loss_last3_mean"


def test_a_complete_run_answers_from_its_records_before_building_anything(tmp_path, monkeypatch):
    from fp8jax.train import loop

    c = _fast(checkpoint_every=2)
    first = train(c, tmp_path, stream=io.StringIO(), steps=STEPS)

    def no_build(*args, **kwargs):
        raise AssertionError("the model and data were built")

    monkeypatch.setattr(loop, "setup", no_build)
    out = io.StringIO()
    again = train(c, tmp_path, stream=out, steps=STEPS)
    assert (
        out.getvalue().startswith("already complete: {") and len(out.getvalue().splitlines()) == 1
    )
    assert again["already_complete"] is True and again["train_curve"] == first["train_curve"]
    # Another config is refused as before, without building anything either.
    with pytest.raises(ConfigError, match="holds a run with another config"):
        train(_fast(checkpoint_every=2, lr=1e-3), tmp_path, stream=io.StringIO(), steps=STEPS)
    # A damaged newest checkpoint is not taken on trust: training falls back and redoes it.
    monkeypatch.undo()
    for f in (tmp_path / "checkpoints" / "6").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    out = io.StringIO()
    redone = train(c, tmp_path, stream=out, steps=STEPS)
    assert out.getvalue().splitlines()[0].startswith("warning: checkpoint step 6 is unusable")
    assert redone["already_complete"] is False and redone["train_curve"] == first["train_curve"]


def test_wall_s_counts_the_start_up_and_the_last_line_names_the_outputs(tmp_path, monkeypatch):
    import time

    from fp8jax.train import loop
    from fp8jax.train.workdir import outputs_line

    took = {}

    def timed(name, real):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                took[name] = time.perf_counter() - t

        return run

    # The real functions, timed: start-up (data, model, tracing) and the steps.
    monkeypatch.setattr(loop, "setup", timed("setup", loop.setup))
    monkeypatch.setattr(loop, "run_loop", timed("loop", loop.run_loop))
    s = train(_fast(steps=2), tmp_path, stream=io.StringIO(), steps=STEPS)
    assert s["wall_s"] >= took["setup"] + took["loop"]
    line = outputs_line(tmp_path)
    assert line == (
        f"outputs in {tmp_path}: checkpoints/ (step 2), metrics.jsonl, config.json; "
        f"evaluate: python experiments/evaluate.py --workdir={tmp_path}"
    )


def test_resume_refuses_another_config_and_allows_more_steps(tmp_path):
    c = _fast()
    train(c, tmp_path, stop_at=2, stream=io.StringIO(), steps=STEPS)
    before = (tmp_path / "config.json").read_text()
    for field, value, shown in (
        ("recipe", "bf16", "recipe 'deepseek_v3' -> 'bf16'"),
        ("lr", 1e-2, "lr 0.003 -> 0.01"),
        ("eval_batches", 2, "eval_batches 1 -> 2"),
    ):
        with pytest.raises(ConfigError, match="another config") as info:
            train(_fast(**{field: value}), tmp_path, stream=io.StringIO(), steps=STEPS)
        assert shown in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="steps may only grow"):
        train(_fast(steps=1), tmp_path, stream=io.StringIO(), steps=STEPS)
    assert (tmp_path / "config.json").read_text() == before
    # steps (and logging fields) may change: the run resumes and config.json says so.
    out = io.StringIO()
    train(_fast(steps=7, log_every=2), tmp_path, stop_at=3, stream=out, steps=STEPS)
    first = out.getvalue().splitlines()[0]
    assert first.startswith("resuming from step 2 (changed: ")
    assert "steps 6 -> 7" in first and "log_every 1 -> 2" in first
    assert json.loads((tmp_path / "config.json").read_text())["config"]["steps"] == 7


def test_resumable_fields_are_matched_by_name_and_prefix():
    from fp8jax.train.defaults import is_resumable

    assert is_resumable("steps") and is_resumable("mesh.data") and is_resumable("mesh.fsdp")
    assert not is_resumable("mesh_x") and not is_resumable("recipe")
    assert not is_resumable("model_overrides.d_model")


def test_torn_metrics_line_is_dropped_with_a_warning(tmp_path):
    c = _fast()
    whole = train(c, tmp_path / "a", stream=io.StringIO(), steps=STEPS)
    train(c, tmp_path / "b", stop_at=3, stream=io.StringIO(), steps=STEPS)
    path = tmp_path / "b" / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 4, "loss": 2.1')  # a kill in the middle of a write
    with pytest.warns(UserWarning, match="torn last line"):
        assert [r["step"] for r in read_jsonl(path)][-1] == 3
    out = io.StringIO()
    resumed = train(c, tmp_path / "b", stream=out, steps=STEPS)
    lines = out.getvalue().splitlines()
    assert lines[0] == "resuming from step 3" and lines[1].startswith("mesh ")
    assert "dropped a torn last line" in lines[2]
    assert resumed["train_curve"] == whole["train_curve"]
    assert all(line.endswith("}") for line in path.read_text().splitlines())


def test_a_damaged_line_inside_the_log_is_one_line_and_touches_nothing(tmp_path):
    c = _fast()
    train(c, tmp_path, stop_at=3, stream=io.StringIO(), steps=STEPS)
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:12]
    damaged = "\n".join(lines) + "\n"
    path.write_text(damaged)
    with pytest.raises(ConfigError) as e:
        train(c, tmp_path, stream=io.StringIO(), steps=STEPS)
    msg = str(e.value)
    assert "metrics.jsonl line 2 is damaged" in msg and "repair or delete" in msg
    assert "\n" not in msg
    assert path.read_text() == damaged and (tmp_path / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_an_unwritable_workdir_is_one_line_and_keeps_every_checkpoint(tmp_path, monkeypatch, err):
    real = MetricsWriter.write

    def write(self, step, scalars):
        # The disk fills up (or the filesystem turns read-only) after step 4's checkpoint.
        if step > 4:
            raise OSError(err, os.strerror(err), str(self.path))
        return real(self, step, scalars)

    c = _fast(checkpoint_every=2)
    monkeypatch.setattr(MetricsWriter, "write", write)
    with pytest.raises(CheckpointError) as e:
        train(c, tmp_path, stream=io.StringIO(), steps=STEPS)
    msg = str(e.value)
    assert msg.startswith(f"cannot write to workdir {str(tmp_path)!r}: {os.strerror(err)}")
    assert "checkpoints of steps 2, 4 are kept" in msg and "\n" not in msg
    assert Checkpointer.steps_in(tmp_path) == [2, 4]
    monkeypatch.undo()
    out = io.StringIO()
    s = train(c, tmp_path, stream=out, steps=STEPS)
    assert out.getvalue().startswith("resuming from step 4") and s["steps"] == c.steps


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_run_resumes_from_the_last_good_one(
    tmp_path, monkeypatch
):
    from fp8jax.train import checkpoint as ckpt_lib

    c = _fast(checkpoint_every=2)
    whole = train(c, tmp_path / "a", stream=io.StringIO(), steps=STEPS)
    real = ckpt_lib.free_bytes

    def free_bytes(path):
        # The disk fills up once step 4's checkpoint is written.
        return 1000 if (tmp_path / "b" / "checkpoints" / "4").is_dir() else real(path)

    monkeypatch.setattr(ckpt_lib, "free_bytes", free_bytes)
    with pytest.raises(CheckpointError) as e:
        train(c, tmp_path / "b", stream=io.StringIO(), steps=STEPS)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"cannot write to workdir {str(tmp_path / 'b')!r}: {os.strerror(errno.ENOSPC)} "
        f"({tmp_path / 'b' / 'checkpoints' / '6'}): the checkpoint needs about "
    )
    size = sum(f.stat().st_size for f in (tmp_path / "b/checkpoints/4").rglob("*") if f.is_file())
    assert f"needs about {size / 1e6:.1f} MB, 0.0 MB free" in msg
    assert "checkpoints of steps 2, 4 are kept" in msg
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["2", "4"]
    monkeypatch.undo()
    out = io.StringIO()
    resumed = train(c, tmp_path / "b", stream=out, steps=STEPS)
    assert out.getvalue().startswith("resuming from step 4")
    assert resumed["train_curve"] == whole["train_curve"]


def test_the_disks_error_is_recognized_through_orbax():
    from fp8jax.train.checkpoint import is_disk_full

    # What orbax raises when tensorstore's write fails for lack of space.
    orbax = ValueError(
        'RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/6.orbax-checkpoint-tmp/'
        'default.orbax-checkpoint-tmp/_sharding": Failed to write 18239 bytes to file 17: No '
        "space left on device [os_error_code='28']"
    )
    assert is_disk_full(orbax) and is_disk_full(OSError(errno.ENOSPC, "full"))
    assert is_disk_full(OSError(errno.EDQUOT, "quota"))
    assert not is_disk_full(ValueError("OUT_OF_RANGE: Error reading")) and not is_disk_full(
        OSError(errno.EROFS, os.strerror(errno.EROFS))
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_workdir_is_one_line(tmp_path):
    c = _fast()
    train(c, tmp_path / "run", stop_at=2, stream=io.StringIO(), steps=STEPS)
    (tmp_path / "run").chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="cannot write to workdir .*: Permission denied"):
            train(c, tmp_path / "run", stream=io.StringIO(), steps=STEPS)
    finally:
        (tmp_path / "run").chmod(0o755)
    assert Checkpointer.steps_in(tmp_path / "run") == [2]


def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing(tmp_path, monkeypatch):
    from fp8jax.train import loop

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(loop, "run_loop", out_of_memory)
    with pytest.raises(ConfigError, match="out of memory with batch_size 4 .*: lower"):
        train(_fast(), tmp_path / "run", stream=io.StringIO(), steps=STEPS)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    # The corrected command may use the same workdir.
    s = train(_fast(steps=2), tmp_path / "run", stream=io.StringIO(), steps=STEPS)
    assert s["steps"] == 2


def test_changing_steps_or_cadences_reuses_the_compiled_step(tmp_path):
    cache = StepCache()
    a = setup(_fast(), tmp_path / "a", steps=cache)
    b = setup(
        _fast(steps=40, log_every=5, eval_every=7, checkpoint_every=3, final_window=2),
        tmp_path / "b",
        steps=cache,
    )
    assert len(cache) == 1 and a.step_fn is b.step_fn and a.eval_fn is b.eval_fn
    c = setup(_fast(lr=1e-3), tmp_path / "c", steps=cache)
    assert len(cache) == 2 and c.step_fn is not a.step_fn
    # Built apart, the two steps are one program (the persistent compilation cache on
    # disk hits too): the length is an input of the step, not a constant in it.
    d = setup(_fast(steps=40), tmp_path / "d", steps=StepCache())
    tokens = np.zeros((4, 32), np.int32)
    hlo = [
        r.step_fn.__wrapped__.lower(r.state, tokens, np.int32(n)).as_text()
        for r, n in ((a, 6), (d, 40))
    ]
    assert d.step_fn is not a.step_fn and hlo[0] == hlo[1]


def test_unreadable_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    c = _fast(checkpoint_every=2)
    whole = train(c, tmp_path / "a", stream=io.StringIO(), steps=STEPS)
    train(c, tmp_path / "b", stop_at=4, stream=io.StringIO(), steps=STEPS)
    latest = tmp_path / "b" / "checkpoints" / "4"
    for f in latest.rglob("*"):
        if f.is_file():
            f.write_bytes(b"")  # every file of step 4 emptied
    out = io.StringIO()
    resumed = train(c, tmp_path / "b", stream=out, steps=STEPS)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("warning: checkpoint step 4 is unusable (")
    assert lines[0].endswith("falling back to step 2")
    assert lines[1] == "resuming from step 2"
    assert (tmp_path / "b" / "checkpoints_unreadable" / "4").is_dir()
    assert resumed["train_curve"] == whole["train_curve"]


def _typo(c):
    with c.unlocked():
        c.recipie = "bf16"


def _text(c, tmp_path, body):
    p = tmp_path / "corpus.txt"
    p.write_bytes(body)
    c.data.source, c.data.path = "text", str(p)


MISTAKES = {
    "typo": (_typo, "unknown config field --config.recipie; did you mean --config.recipe?"),
    "recipe": (lambda c: setattr(c, "recipe", "deepseek_v4"), "unknown recipe 'deepseek_v4'"),
    "batch_size": (lambda c: setattr(c, "batch_size", 0), "batch_size must be >= 1"),
    "seq_len": (lambda c: setattr(c, "seq_len", 1), "seq_len 1 is too short"),
    "microbatches": (lambda c: setattr(c, "microbatches", 3), "not divisible by microbatches"),
    "lr": (lambda c: setattr(c, "lr", float("nan")), "lr must be finite"),
    "data_path": (
        lambda c: (setattr(c.data, "source", "text"), setattr(c.data, "path", "/no/such/file")),
        "data path '/no/such/file' does not exist",
    ),
    "model": (lambda c: setattr(c, "model", "huge"), "unknown model preset 'huge'"),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_config_mistakes_raise_one_line_before_creating_the_workdir(tmp_path, name):
    c = _fast()
    change, expected = MISTAKES[name]
    change(c)
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train(c, workdir, stream=io.StringIO(), steps=STEPS)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert not workdir.exists()


def test_small_corpus_and_file_workdir_raise_before_creating_anything(tmp_path):
    c = _fast()
    _text(c, tmp_path, b"abc" * 30)
    with pytest.raises(ConfigError, match="too small for seq_len 32") as info:
        train(c, tmp_path / "run", stream=io.StringIO(), steps=STEPS)
    assert "\n" not in str(info.value) and not (tmp_path / "run").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        train(_fast(), tmp_path / "file", stream=io.StringIO(), steps=STEPS)
    with pytest.raises(ConfigError, match="which is a file"):
        train(_fast(), tmp_path / "file" / "run", stream=io.StringIO(), steps=STEPS)


def test_eval_batches_zero_trains_without_validation(tmp_path):
    s = train(_fast(eval_batches=0), tmp_path, stream=io.StringIO(), steps=STEPS)
    assert math.isnan(s["final_val_loss"]) and s["val_curve"] == []
    assert (tmp_path / "checkpoints" / "6").exists()
    assert all(math.isfinite(v) for _, v in s["train_curve"])


_PROCESS = """
import io, json, sys
from fp8jax.train.defaults import tiny_config
from fp8jax.train.loop import train
workdir, pid, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = tiny_config()
c.recipe = "bf16"
c.steps, c.batch_size, c.seq_len, c.warmup_steps = 4, 4, 32, 1
c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 2, 1, 4
c.mesh.num_processes, c.mesh.coordinator_address = 2, "localhost:" + port
c.mesh.process_id = pid
out = io.StringIO()
s = train(c, workdir, stream=out)
print("OUT " + json.dumps(out.getvalue()))
print("SUMMARY " + json.dumps([s["train_loss_final_window_mean"], s["final_val_loss"]]))
"""


@pytest.mark.slow  # two processes compile the step: minutes on a loaded 2-core machine
def test_two_processes_write_one_log_and_agree_on_the_summary(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", FP8JAX_CACHE_DIR="", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(tmp_path / "run"), str(pid), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]

    def tagged(out, tag):
        return json.loads(next(ln for ln in out.splitlines() if ln.startswith(tag))[len(tag) :])

    printed = [tagged(out, "OUT ") for out, _ in outs]
    summaries = [tagged(out, "SUMMARY ") for out, _ in outs]
    # Process 0 speaks for the run; process 1 prints nothing.
    assert printed[0].splitlines()[0] == (
        "mesh data=2 x fsdp=1 x expert=1 on 2 cpu device(s), 2 process(es)"
    )
    assert printed[1] == ""
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert len(list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))) == 1
    losses = [r["loss"] for r in rows if "loss" in r]
    assert summaries[0] == summaries[1]
    assert summaries[0][0] == pytest.approx(np.mean(losses[-3:]), rel=1e-12)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["process_count"] == 2 and cfg["device_count"] == 2


def test_an_inject_block_reaches_the_run_and_is_recorded(tmp_path):
    """Massive activations at every FFN down-projection input, injected through the
    config's inject block: the fresh delayed state (scale 1) clips them at step 1,
    while the same run without the block saturates nothing."""
    from fp8jax.train.injection import inject_block

    def run(sub, **inject):
        c = _fast(recipe="hybrid_delayed", steps=2, eval_batches=0)
        if inject:
            c.inject = inject_block(**inject)
        train(c, tmp_path / sub, stream=io.StringIO(), steps=STEPS)
        rows = read_jsonl(tmp_path / sub / "metrics.jsonl")
        return json.loads((tmp_path / sub / "config.json").read_text())["config"], rows[0]

    stressed_cfg, stressed = run(
        "stressed",
        massive_activation_scale=1e4,
        massive_activation_count=2,
        massive_activation_site="ffn_hidden",
    )
    plain_cfg, plain = run("plain")
    assert stressed["fp8/saturated_max"] > 0 and plain["fp8/saturated_max"] == 0
    assert stressed_cfg["inject"]["massive_activation_scale"] == 1e4
    assert "inject" not in plain_cfg


def test_config_file_loads_a_config_and_refuses_a_missing_one(tmp_path):
    assert config_file(ROOT / "configs" / "small.py").model == "small"
    with pytest.raises(ConfigError, match="does not exist"):
        config_file(tmp_path / "nope.py")
