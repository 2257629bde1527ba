"""Execute the notebooks' jupytext sources into their .ipynb, outputs and plots included.

    python scripts/run_notebooks.py                    # every notebooks/0*_*.py
    python scripts/run_notebooks.py 02_scaling 04_training

Each ``notebooks/NAME.py`` (jupytext percent format) is read, executed top to
bottom in a fresh Python kernel at full size (``FP8JAX_NOTEBOOK_SMALL`` unset,
matplotlib's inline backend, so figures are stored as PNG outputs) and written
to ``notebooks/NAME.ipynb``.  The kernel imports fp8jax from this checkout.
Needs the dev extra (jupytext, nbclient, ipykernel).  A notebook that raises
stops the script with its error and leaves its .ipynb untouched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jupytext
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def run_notebook(py: Path, timeout_s: int) -> Path:
    """Execute ``py`` and write its .ipynb beside it; returns the .ipynb path."""
    nb = jupytext.read(py)
    client = NotebookClient(
        nb,
        timeout=timeout_s,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    out = py.with_suffix(".ipynb")
    jupytext.write(nb, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all)")
    parser.add_argument("--timeout_s", type=int, default=1800, help="per cell")
    args = parser.parse_args(argv)
    if args.names:
        paths = [NOTEBOOKS / (n.removesuffix(".py") + ".py") for n in args.names]
    else:
        paths = sorted(NOTEBOOKS.glob("0*_*.py"))
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        print(f"error: no such notebook source: {', '.join(missing)}", file=sys.stderr)
        return 2
    # The kernel inherits this environment: full sizes, inline figures, this checkout.
    os.environ.pop("FP8JAX_NOTEBOOK_SMALL", None)
    os.environ.pop("MPLBACKEND", None)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    for py in paths:
        t0 = time.perf_counter()
        try:
            out = run_notebook(py, args.timeout_s)
        except CellExecutionError as e:
            print(f"error: {py.name} failed:\n{e}", file=sys.stderr)
            return 1
        print(f"{out.relative_to(REPO)}: executed in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
