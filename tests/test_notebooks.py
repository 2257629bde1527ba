"""The notebooks: their jupytext .py sources run top to bottom at small settings, and
every committed .ipynb is the executed form of its .py (outputs and plots included).

FP8JAX_NOTEBOOK_SMALL=1 shrinks every notebook to tiny sizes; MPLBACKEND=Agg
makes plt.show() a no-op.  Each notebook asserts its own findings (e.g. the
saturating cast never produces NaN, delayed scaling clips on a fresh state),
so running it is a test of those claims, not only of the code.  Notebook 03
runs in tests/test_notebook_03.py.  `python scripts/run_notebooks.py`
regenerates the .ipynb files.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import jupytext
import nbformat
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


# Minutes on 2 CPU cores (Qwix's eager first call of each quantized model): -m slow.
@pytest.mark.slow
def test_06_interop(small_env):
    pytest.importorskip("qwix")
    ns = _run("06_interop.py")
    assert ns["same"] is True
    assert set(ns["results"]["labels"]) == {"bf16", "deepseek_v3"}


SOURCES = sorted(NOTEBOOKS.glob("0*_*.py"))
#: Notebooks whose executed .ipynb must be committed (03's comes with its own rework).
REQUIRED_IPYNB = ("01_formats", "02_scaling", "04_training", "06_interop")


def test_every_notebook_is_a_jupytext_source():
    assert [p.name[:2] for p in SOURCES] == ["01", "02", "03", "04", "05", "06"]
    for py in SOURCES:
        nb = jupytext.read(py)
        kinds = [c.cell_type for c in nb.cells]
        assert kinds[0] == "markdown" and kinds.count("code") >= 3, py.name


@pytest.mark.parametrize(
    "py",
    [p for p in SOURCES if p.stem in REQUIRED_IPYNB or p.with_suffix(".ipynb").exists()],
    ids=lambda p: p.stem,
)
def test_committed_ipynb_is_the_executed_source(py):
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"run: python scripts/run_notebooks.py {py.stem}"
    src = jupytext.read(py)
    nb = nbformat.read(ipynb, as_version=4)
    fix = f"out of date: python scripts/run_notebooks.py {py.stem}"
    assert [(c.cell_type, c.source) for c in nb.cells] == [
        (c.cell_type, c.source) for c in src.cells
    ], fix
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Executed in order, top to bottom, without errors; plots stored as PNG.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), fix
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
