"""Execute the notebooks (jupytext percent .py sources) top to bottom at small settings.

FP8JAX_NOTEBOOK_SMALL=1 shrinks every notebook to tiny sizes; MPLBACKEND=Agg
makes plt.show() a no-op.  Each notebook asserts its own findings (e.g. the
saturating cast never produces NaN, delayed scaling clips on a fresh state),
so running it is a test of those claims, not only of the code.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.fixture
def small_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8JAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg", force=True)
    monkeypatch.chdir(tmp_path)
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _run(name: str) -> dict:
    path = NOTEBOOKS / name
    assert path.exists(), path
    return runpy.run_path(str(path), run_name="__main__")


def test_01_formats(small_env):
    ns = _run("01_formats.py")
    assert ns["SMALL"] is True
    # 256 codes each; E4M3: 2 NaN codes and no infinity; E5M2: 2 infinities.
    e4, e5 = ns["codes"]["E4M3"], ns["codes"]["E5M2"]
    assert e4.size == e5.size == 256
    assert int(sum(v != v for v in e4)) == 2 and not any(abs(v) == float("inf") for v in e4)
    assert int(sum(abs(v) == float("inf") for v in e5)) == 2


def test_02_scaling(small_env):
    ns = _run("02_scaling.py")
    res = ns["results"]
    # Massive activations: per-tensor scaling loses to 1x128 tiles per token.
    assert (
        res["massive", 1e5, "tensor"]["token_median_rel"]
        > 2 * res["massive", 1e5, "tile"]["token_median_rel"]
    )
    # Delayed scaling clips on the first step of a fresh state, not on the second.
    h = ns["h_fresh"]["hybrid_delayed"]
    assert h[0, 2] > 0 and h[1, 2] == 0


# Compiles the MoE train step twice (~20-30 s on 2 idle cores): kept in the default run so
# the training notebook never rots.
def test_04_training(small_env):
    ns = _run("04_training.py")
    assert set(ns["summaries"]) == {"bf16", "deepseek_v3"}
    for s in ns["summaries"].values():
        assert s["steps"] == 3


def test_every_notebook_has_a_committed_ipynb():
    for py in sorted(NOTEBOOKS.glob("0[124]_*.py")):
        assert py.with_suffix(".ipynb").exists(), f"run: jupytext --to ipynb {py}"
