"""Process set-up shared by the training entry points: caches, flags, one-line errors.

Caches live in the user's cache directory, never in a shared temporary one:
``$FP8JAX_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/fp8jax``, else
``~/.cache/fp8jax``.  The persistent JAX compilation cache is its ``jax``
subfolder; ``--jax_cache_dir=DIR`` moves it and ``--jax_cache_dir=`` (empty)
switches it off, as does ``FP8JAX_CACHE_DIR=`` (set but empty).

User mistakes on the command line (a typo'd flag, a missing config file, a bad
value) and the errors the training code raises for them
(:class:`~fp8jax.train.defaults.ConfigError`) print one line,
``<program>: error: <what and the fix>``, and exit with status 2, as absl
and argparse do for usage errors; no traceback.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import jax
from absl import flags, logging

CACHE_HELP = (
    "Persistent XLA compilation cache: reruns and other seeds skip recompiling. Default: "
    "$FP8JAX_CACHE_DIR/jax, $XDG_CACHE_HOME/fp8jax/jax or ~/.cache/fp8jax/jax; '' = off."
)


def cache_root() -> Path | None:
    """fp8jax's cache directory (None when ``FP8JAX_CACHE_DIR`` is set but empty: caches off)."""
    explicit = os.environ.get("FP8JAX_CACHE_DIR")
    if explicit is not None:
        return Path(explicit).expanduser() if explicit else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fp8jax"


def default_jax_cache_dir() -> str:
    """The compilation cache folder under :func:`cache_root` ('' when caches are off)."""
    root = cache_root()
    return "" if root is None else str(root / "jax")


def setup_runtime(jax_cache_dir: str) -> None:
    """Quiet absl logging and switch on the persistent compilation cache.

    Orbax logs every checkpoint step at INFO; WARNING keeps the progress lines
    readable.  A non-empty ``jax_cache_dir`` caches compiles that take at least
    0.5 s, so reruns and other seeds of the same config skip recompiling.
    """
    logging.set_verbosity(logging.WARNING)
    if jax_cache_dir:
        Path(jax_cache_dir).expanduser().mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(Path(jax_cache_dir).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def usage_error(message: str, code: int = 2) -> NoReturn:
    """Print ``<program>: error: <message>`` (one line) to stderr and exit with ``code``."""
    line = " ".join(str(message).split())
    print(f"{Path(sys.argv[0]).name}: error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _flag_error_line(e: BaseException, argv: Sequence[str]) -> str:
    """One line for a flag-parsing failure, with the fix."""
    text = str(e)
    # ml_collections reports an unknown config field as AttributeError / KeyError
    # whose text is "'name'" plus, when one is close, 'Did you mean "x" instead of "y"?'.
    if isinstance(e, AttributeError | KeyError):
        typo = re.search(r'Did you mean "([\w.]+)" instead of "([\w.]+)"', text)
        bad = typo.group(2) if typo else re.sub(r"[^\w.].*", "", text.strip("'\\\""))
        arg = next(
            (a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0].endswith(bad)),
            f"--config.{bad}",
        )
        if typo:
            return f"unknown config field {arg}; did you mean {arg[: -len(bad)]}{typo.group(1)}?"
        # A synonym (--config.learning_rate for lr) is no typo: the schema knows it.
        from fp8jax.train.defaults import suggest_field

        close = (
            suggest_field(arg.removeprefix("--config.")) if arg.startswith("--config.") else None
        )
        if close:
            return f"unknown config field {arg}; did you mean --config.{close}?"
        return f"unknown config field {arg} (fields: fp8jax/train/defaults.py)"
    bad_int = re.search(r"flag (--config\.[\w.]+)=(\S*): invalid literal for int\(\)", text)
    if bad_int:
        return (
            f"{bad_int.group(1)}={bad_int.group(2)}: this field is an integer; write it in "
            "digits, e.g. 512 (not 1e3 or 2.5)"
        )
    if isinstance(e, SyntaxError):
        return (
            f"config file {e.filename!r} line {e.lineno}: {e.msg}: fix the file "
            "(it is Python: python -m py_compile FILE shows the spot)"
        )
    if isinstance(e, NameError | ImportError):
        arg = next((a for a in reversed(argv) if a.startswith("--config=")), "--config=?")
        return f"config file {arg.split('=', 1)[1]!r} fails to load: {type(e).__name__}: {text}"
    if "Failed loading config file" in text:
        arg = next((a for a in reversed(argv) if a.startswith("--config=")), "--config=?")
        path = arg.split("=", 1)[1].split(":")[0]
        return (
            f"config file {path!r} not found or unreadable: give an existing file, e.g. "
            "--config=configs/tiny.py (paths are relative to the current directory)"
        )
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return f"{first} (--helpfull lists the flags)"


_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl ``flags_parser`` for ``app.run``: flag and config-file errors as one line, exit 2."""
    try:
        try:
            rest = flags.FLAGS(list(argv))
        except SystemExit:
            # absl prints the help asked for and exits 1; asking for help is no error.
            if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
                raise SystemExit(0) from None
            raise
        if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
            # config_flags defers a load failure to the first access: make it happen here.
            list(flags.FLAGS["config"].value.keys())
        return rest
    except (
        flags.Error,
        AttributeError,
        KeyError,
        OSError,
        ValueError,
        TypeError,
        SyntaxError,
        NameError,
        ImportError,
    ) as e:
        usage_error(_flag_error_line(e, argv))
