"""A run that fails before its first checkpoint removes what it created, and only that."""

import pytest

from fp8jax.train.workdir import removed_unless_checkpointed


class Boom(RuntimeError):
    pass


def test_a_new_workdir_goes_when_the_run_fails_before_a_checkpoint(tmp_path):
    wd = tmp_path / "run"
    with pytest.raises(Boom), removed_unless_checkpointed(wd):
        (wd / "config.json").write_text("{}")
        (wd / "tb").mkdir()
        (wd / "checkpoints").mkdir()
        raise Boom
    assert not wd.exists()


def test_what_was_there_before_stays(tmp_path):
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt), removed_unless_checkpointed(wd):
        (wd / "metrics.jsonl").write_text("")
        raise KeyboardInterrupt
    assert sorted(p.name for p in wd.iterdir()) == ["notes.txt"]


def test_a_checkpoint_keeps_everything(tmp_path):
    wd = tmp_path / "run"
    with pytest.raises(Boom), removed_unless_checkpointed(wd):
        (wd / "config.json").write_text("{}")
        (wd / "checkpoints" / "2").mkdir(parents=True)
        raise Boom
    assert (wd / "config.json").exists() and (wd / "checkpoints" / "2").is_dir()


def test_kept_exception_types_and_success_keep_everything(tmp_path):
    wd = tmp_path / "run"
    with pytest.raises(Boom), removed_unless_checkpointed(wd, keep_on=(Boom,)):
        (wd / "metrics.jsonl").write_text("{}\n")
        raise Boom
    assert (wd / "metrics.jsonl").exists()
    with removed_unless_checkpointed(tmp_path / "ok") as p:
        (p / "config.json").write_text("{}")
    assert (tmp_path / "ok" / "config.json").exists()
