"""Benchmark config files read without ml_collections (the GPU image has none).

``experiments/bench.py`` reads ``--config=configs/bench/NAME.py[:ARG]`` and its
``--config.FIELD=VALUE`` overrides through ml_collections' ``config_flags``
where that package is installed.  Where it is not (the GPU image, which
``scripts/gpu_sweep.sh`` runs on and which installs nothing), the same flags
are read here: the file's ``get_config(ARG)`` builds its fields in a
:class:`FieldDict` (what :func:`new_config` returns without ml_collections),
and each override is converted to the type of the field's default, as
config_flags does: a bool from true/false (or 1/0, yes/no), an int, a float,
or the text as it is.  An unknown field, a value of the wrong type or a flag
other than ``--config``, ``--config.FIELD`` and ``--out_dir`` is a ValueError
with one line naming it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_FLAGS = "flags are --config=FILE, --config.FIELD=VALUE, --out_dir=DIR"


class FieldDict(dict):
    """A flat config: fields read and set as attributes or items, as a ConfigDict's are."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def new_config() -> Any:
    """An empty ml_collections.ConfigDict, or a :class:`FieldDict` where ml_collections is absent."""
    try:
        import ml_collections
    except ImportError:
        return FieldDict()
    return ml_collections.ConfigDict()


def _typed(field: str, default: Any, text: str) -> Any:
    """``text`` as the type of ``default`` (ValueError naming ``--config.field``)."""
    if isinstance(default, bool):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"--config.{field}={text!r}: give true or false")
    for kind in (int, float):
        if isinstance(default, kind):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"--config.{field}={text!r}: give {kind.__name__}") from None
    return text


def load(spec: str, overrides: dict[str, str]) -> FieldDict:
    """The config of ``spec`` ("PATH" or "PATH:ARG"), ``overrides`` (field -> text) applied."""
    path, _, arg = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        raise ValueError(
            f"config file {path!r} not found: give an existing file, e.g. "
            "--config=configs/bench/sweep.py (paths are relative to the current directory)"
        )
    module_spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = FieldDict(module.get_config(*([arg] if arg else [])))
    for field, text in overrides.items():
        if field not in config:
            raise ValueError(f"unknown config field --config.{field} (fields: {path})")
        config[field] = _typed(field, config[field], text)
    return config


def parse_argv(argv: list[str]) -> tuple[FieldDict, str | None]:
    """(config, out_dir) of ``--config=... [--config.FIELD=VALUE ...] [--out_dir=DIR]``."""
    spec, out_dir, overrides = None, None, {}
    for arg in argv:
        name, eq, value = arg.partition("=")
        if not eq:
            raise ValueError(f"{arg!r}: {_FLAGS}")
        if name == "--config":
            spec = value
        elif name == "--out_dir":
            out_dir = value
        elif name.startswith("--config.") and len(name) > len("--config."):
            overrides[name.removeprefix("--config.")] = value
        else:
            raise ValueError(f"unknown flag {name}: {_FLAGS}")
    if spec is None:
        raise ValueError("give --config=configs/bench/NAME.py")
    return load(spec, overrides), out_dir
