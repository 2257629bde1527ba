"""The run lock: one process trains a run directory at a time; a lock left by a dead
process is taken over, one held by a live process (or another host) is refused.
Integrity: a checkpoint whose bytes were damaged into other finite values is refused
by every reader, naming the step and the array; an intact one reads bit for bit."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_train_restore import untrained_run

from fp8jax.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    RunInUse,
    _quiet_reader_threads,
    all_finite,
    run_lock,
)
from fp8jax.train.loop import completed_run, setup
from fp8jax.train.restore import load_run, run_config


def test_lock_is_held_then_released(tmp_path):
    with run_lock(tmp_path) as path:
        assert path.read_text().split() == [socket.gethostname(), str(os.getpid())]
        with pytest.raises(RunInUse, match="being trained by process"):
            with run_lock(tmp_path):
                pass
        # Another JAX process of the same run has its own lock.
        with run_lock(tmp_path, process_index=1):
            pass
    assert not path.exists()
    with run_lock(tmp_path):
        pass


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / ".lock.0").write_text(f"{socket.gethostname()} {dead.stdout.strip()}\n")
    with run_lock(tmp_path) as path:
        assert path.read_text().split()[1] == str(os.getpid())


def test_lock_from_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / ".lock.0").write_text("elsewhere 12345\n")
    with pytest.raises(RunInUse, match="remove .*lock.0") as e:
        with run_lock(tmp_path):
            pass
    # Front ends that report CheckpointError report this one too.
    assert isinstance(e.value, CheckpointError)
    assert (tmp_path / ".lock.0").exists()


def test_lock_taken_by_another_process_in_between_is_refused(tmp_path, monkeypatch):
    # The stale lock is removed, but every attempt to create it finds it again
    # (another process got there first): refused, never held without the lock.
    (tmp_path / ".lock.0").write_text(f"{socket.gethostname()} {2**40}\n")

    def taken(src, dst):
        raise FileExistsError(dst)

    monkeypatch.setattr(os, "link", taken)
    with pytest.raises(RunInUse, match="another process took its lock"):
        with run_lock(tmp_path):
            pass
    assert not list(tmp_path.glob(".lock.0.*"))


# --- integrity: every saved array carries its checksum --------------------------


def _xor_into_finite_values(ck, template, step):
    """XOR 64 bytes into the largest array file of checkpoint ``step`` where they decompress
    into other finite values (read without the checks: what a reader would have used).

    Returns the damaged file.  Positions are tried from the middle on: a damaged
    position that no longer decompresses is put back and the next one tried.
    """
    folder = ck.directory / str(step)
    f = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    clean = f.read_bytes()
    good = jax.tree.leaves(ck.restore(template, step))
    for start in range(len(clean) // 2, len(clean) - 64, 997):
        b = bytearray(clean)
        for i in range(start, start + 64):
            b[i] ^= 0x5A
        f.write_bytes(bytes(b))
        try:
            with _quiet_reader_threads() as failed:
                try:
                    bad = jax.tree.leaves(ck.restore(template, step))
                except Exception:
                    failed.append(step)
                    raise
        except Exception:
            ck.manager.close()
            ck.manager = ck._manager()
            continue
        changed = any(not np.array_equal(np.asarray(a), np.asarray(g)) for a, g in zip(bad, good))
        if changed and all_finite(bad):
            return f
    f.write_bytes(clean)
    pytest.fail(f"no 64-byte XOR of {f} decompressed into finite values")


def test_a_checkpoint_damaged_into_finite_values_is_refused_by_every_reader(tmp_path, capfd):
    from test_train_restore import untrained_run

    c = untrained_run(tmp_path, "bf16", steps=(0, 6))
    template = setup(run_config(tmp_path), tmp_path).state
    ck = Checkpointer(tmp_path, keep=2)
    _xor_into_finite_values(ck, template, 6)
    ck.close()
    capfd.readouterr()
    # Evaluate, sample, parity (load_run): the newest usable step, the damaged one named.
    notes = []
    _, state, step = load_run(tmp_path, say=notes.append)
    assert step == 0 and int(state.step) == 0
    assert len(notes) == 1 and notes[0].startswith("note: checkpoint step 6 is unusable (array ")
    assert "differs from the sha256 recorded when it was saved" in notes[0]
    with pytest.raises(CheckpointError, match=r"checkpoint step 6 in .* is unusable: array \S+ "):
        load_run(tmp_path, 6)
    # "Already complete": not with a damaged newest checkpoint.
    assert not Checkpointer(tmp_path).holds_usable(6)
    assert completed_run(c, tmp_path) is None
    # Training's resume: falls back to step 0 and moves step 6 aside.
    said = []
    ck = Checkpointer(tmp_path, keep=2)
    back = ck.restore_latest(template, said.append)
    ck.close()
    assert int(back.step) == 0 and ck.all_steps() == [0]
    assert said[0].startswith("warning: checkpoint step 6 is unusable (array ")
    assert said[0].endswith("falling back to step 0") and len(said) == 1
    assert (tmp_path / "checkpoints_unreadable" / "6").is_dir()
    assert "Traceback" not in capfd.readouterr().err


def test_an_intact_checkpoint_reads_bit_for_bit_and_records_every_array(tmp_path):
    untrained_run(tmp_path, "bf16", steps=(0, 6))
    saved = setup(run_config(tmp_path), tmp_path).state._replace(step=np.int32(6))
    ck = Checkpointer(tmp_path)
    rec, problem = ck.checksum_record(6)
    assert problem is None and ck.holds_usable(6)
    ck.close()
    # Every array of the state (parameters, AdamW moments, ...) is recorded.
    assert len(rec["arrays"]) == len(jax.tree.leaves(saved))
    assert any(p.startswith("opt_state/") and "/mu/" in p for p in rec["arrays"])
    notes = []
    _, back, step = load_run(tmp_path, say=notes.append)
    assert step == 6 and notes == []
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_a_checkpoint_saved_without_checksums_reads_with_a_note(tmp_path):
    # A step saved before checkpoints recorded checksums: its metadata has no record.
    untrained_run(tmp_path, "bf16", steps=(0,))
    meta_path = tmp_path / "checkpoints" / "0" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_path.read_text())
    del meta["custom_metadata"]["fp8jax_checksums"]
    meta_path.write_text(json.dumps(meta))
    notes = []
    _, _, step = load_run(tmp_path, say=notes.append)
    assert step == 0 and notes == [
        "note: checkpoint step 0 holds no checksums (saved before checkpoints recorded "
        "them): its arrays are read unverified"
    ]
    assert Checkpointer(tmp_path).holds_usable(0)


@pytest.mark.parametrize("damage", ["metadata", "custom", "record"])
def test_a_damaged_checksum_record_is_refused_in_one_line(tmp_path, damage):
    untrained_run(tmp_path, "bf16", steps=(0,))
    meta_path = tmp_path / "checkpoints" / "0" / "_CHECKPOINT_METADATA"
    if damage == "metadata":
        b = bytearray(meta_path.read_bytes())
        b[0] ^= 0x5A  # the opening brace: no longer JSON
        meta_path.write_bytes(bytes(b))
        why = "its _CHECKPOINT_METADATA does not read"
    elif damage == "custom":
        meta = json.loads(meta_path.read_text())
        meta["custom_metadata"] = [1]
        meta_path.write_text(json.dumps(meta))
        why = r"its _CHECKPOINT_METADATA is damaged \(custom_metadata is not an object\)"
    else:
        meta = json.loads(meta_path.read_text())
        meta["custom_metadata"]["fp8jax_checksums"]["arrays"]["step"] = 3
        meta_path.write_text(json.dumps(meta))
        why = "its checksum record is damaged"
    with pytest.raises(CheckpointError, match=f"checkpoint step 0 in .* is unusable: {why}"):
        load_run(tmp_path, 0)
    if damage == "custom":
        return  # orbax itself refuses to open the run's checkpoints: said above, in one line
    assert not Checkpointer(tmp_path).holds_usable(0)


def test_when_every_kept_checkpoint_is_damaged_readers_say_so_and_refuse(tmp_path):
    untrained_run(tmp_path, "bf16", steps=(0,))
    ck = Checkpointer(tmp_path)
    _xor_into_finite_values(ck, setup(run_config(tmp_path), tmp_path).state, 0)
    ck.close()
    notes = []
    with pytest.raises(
        CheckpointError, match=r"no usable checkpoint in .* \(see the notes above\)"
    ):
        load_run(tmp_path, say=notes.append)
    assert len(notes) == 1 and notes[0].endswith("; no earlier checkpoint")
    assert "is unusable (array " in notes[0]
