"""metrics.jsonl / TensorBoard / progress line, and the orbax checkpoint round trip."""

import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax.scaling import init_delayed_gemm_state
from fp8jax.train import run_log
from fp8jax.train.checkpoint import Checkpointer, all_finite
from fp8jax.train.optimizer import scale_by_adam_lowp
from fp8jax.train.state import TrainState


def test_progress_line_jsonl_and_resume_truncation(tmp_path):
    out = io.StringIO()
    w = run_log.MetricsWriter(tmp_path, total_steps=10, tokens_per_step=100, stream=out)
    w.reset_clock(0)
    for s in range(1, 5):
        w.write(s, {"loss": 5.0 - s, "x": np.float32(1.5)})
        if s == 2:
            w.write(2, {"val_loss": 3.5})
        w.progress(s, 5.0 - s)
    w.close()
    rows = run_log.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4]
    assert rows[0]["x"] == 1.5 and rows[2] == {"step": 2, "val_loss": 3.5}
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "val" not in lines[0]
    # The latest validation loss, marked with the step it was measured at.
    assert lines[3].startswith("step 4/10 | loss 1.0000 | val 3.5000 @2 | ")
    assert "steps/s" in lines[3] and "tok/s" in lines[3] and "ETA" in lines[3]
    # Resume at step 2: later rows are dropped so the log reads as one run, and the
    # progress line knows the latest validation loss again.
    out2 = io.StringIO()
    w2 = run_log.MetricsWriter(
        tmp_path, total_steps=10, tokens_per_step=100, start_step=2, stream=out2
    )
    assert w2.progress(3, 1.0).startswith("step 3/10 | loss 1.0000 | val 3.5000 @2 | ")
    w2.close()
    assert [r["step"] for r in run_log.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 2]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert run_log.format_duration(3725) == "1h02m05s" and run_log.format_duration(65) == "1m05s"
    p = run_log.write_config(tmp_path, {"a": 1}, {"n": np.int64(3)})
    assert json.loads(p.read_text()) == {"config": {"a": 1}, "n": 3}


def test_nonfinite_values_are_floats_in_memory_and_null_in_the_file(tmp_path):
    out = io.StringIO()
    w = run_log.MetricsWriter(
        tmp_path, total_steps=3, tokens_per_step=1, tensorboard=False, stream=out
    )
    row = w.write(1, {"loss": np.float32("nan"), "grad_norm": float("inf"), "ok": 2.0})
    assert math.isnan(row["loss"]) and row["grad_norm"] == math.inf and row["ok"] == 2.0
    assert "loss nan" in w.progress(1, row["loss"])
    w.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    # Strict JSON (no NaN / Infinity tokens), null where the value was not finite.
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert parsed["loss"] is None and parsed["grad_norm"] is None and parsed["ok"] == 2.0
    assert run_log.as_float(None) != run_log.as_float(None)  # NaN
    assert run_log.to_jsonable({"a": [np.float64("-inf"), np.array([1.0, np.nan])]}) == {
        "a": [None, [1.0, None]]
    }


def test_torn_last_line_is_skipped_and_a_bad_middle_line_is_an_error(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with pytest.warns(UserWarning, match="torn last line"):
        assert run_log.read_jsonl(p) == [{"step": 1, "loss": 2.0}]
    out = io.StringIO()
    w = run_log.MetricsWriter(
        tmp_path, total_steps=3, tokens_per_step=1, start_step=1, tensorboard=False, stream=out
    )
    w.close()
    assert "dropped a torn last line" in out.getvalue()
    assert p.read_text() == '{"step": 1, "loss": 2.0}\n'
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(run_log.DamagedLog, match="line 2 is damaged"):
        run_log.read_jsonl(p)


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"loss": 2.0}', 'no integer "step"'),
        ('{"step": 1e400, "loss": 2.0}', '"step" is inf, not an integer'),
        ('{"step": 2.5}', '"step" is 2.5, not an integer'),
        ('{"step": true}', '"step" is True, not an integer'),
        ('{"step": -1}', '"step" -1 is outside'),
        ('{"step": 4294967296}', '"step" 4294967296 is outside'),
        ('{"step": 2, "loss": [1, 2]}', "'loss' is list, not a number"),
        ('{"step": 2, "loss": "2.0"}', "'loss' is str, not a number"),
        ('{"step": 2, "loss": ' + "9" * 400 + "}", "'loss' is an integer beyond float64"),
        ("[" * 100_000 + "]" * 100_000, "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_a_malformed_row_is_refused_or_skipped_in_one_line_naming_file_and_line(
    tmp_path, line, why
):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 3.0}\n' + line + '\n{"step": 3, "loss": 1.0}\n')
    # Training's own reader and the summaries refuse it ...
    with pytest.raises(run_log.DamagedLog) as e:
        run_log.read_jsonl(p)
    assert f"{p} line 2 is damaged" in str(e.value) and why in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(run_log.DamagedLog, match="line 2 is damaged"):
        run_log.MetricsWriter(tmp_path, total_steps=3, tokens_per_step=1, start_step=3)
    # ... a plot leaves it out, said in one line.
    said = []
    rows = run_log.read_jsonl(p, said.append, skip_malformed=True)
    assert [r["step"] for r in rows] == [1, 3]
    assert len(said) == 1 and said[0].startswith(f"{p}: skipped line 2: ") and why in said[0]
    # The same row last is malformed, not torn: it is still named.
    p.write_text('{"step": 1, "loss": 3.0}\n' + line + "\n")
    if line.startswith("["):
        return  # valid JSON that is not an object: named above
    with pytest.raises(run_log.DamagedLog, match="line 2 is damaged"):
        run_log.read_jsonl(p)


def test_a_log_that_is_not_a_regular_file_or_too_large_is_refused_unread(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "fifo" / "metrics.jsonl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # nobody writes it: opening it for reading the usual way would block
    with pytest.raises(run_log.DamagedLog, match="is not a regular file"):
        run_log.read_jsonl(fifo)
    dev = tmp_path / "dev" / "metrics.jsonl"
    dev.parent.mkdir()
    dev.symlink_to("/dev/zero")  # endless: reading it would fill memory
    with pytest.raises(run_log.DamagedLog, match="is not a regular file"):
        run_log.read_jsonl(dev)
    with pytest.raises(run_log.DamagedLog, match="is not a regular file"):
        run_log.MetricsWriter(dev.parent, total_steps=3, tokens_per_step=1, start_step=1)
    big = tmp_path / "metrics.jsonl"
    big.write_text('{"step": 1, "loss": 3.0}\n' * 10)
    monkeypatch.setattr(run_log, "MAX_LOG_BYTES", 100)
    with pytest.raises(run_log.DamagedLog, match="is larger than the"):
        run_log.read_jsonl(big)


def test_checkpoint_round_trip_keeps_fp8_state_bias_and_bf16_moments(tmp_path):
    recipe = fp8jax.recipes.hybrid_delayed()
    fp8 = init_delayed_gemm_state(recipe)
    fp8 = fp8._replace(
        x=fp8.x._replace(
            amax_history=fp8.x.amax_history.at[0].set(3.25), scale=jnp.float32(3.25 / 448)
        )
    )
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), scale_by_adam_lowp(moment_dtype="bfloat16"))
    opt = tx.init(params)
    _, opt = tx.update({"w": jnp.ones((2, 3)) * 0.3}, opt, params)
    state = TrainState(jnp.int32(7), params, {"l": fp8}, {"b": jnp.full((2, 4), 0.125)}, {}, opt)
    ck = Checkpointer(tmp_path, every=0)
    assert ck.save(state, force=True)
    ck.close()
    template = TrainState(
        jnp.int32(0),
        {"w": jnp.zeros((2, 3))},
        {"l": init_delayed_gemm_state(recipe)},
        {"b": jnp.zeros((2, 4))},
        {},
        tx.init(params),
    )
    ck = Checkpointer(tmp_path)
    assert ck.latest_step() == 7
    back = ck.restore(template)
    ck.close()
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert back.opt_state[1].mu["w"].dtype == jnp.bfloat16


def test_restore_latest_skips_nonfinite_and_unreadable_checkpoints(tmp_path):
    def state(step, value, dtype=jnp.float32):
        return TrainState(jnp.int32(step), {"w": jnp.full((3,), value, dtype)}, {}, {}, {}, {})

    ck = Checkpointer(tmp_path, every=1, keep=5)
    for step, value in ((1, 1.0), (2, 2.0), (3, float("nan"))):
        assert ck.save(state(step, value))
    ck.close()
    for f in (tmp_path / "checkpoints" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")  # a damaged copy: every file of step 2 emptied
    said = []
    ck = Checkpointer(tmp_path, keep=5)
    back = ck.restore_latest(state(0, 0.0), said.append)
    assert int(back.step) == 1 and float(back.params["w"][0]) == 1.0
    assert ck.all_steps() == [1]
    ck.close()
    assert "step 3 is unusable (it holds non-finite values)" in said[0]
    assert said[0].endswith("falling back to step 2") and said[1].startswith(
        "warning: checkpoint step 2 is unusable ("
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints_unreadable").iterdir()) == ["2", "3"]
    assert Checkpointer(tmp_path / "empty").restore_latest(state(0, 0.0)) is None
    # BF16 leaves are checked too; integer leaves never count as non-finite.
    assert not all_finite({"m": jnp.array([1.0, jnp.inf], jnp.bfloat16)})
    assert all_finite({"m": jnp.ones(2, jnp.bfloat16), "i": jnp.arange(3)})


def test_amax_growth_over_the_window_and_across_resume(tmp_path):
    key = "layers/layer0/attn/wo/x/amax"
    w = run_log.MetricsWriter(
        tmp_path,
        total_steps=40,
        tokens_per_step=1,
        tensorboard=False,
        stream=io.StringIO(),
        growth_window=10,
    )
    rows = [w.write(s, {key: a}) for s, a in ((1, 2.0), (5, 1.0), (10, 3.0), (20, 6.0))]
    assert math.isnan(rows[0][key + "_growth"])  # nothing precedes step 1
    assert rows[1][key + "_growth"] == 0.5  # 1 / max(2)
    assert rows[2][key + "_growth"] == 1.5  # 3 / max(2, 1)
    assert rows[3][key + "_growth"] == 2.0  # 6 / max(3): steps 10..19 only
    w.close()
    # Resumed at step 10: the kept rows seed the window, later ones are gone.
    w2 = run_log.MetricsWriter(
        tmp_path,
        total_steps=40,
        tokens_per_step=1,
        start_step=10,
        tensorboard=False,
        stream=io.StringIO(),
        growth_window=10,
    )
    assert w2.write(20, {key: 6.0})[key + "_growth"] == 2.0
    assert w2.write(25, {key: 1.0})[key + "_growth"] == 1.0 / 6.0
    w2.close()
    on_disk = run_log.read_jsonl(tmp_path / "metrics.jsonl")
    assert on_disk[0][key + "_growth"] is None and [r["step"] for r in on_disk] == [
        1,
        5,
        10,
        20,
        25,
    ]


def _tb_tags(tb_dir):
    """Scalar tags in tensorboardX event files (TFRecord: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    tags = set()
    for path in tb_dir.glob("events.out.tfevents.*"):
        blob = path.read_bytes()
        i = 0
        while i < len(blob):
            (n,) = struct.unpack("<Q", blob[i : i + 8])
            ev = event_pb2.Event.FromString(blob[i + 12 : i + 12 + n])
            tags.update(v.tag for v in ev.summary.value)
            i += 12 + n + 4
    return tags


def test_per_site_telemetry_reaches_jsonl_and_tensorboard(tmp_path):
    w = run_log.MetricsWriter(tmp_path, total_steps=2, tokens_per_step=1, stream=io.StringIO())
    site = {
        "layers/layer0/ffn/w2/x/amax": 3.0,
        "layers/layer0/ffn/w2/x/saturated": 0.01,
        "layers/layer1/moe/tokens/count/2": 17.0,
    }
    w.write(1, {"loss": 2.0, **site})
    w.write(2, {"loss": 1.5, **site})
    w.close()
    rows = run_log.read_jsonl(tmp_path / "metrics.jsonl")
    assert all(set(site) <= set(r) for r in rows)
    assert rows[1]["layers/layer0/ffn/w2/x/amax_growth"] == 1.0
    tags = _tb_tags(tmp_path / "tb")
    # NaN (the first row's growth) is left out of TensorBoard; the rest is there.
    assert set(site) | {"loss", "layers/layer0/ffn/w2/x/amax_growth"} <= tags


def test_a_gzipped_log_reads_as_the_plain_one_with_the_same_checks(tmp_path, monkeypatch):
    import gzip
    import os

    rows = [{"step": 1, "loss": 3.0, "val_loss": None}, {"step": 2, "loss": 2.5}]
    plain = tmp_path / "plain" / "metrics.jsonl"
    plain.parent.mkdir()
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    run.mkdir()
    gz = run_log.write_gz(run / "metrics.jsonl.gz", rows)
    # The same rows give the same bytes (no time, no name in the header).
    first = gz.read_bytes()
    assert run_log.write_gz(gz, rows).read_bytes() == first
    assert gzip.decompress(first) == plain.read_bytes()
    assert run_log.read_jsonl(gz) == run_log.read_jsonl(plain) == rows
    # A reader that names metrics.jsonl finds the gzipped copy beside it.
    assert run_log.find_log(run) == gz
    assert run_log.read_jsonl(run / "metrics.jsonl") == rows
    # A malformed row is named by file and line, as in a plain log ...
    gz.write_bytes(gzip.compress(b'{"step": 1, "loss": 3.0}\n{"loss": 1.0}\n{"step": 3}\n'))
    with pytest.raises(run_log.DamagedLog, match=r"metrics.jsonl.gz line 2 is damaged"):
        run_log.read_jsonl(gz)
    said = []
    assert [r["step"] for r in run_log.read_jsonl(gz, said.append, skip_malformed=True)] == [1, 3]
    assert len(said) == 1 and said[0].startswith(f"{gz}: skipped line 2: ")
    # ... data that is not gzip, or is cut short, is refused in one line ...
    for blob in (b"not gzip", first[:-9]):
        gz.write_bytes(blob)
        with pytest.raises(run_log.DamagedLog, match="is not complete gzip data") as e:
            run_log.read_jsonl(gz)
        assert "\n" not in str(e.value)
    # ... and so is one that expands past the cap, however small it is.
    gz.write_bytes(gzip.compress(b'{"step": 1, "loss": 3.0}\n' * 10))
    monkeypatch.setattr(run_log, "MAX_LOG_BYTES", 100)
    assert len(gz.read_bytes()) < 100
    with pytest.raises(run_log.DamagedLog, match="decompresses to more than the 100 bytes"):
        run_log.read_jsonl(gz)
    # Not a regular file: refused unread, gzipped or not.
    gz.unlink()
    os.mkfifo(gz)
    with pytest.raises(run_log.DamagedLog, match="is not a regular file"):
        run_log.read_jsonl(run / "metrics.jsonl")
    # A plain log, when there is one, is the run's log (a run writing it now).
    (run / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    assert run_log.find_log(run) == run / "metrics.jsonl"
    assert run_log.find_log(tmp_path / "nothing") is None


def test_a_log_is_read_line_by_line_in_bounded_memory(tmp_path, monkeypatch):
    import gzip
    import tracemalloc

    # 20 MB of newlines around two rows: the reader holds one line at a time, never
    # the file or a list of its lines (which would take gigabytes at the size cap).
    blob = b"\n" * 10_000_000 + b'{"step": 1, "loss": 3.0}\n' + b"\n" * 10_000_000
    blob += b'{"step": 2, "loss": 2.0}\n{"step": 3, "lo'  # a torn last line
    for name, data in (("metrics.jsonl", blob), ("metrics.jsonl.gz", gzip.compress(blob))):
        path = tmp_path / name
        path.write_bytes(data)
        said = []
        tracemalloc.start()
        try:
            rows = run_log.read_jsonl(path, said.append)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [r["step"] for r in rows] == [1, 2] and said == [f"{path}: skipped a torn last line"]
        assert peak < 8_000_000, f"{name}: {peak:,} bytes at the peak"
    # A line longer than a row can be is refused in one line naming it.
    monkeypatch.setattr(run_log, "MAX_LINE_BYTES", 30)
    (tmp_path / "long.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "loss": ' + b"1" * 40 + b"}\n")
    with pytest.raises(run_log.DamagedLog, match="long.jsonl line 2 is longer than the 30 bytes"):
        run_log.read_jsonl(tmp_path / "long.jsonl")
