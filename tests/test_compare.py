"""The comparison driver's statistics, table and plots (from hand-made run logs)."""

import json
import math

import ml_collections
import pytest

from fp8jax.train import compare
from fp8jax.train.defaults import tiny_config


def _cfg():
    c = tiny_config()
    c.compare = ml_collections.ConfigDict(
        dict(
            name="t",
            labels=["bf16", "fp8"],
            baseline="bf16",
            seeds=[0, 1],
            runs=dict(bf16=dict(recipe="bf16"), fp8=dict(recipe="deepseek_v3", fp8_reset_every=3)),
        )
    )
    return c


def _summary(recipe, val, train, tel=None):
    return {
        "recipe": recipe,
        "final_val_loss": val,
        "final_train_loss": train,
        "tokens_per_s": 100.0,
        "fp8_telemetry": tel or {},
    }


def _rows(final):
    rows = [{"step": s, "loss": final + 1.0 / s} for s in range(1, 21)]
    return rows + [{"step": 10, "val_loss": final + 0.1}, {"step": 20, "val_loss": final}]


def test_aggregate_paired_gaps_noise_floor_and_outputs(tmp_path):
    c = _cfg()
    runs = {
        "bf16": {0: _summary("bf16", 2.00, 2.10), 1: _summary("bf16", 2.02, 2.12)},
        "fp8": {
            0: _summary("deepseek_v3", 2.01, 2.10, {"saturated_max": 0.0, "flushed_mean": 1e-4}),
            1: _summary("deepseek_v3", 2.0402, 2.14, {"saturated_max": 1e-3, "flushed_mean": 3e-4}),
        },
    }
    res = compare.aggregate(c, runs, {})
    assert res["noise_floor_val"] == pytest.approx(0.02 / 2.01)
    fp8 = res["table"][1]
    # Paired gaps: (2.01-2.00)/2.00 = 0.5%, (2.0402-2.02)/2.02 = 1%; mean 0.75%.
    assert fp8["rel_gap_val_per_seed"] == pytest.approx([0.005, 0.01])
    assert fp8["rel_gap_val"] == pytest.approx(0.0075)
    assert fp8["within_noise"] is True  # 0.75% <= spread 0.995%
    assert fp8["fp8_telemetry"]["saturated_max"] == 1e-3
    assert fp8["fp8_telemetry"]["flushed_mean"] == pytest.approx(2e-4)
    assert res["table"][0]["rel_gap_val"] == 0.0
    md = compare.markdown(res, "python x.py")
    assert "| fp8 | deepseek_v3 | 2.0251 |" in md and "+0.75%" in md and "python x.py" in md
    rows = {lab: {s: _rows(runs[lab][s]["final_val_loss"]) for s in (0, 1)} for lab in runs}
    paths = compare.plot(res, rows, tmp_path, smooth=3)
    assert all(p.exists() and p.stat().st_size > 10_000 for p in paths)
    (tmp_path / "results.json").write_text(json.dumps(res))
    head = compare.headline_table([tmp_path])
    assert (
        head.count("\n") == 3
        and "| t | fp8 (deepseek_v3) | 2.0251 | +0.75% | 1.00% | yes |" in head
    )


def test_gap_outside_noise_and_nan_are_not_within():
    c = _cfg()
    runs = {
        "bf16": {0: _summary("bf16", 2.0, 2.0), 1: _summary("bf16", 2.0, 2.0)},
        "fp8": {0: _summary("x", 2.01, 2.0), 1: _summary("x", math.nan, 2.0)},
    }
    res = compare.aggregate(c, runs, {})
    assert res["threshold"] == compare.DEEPSEEK_TOLERANCE
    assert res["table"][1]["within_noise"] is False


def test_run_config_applies_overrides_and_rejects_unknown_fields(tmp_path):
    c = _cfg()
    rc = compare.run_config(c, "fp8", 1)
    assert rc.recipe == "deepseek_v3" and rc.fp8_reset_every == 3
    assert rc.seed == 1 and rc.data_seed == 1 and "compare" not in rc
    # Identical training configs share a run directory; seeds and recipes do not.
    d0 = compare.run_dir(tmp_path, compare.run_config(c, "bf16", 0), 0)
    d1 = compare.run_dir(tmp_path, compare.run_config(c, "bf16", 1), 1)
    assert d0.parent == d1.parent and d0 != d1
    assert compare.run_dir(tmp_path, rc, 1).parent != d1.parent
    c.compare.runs.fp8.not_a_field = 1
    with pytest.raises(ValueError, match="not a field"):
        compare.run_config(c, "fp8", 0)
