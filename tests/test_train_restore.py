"""A run read back from its workdir: its own config, set up on this machine's devices,
the checkpoint asked for; mistakes are one ConfigError line."""

import jax
import numpy as np
import pytest
from test_train_loop import _fast

from fp8jax.train.checkpoint import Checkpointer, CheckpointError
from fp8jax.train.defaults import ConfigError
from fp8jax.train.loop import setup
from fp8jax.train.restore import load_run
from fp8jax.train.run_log import write_config


def untrained_run(path, recipe="deepseek_v3", steps=(0,)):
    """A run directory holding config.json and checkpoints of the initial state (no training)."""
    c = _fast(recipe=recipe)
    c.mesh.data = 1
    run = setup(c, path)
    write_config(path, c, {"corpus": run.corpus.summary()})
    ckpt = Checkpointer(path, keep=len(steps))
    for step in steps:
        ckpt.save(run.state._replace(step=np.int32(step)), force=True)
    ckpt.close()
    return c


def test_load_run_restores_the_step_asked_for_on_the_default_mesh(tmp_path):
    c = untrained_run(tmp_path, "bf16", steps=(0, 5))
    run, state, step = load_run(tmp_path)
    assert step == 5 and int(jax.device_get(state.step)) == 5
    # Trained on a mesh of its own: restored data-parallel over this machine's devices.
    assert run.config.mesh.data == -1 and run.config.recipe == c.recipe
    assert load_run(tmp_path, 0)[2] == 0
    with pytest.raises(ConfigError, match="keeps no checkpoint of step 3; kept: 0, 5"):
        load_run(tmp_path, 3)


def test_load_run_refuses_what_is_not_a_trained_run(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not a training run's config"):
        load_run(tmp_path)
    write_config(tmp_path, _fast(), {})
    with pytest.raises(ConfigError, match="holds no checkpoint: train the run first"):
        load_run(tmp_path)


def _save_nan_step(path, step):
    """Add checkpoint ``step`` whose parameters hold a NaN (a damaged or diverged state)."""
    c = _fast(recipe="bf16")
    c.mesh.data = 1
    run = setup(c, path)
    params = jax.tree.map(
        lambda a: a * np.nan if np.issubdtype(a.dtype, np.floating) else a, run.state.params
    )
    ckpt = Checkpointer(path, keep=3)
    ckpt.save(run.state._replace(step=np.int32(step), params=params), force=True)
    ckpt.close()


def test_readers_pass_over_an_unusable_checkpoint_and_move_nothing(tmp_path):
    untrained_run(tmp_path, "bf16", steps=(0,))
    _save_nan_step(tmp_path, 7)
    notes = []
    _, state, step = load_run(tmp_path, say=notes.append)
    # The newest usable one, said in one line; the damaged one stays where it is.
    assert step == 0 and int(jax.device_get(state.step)) == 0
    assert len(notes) == 1 and "step 7 is unusable (it holds non-finite values)" in notes[0]
    assert Checkpointer.steps_in(tmp_path) == [0, 7]
    with pytest.raises(CheckpointError, match="checkpoint step 7 .* is unusable"):
        load_run(tmp_path, 7)


def test_readers_refuse_an_empty_step_directory(tmp_path):
    untrained_run(tmp_path, "bf16", steps=(0,))
    ckpt_dir = tmp_path / "checkpoints" / "0"
    for f in sorted(ckpt_dir.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    with pytest.raises((CheckpointError, ConfigError)):
        load_run(tmp_path)


def _largest_file(folder):
    return max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


@pytest.mark.parametrize("damage", ["truncated", "emptied folder"])
def test_readers_pass_over_a_damaged_latest_checkpoint_in_one_line(tmp_path, capfd, damage):
    untrained_run(tmp_path, "bf16", steps=(0, 5))
    latest = tmp_path / "checkpoints" / "5"
    if damage == "truncated":
        f = _largest_file(latest)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        why = "it does not read: "
    else:
        for f in sorted(latest.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        why = "its folder holds no file"
    capfd.readouterr()
    notes = []
    _, state, step = load_run(tmp_path, say=notes.append)
    # The earlier checkpoint still reads after the damaged one failed.
    assert step == 0 and int(jax.device_get(state.step)) == 0
    assert len(notes) == 1 and notes[0].startswith(f"note: checkpoint step 5 is unusable ({why}")
    assert "\n" not in notes[0] and "TensorStore" not in notes[0]
    with pytest.raises(CheckpointError) as e:
        load_run(tmp_path, 5)
    assert f"checkpoint step 5 in {tmp_path / 'checkpoints'} is unusable: {why}" in str(e.value)
    assert "\n" not in str(e.value)
    # Nothing from orbax's reader threads reaches the terminal.
    assert "Traceback" not in capfd.readouterr().err
    assert Checkpointer.steps_in(tmp_path) == [0, 5]
