"""metrics.jsonl / TensorBoard / progress line, and the orbax checkpoint round trip."""

import io
import json

import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax.scaling import init_delayed_gemm_state
from fp8jax.train import metrics
from fp8jax.train.checkpoint import Checkpointer
from fp8jax.train.optimizer import scale_by_adam_lowp
from fp8jax.train.state import TrainState


def test_progress_line_jsonl_and_resume_truncation(tmp_path):
    out = io.StringIO()
    w = metrics.MetricsWriter(tmp_path, total_steps=10, tokens_per_step=100, stream=out)
    w.reset_clock(0)
    for s in range(1, 5):
        w.write(s, {"loss": 5.0 - s, "x": np.float32(1.5)})
    w.write(4, {"val_loss": 3.5})
    w.close()
    rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4]
    assert rows[0]["x"] == 1.5 and rows[-1] == {"step": 4, "val_loss": 3.5}
    line = out.getvalue().splitlines()[3]
    assert line.startswith("step 4/10 | loss 1.0000 | ")
    assert "steps/s" in line and "tok/s" in line and "ETA" in line
    # Resume at step 2: later rows are dropped so the log reads as one run.
    w2 = metrics.MetricsWriter(
        tmp_path, total_steps=10, tokens_per_step=100, start_step=2, stream=io.StringIO()
    )
    w2.close()
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert metrics.format_duration(3725) == "1h02m05s" and metrics.format_duration(65) == "1m05s"
    p = metrics.write_config(tmp_path, {"a": 1}, {"n": np.int64(3)})
    assert json.loads(p.read_text()) == {"config": {"a": 1}, "n": 3}


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
    import jax

    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert back.opt_state[1].mu["w"].dtype == jnp.bfloat16
