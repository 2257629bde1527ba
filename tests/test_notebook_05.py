"""Executes notebooks/05_below8.py top to bottom in its small configuration."""

from __future__ import annotations

import pathlib
import runpy

import jupytext
import matplotlib
import pytest

matplotlib.use("Agg")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "05_below8.py"


def test_notebook_is_jupytext_percent_with_an_ipynb():
    nb = jupytext.read(NOTEBOOK)
    kinds = [c.cell_type for c in nb.cells]
    assert kinds.count("markdown") >= 5 and kinds.count("code") >= 5
    assert NOTEBOOK.with_suffix(".ipynb").exists(), f"run: jupytext --to ipynb {NOTEBOOK}"


# Trains the tiny model for 3 steps (one train-step compile, ~20 s on 2 idle cores).
def test_notebook_05_runs_small(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    ns = runpy.run_path(str(NOTEBOOK), run_name="__main__")
    import matplotlib.pyplot as plt

    plt.close("all")
    assert ns["SMALL"] is True
    errors = ns["errors"]
    # The notebook's tables hold one row per tensor and format, all finite and ordered
    # by the element precision: E4M3 tiles ~ MXFP8 < NVFP4.
    assert len(errors) == 8
    for tensor in ("activation", "gradient"):
        e4m3 = errors[tensor, "E4M3 1x128 (deepseek_v3)"][0]
        mxfp8 = errors[tensor, "MXFP8 1x32"][0]
        nvfp4 = errors[tensor, "NVFP4 1x16"][0]
        assert 0 < e4m3 < nvfp4 and 0 < mxfp8 < nvfp4
        assert mxfp8 == pytest.approx(e4m3, rel=0.5)
    assert set(ns["wgrad_err"]) == {"MXFP8", "NVFP4", "NVFP4 + RHT", "NVFP4 + RHT + SR(dy)"}
    assert ns["crest_after"] < 2
