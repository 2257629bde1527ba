"""The per-site telemetry plot: series read from metrics.jsonl, one colour per run."""

import json
import math

import pytest

from fp8jax.lab import telemetry_plot as tp


def _run(path, scale):
    path.mkdir()
    rows = []
    for step in (1, 10, 20):
        rows.append(
            {
                "step": step,
                "loss": 3.0,
                "layers/layer0/ffn/w2/x/saturated": scale * step * 1e-4,
                "layers/layer0/ffn/w2/x/amax_growth": None if step == 1 else 1.0 + scale,
                "layers/layer1/moe/experts/swiglu/outlier_ratio": 10.0 * step,
                "layers/layer1/moe/tokens/count/3": 17.0,
            }
        )
        rows.append({"step": step, "val_loss": 3.1})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_key():
    assert tp.split_key("layers/layer0/ffn/w2/x/amax") == ("layer0/ffn/w2/x", "amax")
    assert tp.split_key("layers/layer1/moe/tokens/count/3") == ("layer1/moe/tokens[3]", "count")
    assert tp.split_key("fp8/saturated_max") is None and tp.split_key("loss") is None


def test_load_series_reads_nulls_as_nan(tmp_path):
    s = tp.load_series(_run(tmp_path / "a", 1.0))
    steps, vals = s[("layer0/ffn/w2/x", "amax_growth")]
    assert steps == [1, 10, 20] and math.isnan(vals[0]) and vals[1:] == [2.0, 2.0]
    assert s[("layer1/moe/tokens[3]", "count")][1] == [17.0, 17.0, 17.0]


def test_plot_one_colour_per_run_and_style_per_site(tmp_path, monkeypatch):
    a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 2.0)
    drawn = []
    real = tp.plt.Axes.plot

    def spy(ax, *args, **kw):
        drawn.append((kw.get("color"), kw.get("linestyle"), kw.get("marker")))
        return real(ax, *args, **kw)

    monkeypatch.setattr(tp.plt.Axes, "plot", spy)
    out = tp.plot_telemetry([a, b], tmp_path / "fig" / "t.png", labels=["A", "B"])
    assert out.stat().st_size > 0
    by_run = {}
    for colour, line, marker in drawn:
        by_run.setdefault(colour, set()).add((line, marker))
    assert len(by_run) == 2  # one colour per run, in every panel
    looks = [look for looks in by_run.values() for look in looks]
    assert len(set(looks)) == len(looks) // 2  # each site the same look in both runs
    # Panels loss, saturated, amax_growth, outlier_ratio, count: one site each, two runs.
    assert len(drawn) == 10


def test_plot_refuses_nothing_to_draw(tmp_path):
    a = _run(tmp_path / "a", 1.0)
    with pytest.raises(ValueError, match="no per-site telemetry"):
        tp.plot_telemetry([a], tmp_path / "t.png", sites="nomatch")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        tp.plot_telemetry([tmp_path], tmp_path / "t.png")
    with pytest.raises(ValueError, match="labels"):
        tp.plot_telemetry([a], tmp_path / "t.png", labels=["x", "y"])
