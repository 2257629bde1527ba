"""Whole runs: configs/tiny.py trains and its loss goes down; a run stopped at step k
and resumed from its workdir reaches step n with exactly the uninterrupted losses."""

import importlib.util
import io
import json
from pathlib import Path

import numpy as np

from fp8jax.train.loop import train
from fp8jax.train.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _config(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def test_tiny_config_trains_and_loss_goes_down(tmp_path):
    c = _config("tiny")
    out = io.StringIO()
    s = train(c, tmp_path, stream=out)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    # Starts near ln(256) = 5.55 (uniform over bytes); must fall well below it.
    assert losses[0] > 4.0
    assert s["final_train_loss"] < losses[0] - 1.0
    assert vals[-1] < vals[0] and s["final_val_loss"] < 4.0
    assert s["steps"] == c.steps and np.isfinite(s["tokens_per_s"])
    # Logs: config.json, metrics.jsonl, TensorBoard events, progress lines, a checkpoint.
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["config"]["recipe"] == "deepseek_v3" and cfg["corpus"]["name"] == "stdlib"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / str(c.steps)).exists()
    lines = out.getvalue().splitlines()
    assert any(line.startswith(f"step {c.steps}/{c.steps} | loss") for line in lines)
    assert all("steps/s" in line and "tok/s" in line and "ETA" in line for line in lines)
    # FP8 telemetry is logged for the FP8 recipe.
    assert "fp8/flushed_mean" in rows[0]


def test_resume_is_exact_with_delayed_scaling_state_and_microbatches(tmp_path):
    c = _config("tiny")
    c.recipe = "hybrid_delayed"  # FP8 delayed-scaling state must be checkpointed too
    c.steps, c.batch_size, c.microbatches, c.seq_len = 6, 4, 2, 32
    c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 3, 1, 4
    c.tensorboard = False
    whole = train(c, tmp_path / "a", stream=io.StringIO())
    part = train(c, tmp_path / "b", stop_at=3, stream=io.StringIO())
    assert part["steps"] == 3
    resumed = train(c, tmp_path / "b", stream=io.StringIO())
    # Bit-for-bit: same losses at every step, same validation losses.
    assert resumed["train_curve"] == whole["train_curve"]
    assert resumed["val_curve"] == whole["val_curve"]
    assert len(whole["train_curve"]) == 6
