"""Checks of a config's fields, shared by every entry point: types, ranges, names, memory.

A check is a function ``(field, value) -> value`` that returns the value as the
program uses it or raises :class:`ConfigError` with one line naming the field
(``config.<field>``) and what it accepts.  :func:`check_fields` runs a table of
them (field name -> check) over a config before any work: the study and
benchmark entry points (``experiments/study.py``, ``experiments/bench.py``)
refuse a bad value here, not with a traceback minutes later; the training
schema (:mod:`fp8jax.train.defaults`) raises the same :class:`ConfigError`
through :func:`require`.  :func:`check_allocation` compares the bytes a
setting asks for with what the host can still give (:mod:`fp8jax.host_memory`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from fp8jax.host_memory import available_memory

if TYPE_CHECKING:
    # Type hints only: the benchmarks also run where ml_collections is not installed.
    import ml_collections

Check = Callable[[str, object], object]


class ConfigError(ValueError):
    """A user mistake in a config, a path or the data: the message is one line with the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def finite(x: object) -> bool:
    """True for a finite int or float (bool is no number here)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _bounds(lo: float | None, hi: float | None, above: bool = False) -> str:
    low = "" if lo is None else (f"> {lo}" if above else f">= {lo}")
    return " and ".join(s for s in (low, "" if hi is None else f"<= {hi}") if s)


def integer(lo: int | None = None, hi: int | None = None, multiple: int = 1) -> Check:
    """An int (not a bool or float) in [lo, hi] (None: unbounded), divisible by ``multiple``."""
    want = " and ".join(
        s for s in (_bounds(lo, hi), f"a multiple of {multiple}" if multiple > 1 else "") if s
    )

    def check(field: str, value: object) -> int:
        require(
            isinstance(value, int) and not isinstance(value, bool),
            f"config.{field} must be an integer, got {value!r}",
        )
        require(
            (lo is None or value >= lo) and (hi is None or value <= hi) and value % multiple == 0,
            f"config.{field} must be {want}, got {value}",
        )
        return value

    return check


def number(lo: float | None = None, hi: float | None = None, *, above: bool = False) -> Check:
    """A finite int or float in [lo, hi] (None: unbounded; ``above``: strictly above lo)."""
    want = _bounds(lo, hi, above)

    def check(field: str, value: object) -> float:
        ok = finite(value) and (lo is None or (value > lo if above else value >= lo))
        ok = ok and (hi is None or value <= hi)
        require(ok, f"config.{field} must be a finite number {want}, got {value!r}")
        return float(value)

    return check


def boolean(field: str, value: object) -> bool:
    """True or False (not 0, 1 or a string)."""
    require(isinstance(value, bool), f"config.{field} must be true or false, got {value!r}")
    return value


def text(field: str, value: object) -> str:
    """Any string."""
    require(isinstance(value, str), f"config.{field} must be a string, got {value!r}")
    return value


def file_name(field: str, value: object) -> str:
    """A file name, without a directory (the program chooses the directory)."""
    text(field, value)
    require(
        bool(value) and "/" not in value and value not in (".", ".."),
        f"config.{field} = {value!r}: give a file name without a directory, e.g. plot.png",
    )
    return value


def pattern(field: str, value: object) -> str:
    """A regular expression ("" matches everything)."""
    text(field, value)
    try:
        re.compile(value)
    except re.error as e:
        raise ConfigError(f"config.{field} = {value!r} is no regular expression: {e}") from None
    return value


def choice(*options: str) -> Check:
    """One of ``options``."""

    def check(field: str, value: object) -> str:
        require(
            value in options,
            f"config.{field} = {value!r}: give one of {', '.join(map(str, options))}",
        )
        return str(value)

    return check


def items(value: object) -> list[str]:
    """A comma-separated config field as a list ("" -> [])."""
    return [s.strip() for s in str(value).split(",") if s.strip()]


def names(known: Iterable[str] | Callable[[], Iterable[str]], *, empty: bool = False) -> Check:
    """A comma-separated list of names from ``known`` (a callable: resolved when checked);
    ``empty``: "" is allowed (the field's comment says what it then means)."""

    def check(field: str, value: object) -> list[str]:
        text(field, value)
        got = items(value)
        require(bool(got) or empty, f"config.{field} is empty: give one or more names")
        allowed = list(known() if callable(known) else known)
        bad = [n for n in got if n not in allowed]
        require(
            not bad,
            f"config.{field}: unknown name {', '.join(map(repr, bad))}; "
            f"known: {', '.join(allowed)}",
        )
        return got

    return check


def recipe_names(*, empty: bool = False) -> Check:
    """A comma-separated list of recipe names of :func:`fp8jax.registry.get`."""

    def check(field: str, value: object) -> list[str]:
        from fp8jax import registry

        text(field, value)
        got = items(value)
        require(bool(got) or empty, f"config.{field} is empty: give one or more recipe names")
        for name in got:
            try:
                registry.get(name)
            except ValueError as e:
                raise ConfigError(f"config.{field}: {e}") from None
        return got

    return check


def integers(lo: int | None = None, hi: int | None = None, *, empty: bool = False) -> Check:
    """A comma-separated list of integers, each in [lo, hi]."""
    each = integer(lo, hi)

    def check(field: str, value: object) -> list[int]:
        text(field, value)
        try:
            got = [int(s) for s in items(value)]
        except ValueError:
            raise ConfigError(
                f"config.{field} = {value!r}: give comma-separated integers"
            ) from None
        require(bool(got) or empty, f"config.{field} is empty: give one or more integers")
        return [each(field, v) for v in got]

    return check


def shapes(*, empty: bool = False) -> Check:
    """A comma-separated list of MxKxN GEMM shapes of positive integers."""

    def check(field: str, value: object) -> list[tuple[int, ...]]:
        text(field, value)
        out = []
        for s in items(value):
            parts = s.lower().split("x")
            try:
                dims = tuple(int(p) for p in parts)
            except ValueError:
                dims = ()
            require(
                len(dims) == 3 and min(dims) >= 1,
                f"config.{field}: {s!r} is no shape: give MxKxN with positive integers, "
                "e.g. 256x1024x256",
            )
            out.append(dims)
        require(bool(out) or empty, f"config.{field} is empty: give one or more MxKxN shapes")
        return out

    return check


def check_fields(
    config: ml_collections.ConfigDict, checks: Mapping[str, Check], what: str
) -> dict[str, object]:
    """Every field of ``config`` through its check (``what`` names the program in messages).

    A field without a check is refused (it would be silently ignored), and so is
    a missing one.  Returns field -> the checked value.
    """
    for field in config.keys():
        require(field in checks, f"config.{field} is not a setting of {what}")
    out = {}
    for field, check in checks.items():
        require(field in config, f"config has no field {field!r} ({what} needs it)")
        out[field] = check(field, config[field])
    return out


def check_allocation(nbytes: int, what: str) -> None:
    """Refuse a setting whose arrays alone need more than the host's available memory.

    ``nbytes``: a lower bound of the bytes ``what`` allocates at once; unknown
    available memory lets it through (the allocation then decides).
    """
    avail = available_memory()
    if avail is not None and nbytes > avail:
        raise ConfigError(
            f"{what} needs at least {size_text(nbytes)} of memory and this machine has "
            f"{size_text(avail)} available: choose smaller sizes"
        )


def size_text(nbytes: float) -> str:
    """``nbytes`` in decimal units for a message: "745.2 TB", "3.1 GB", "512 bytes"."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= div:
            return f"{nbytes / div:.1f} {unit}"
    return f"{nbytes:.0f} bytes"
