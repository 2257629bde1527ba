"""Which implementation every GEMM resolved to, recorded while a computation is traced.

A run's numerics depend on the path each GEMM takes ("chunked", "xla",
"emulate", ...), which ``Recipe.impl == "auto"`` resolves per backend and
operand layout.  The GEMM core reports each decision with :func:`note` while
JAX traces it; :func:`recording` collects the reports of one trace, so a run
can store the paths it actually ran next to its results.

Keys are ``"<scope>/<kind>"``: scope "dense" (``fp8jax.dot_general``) or
"expert" (the grouped expert GEMM), kind "fprop", "dgrad" or "wgrad".
Values are path descriptions (see ``fp8jax.gemm.describe_path``).  Outside
:func:`recording` nothing is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# Open recordings and the current scope: trace-time only, one stack each, so
# nested recordings all see the GEMMs traced inside them.
_RECORDINGS: list[dict[str, set[str]]] = []
_SCOPES: list[str] = ["dense"]


@contextmanager
def recording() -> Iterator[dict[str, set[str]]]:
    """Collect ``{"<scope>/<kind>": {path, ...}}`` for the GEMMs traced inside the block."""
    paths: dict[str, set[str]] = {}
    _RECORDINGS.append(paths)
    try:
        yield paths
    finally:
        _RECORDINGS.remove(paths)


@contextmanager
def scope(name: str) -> Iterator[None]:
    """GEMMs traced inside the block are reported under ``name`` ("expert", ...)."""
    _SCOPES.append(name)
    try:
        yield
    finally:
        _SCOPES.pop()


def note(kind: str, path: str) -> None:
    """Report that a GEMM of ``kind`` in the current scope runs as ``path``."""
    key = f"{_SCOPES[-1]}/{kind}"
    for paths in _RECORDINGS:
        paths.setdefault(key, set()).add(path)


def note_standard_op(path: str) -> None:
    """Report ``path`` for Fprop, Dgrad and Wgrad: one standard op that autodiff transposes."""
    for kind in ("fprop", "dgrad", "wgrad"):
        note(kind, path)


def as_table(paths: dict[str, set[str]]) -> dict[str, str]:
    """The recording as JSON-ready strings: several paths of one key joined by " + "."""
    return {k: " + ".join(sorted(v)) for k, v in sorted(paths.items())}
