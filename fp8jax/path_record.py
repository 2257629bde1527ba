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

A traced GEMM takes its path per lowering platform (``fp8jax.platforms``),
so the GEMM core reports one path per platform; a recording keeps those of
one platform: by default the default device's, the one a program run here
is lowered for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from fp8jax import platforms

# Open recordings (each with its platform), the current scope and the
# platforms whose paths count: trace-time only, one stack each, so nested
# recordings all see the GEMMs traced inside them.
_RECORDINGS: list[tuple[str, dict[str, set[str]]]] = []
_SCOPES: list[str] = ["dense"]
_ONLY: list[tuple[str, ...]] = []


@contextmanager
def recording(platform: str | None = None) -> Iterator[dict[str, set[str]]]:
    """Collect ``{"<scope>/<kind>": {path, ...}}`` for the GEMMs traced inside the block.

    ``platform``: whose paths to keep ("cpu", "cuda", "rocm", "tpu"; None:
    the default device's).
    """
    platform = platforms.local_platform() if platform is None else platform
    entry = (platform, {})
    _RECORDINGS.append(entry)
    try:
        yield entry[1]
    finally:
        _RECORDINGS.remove(entry)


@contextmanager
def only(platform_names: tuple[str, ...]) -> Iterator[None]:
    """Paths noted inside the block count for ``platform_names`` only.

    For a computation that runs on some platforms only (one branch of a
    per-platform choice): what it notes for the others is not what they run.
    """
    _ONLY.append(tuple(platform_names))
    try:
        yield
    finally:
        _ONLY.pop()


@contextmanager
def scope(name: str) -> Iterator[None]:
    """GEMMs traced inside the block are reported under ``name`` ("expert", ...)."""
    _SCOPES.append(name)
    try:
        yield
    finally:
        _SCOPES.pop()


def note(kind: str, path: str | Mapping[str, str]) -> None:
    """Report that a GEMM of ``kind`` in the current scope runs as ``path``.

    ``path``: one description for every platform, or one per platform
    (platforms left out run something else, reported elsewhere).
    """
    key = f"{_SCOPES[-1]}/{kind}"
    for platform, paths in _RECORDINGS:
        if any(platform not in allowed for allowed in _ONLY):
            continue
        p = path if isinstance(path, str) else path.get(platform)
        if p is not None:
            paths.setdefault(key, set()).add(p)


def note_standard_op(path: str) -> None:
    """Report ``path`` for Fprop, Dgrad and Wgrad: one standard op that autodiff transposes."""
    for kind in ("fprop", "dgrad", "wgrad"):
        note(kind, path)


def as_table(paths: dict[str, set[str]]) -> dict[str, str]:
    """The recording as JSON-ready strings: several paths of one key joined by " + "."""
    return {k: " + ".join(sorted(v)) for k, v in sorted(paths.items())}
