"""Executes notebooks/03_accumulation.py top to bottom in its small configuration."""

from __future__ import annotations

import pathlib
import runpy

import jupytext
import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "03_accumulation.py"


def test_notebook_is_jupytext_percent_and_ipynb_matches():
    nb = jupytext.read(NOTEBOOK)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds.count("markdown") >= 5 and kinds.count("code") >= 6
    # The committed .ipynb holds the same cells as the .py source.
    ipynb = jupytext.read(NOTEBOOK.with_suffix(".ipynb"))
    assert [c.source for c in ipynb.cells] == [c.source for c in nb.cells]


def test_notebook_03_runs_small(monkeypatch):
    monkeypatch.setenv("FP8JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    ns = runpy.run_path(str(NOTEBOOK), run_name="__main__")
    plt.close("all")
    assert ns["SMALL"] is True
    assert {r["dist"] for r in ns["rows"]} == set(ns["DISTS"])
    uni = {r["K"]: r for r in ns["rows"] if r["dist"] == "uniform"}
    k_lo, k_hi = min(uni), max(uni)
    # K = 128 is one chain with or without promotion every 128: the same bits.
    assert k_lo == 128 and uni[k_lo]["promote_max"] == uni[k_lo]["no_promotion_max"]
    # Without promotion the positive-input error grows with K; with it, it does not.
    assert uni[k_hi]["no_promotion_max"] > 2 * uni[k_lo]["no_promotion_max"]
    assert uni[k_hi]["promote_max"] < 1.5 * uni[k_lo]["promote_max"]
    # 13-bit truncation is far above the FP32 dot's rounding for positive inputs.
    assert all(r["promote_max"] > 100 * r["fp32_max"] for r in uni.values())
    # More accumulator bits, smaller error.
    errs = [ns["sweep"][(b, None)] for b in ns["BITS"]]
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0] / 100
