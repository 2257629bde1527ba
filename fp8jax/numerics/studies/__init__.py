"""The numerics studies ``experiments/study.py`` runs, one module per ``config.study``.

Each module has ``run(config, runs, out_dir)``: ``config`` holds the study's
settings (configs/study/<name>.py: every field with its meaning), ``runs`` the
directories of trained runs it reads (``--run``; empty for the synthetic
studies) and ``out_dir`` where it writes its tables and plots (``--out_dir``;
None: print only).  A study prints its report; a setting it cannot use raises
:class:`StudyConfigError` naming the field.

Each module also has ``FIELDS`` (setting -> its check, :mod:`fp8jax.train.fields`)
and, where its sizes are settings, ``footprint(values)``: a lower bound of the
bytes it allocates.  :func:`checked_runner` runs both before the study starts,
so a bad setting is refused in one line before any array exists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import ml_collections

from fp8jax.train.fields import ConfigError, check_allocation, check_fields, choice

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


class StudyConfigError(ConfigError):
    """A setting or path the study cannot run with (the message names it)."""


def runner(name: str) -> Callable:
    """``run`` of the study called ``name`` (imported on demand: studies pull in models)."""
    if name not in STUDIES:
        raise StudyConfigError(f"config.study = {name!r}: give one of {', '.join(STUDIES)}")
    return importlib.import_module(f"fp8jax.numerics.studies.{name}").run


def checked_runner(c: ml_collections.ConfigDict) -> Callable:
    """``run`` of the study ``c.study`` names, once every setting of ``c`` is checked.

    Raises ConfigError (one line naming the field) for an unknown study, a
    setting of the wrong type or range, an unknown name, or sizes whose arrays
    alone exceed the memory available.
    """
    name = c.get("study")
    run = runner(name)
    module = importlib.import_module(f"fp8jax.numerics.studies.{name}")
    what = f"the {name} study"
    values = check_fields(c, {"study": choice(*STUDIES), **module.FIELDS}, what)
    if hasattr(module, "footprint"):
        check_allocation(module.footprint(values), f"{what} at these sizes")
    return run


def one_run(runs: list[str], study: str) -> str:
    """The single trained-run directory a study reads (StudyConfigError otherwise)."""
    if len(runs) != 1:
        raise StudyConfigError(f"{study} reads one trained run: give --run=DIR (got {runs})")
    return runs[0]
