"""Executes notebooks/03_accumulation.py top to bottom in its small configuration."""

from __future__ import annotations

import pathlib
import runpy

import jupytext
import matplotlib

matplotlib.use("Agg")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "03_accumulation.py"


def test_notebook_is_jupytext_percent():
    nb = jupytext.read(NOTEBOOK)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds.count("markdown") >= 4 and kinds.count("code") >= 5


def test_notebook_03_runs_small(monkeypatch):
    monkeypatch.setenv("FP8JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ns = runpy.run_path(str(NOTEBOOK), run_name="__main__")
    import matplotlib.pyplot as plt

    plt.close("all")
    assert ns["SMALL"] is True
    uni = {r["K"]: r for r in ns["rows"] if r["dist"] == "uniform"}
    k_lo, k_hi = min(uni), max(uni)
    # One promotion interval or less: promoting changes nothing.
    assert uni[k_lo]["promote_max"] == uni[k_lo]["no_promotion_max"]
    # Without promotion the positive-input error grows with K; with it, it does not.
    assert uni[k_hi]["no_promotion_max"] > 2 * uni[k_lo]["no_promotion_max"]
    assert uni[k_hi]["promote_max"] < 1.5 * uni[k_lo]["promote_max"]
    # Every emulated error is far above the FP32 dot's, and the bit sweep is monotone.
    assert all(r["promote_max"] > 100 * r["fp32_max"] for r in ns["rows"])
    errs = [ns["sweep"][(b, None)] for b in ns["bits"]]
    assert errs == sorted(errs, reverse=True)
