"""A sweep of comparisons: rows per (value, label) with the baseline left out, sorted by
value, intervals and telemetry carried over from each results.json, a Markdown table
and a figure on disk."""

import json

import numpy as np

from fp8jax.lab.compare_sweep import plot_sweep, sweep_markdown, sweep_rows
from fp8jax.lab.stats import mean_interval, verdict


def _results(gaps: dict[str, list[float]], flushed: dict[str, float]) -> dict:
    table = [
        {
            "label": "bf16",
            "gap_val": mean_interval([0.0, 0.0]),
            "verdict": "baseline",
            "fp8_telemetry": {},
        }
    ]
    for label, g in gaps.items():
        st = mean_interval(g)
        table.append(
            {
                "label": label,
                "gap_val": st,
                "verdict": verdict(st),
                "fp8_telemetry": {"flushed_mean": flushed[label], "saturated_max": 0.0},
            }
        )
    # Through JSON, as read back from results.json (inf / NaN as strings or null).
    return json.loads(json.dumps({"baseline": "bf16", "table": table}, default=str))


def test_rows_markdown_and_plot(tmp_path):
    res = {
        1e5: _results(
            {"tile": [0.01, 0.012, 0.011], "tensor": [0.2, 0.3, 0.25]},
            {"tile": 1e-4, "tensor": 0.4},
        ),
        1e2: _results(
            {"tile": [0.0001, -0.0001, 0.0], "tensor": [0.001, 0.0, -0.001]},
            {"tile": 0.0, "tensor": 1e-3},
        ),
    }
    rows = sweep_rows(res)
    assert [(r["value"], r["label"]) for r in rows] == [
        (1e2, "tile"),
        (1e2, "tensor"),
        (1e5, "tile"),
        (1e5, "tensor"),
    ]
    r = rows[3]
    want = np.mean([0.2, 0.3, 0.25])
    assert abs(r["gap"]["mean"] - want) < 1e-12 and r["gap"]["lo"] < want < r["gap"]["hi"]
    assert r["flushed_mean"] == 0.4 and r["verdict"] == "outside"
    assert rows[0]["verdict"] == "within"
    text = sweep_markdown(rows, "magnitude")
    assert text.count("\n") == 2 + len(rows)
    assert "| 1e+05 | tensor | +25.00% [" in text
    path = plot_sweep(rows, tmp_path / "sweep.png", "magnitude", "title")
    assert path.stat().st_size > 10_000
