"""The numerics studies ``experiments/study.py`` runs, one module per ``config.study``.

Each module has ``run(config, runs, out_dir)``: ``config`` holds the study's
settings (configs/study/<name>.py: every field with its meaning), ``runs`` the
directories of trained runs it reads (``--run``; empty for the synthetic
studies) and ``out_dir`` where it writes its tables and plots (``--out_dir``;
None: print only).  A study prints its report; a setting it cannot use raises
:class:`StudyConfigError` naming the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

STUDIES = (
    "accumulation",
    "block_rules",
    "captured_gemm_error",
    "dgrad_blocks",
    "gemm_error",
    "plot_telemetry",
    "scale_sites",
    "site_errors",
    "stress_monitors",
)


class StudyConfigError(ValueError):
    """A setting or path the study cannot run with (the message names it)."""


def runner(name: str) -> Callable:
    """``run`` of the study called ``name`` (imported on demand: studies pull in models)."""
    if name not in STUDIES:
        raise StudyConfigError(f"config.study = {name!r}: give one of {', '.join(STUDIES)}")
    return importlib.import_module(f"fp8jax.numerics.studies.{name}").run


def one_run(runs: list[str], study: str) -> str:
    """The single trained-run directory a study reads (StudyConfigError otherwise)."""
    if len(runs) != 1:
        raise StudyConfigError(f"{study} reads one trained run: give --run=DIR (got {runs})")
    return runs[0]
