"""Run logs: metrics.jsonl, config.json, TensorBoard events, a progress line.

* ``<workdir>/config.json``: the run's config (written at the start, updated
  when a resume changes a resumable field).
* ``<workdir>/metrics.jsonl``: one JSON object per logged step
  (``{"step": ..., "loss": ..., ...}``; validation rows carry ``val_loss``).
  NaN and Inf are written as JSON ``null`` (JSON has no NaN); rows are plain
  floats in memory, and :func:`read_jsonl` gives ``None`` back for them.  On
  resume, rows beyond the restored step are dropped first, so the file reads
  like the log of one uninterrupted run; a torn last line (a run killed while
  writing it) is dropped with a warning; a damaged line before the last one
  (not JSON, or a row without an integer ``"step"`` or with a value that is
  not a number: :func:`row_problem`) raises :class:`DamagedLog` (one line
  naming the file and the line), and nothing is rewritten.  Every reader goes
  through :func:`read_jsonl`, which opens regular files only (a FIFO or a
  device is refused, not waited on), reads at most ``MAX_LOG_BYTES`` and
  streams the file line by line (lines of at most ``MAX_LINE_BYTES``), so a
  file of empty lines costs no memory.
  It reads a gzipped log (``metrics.jsonl.gz``, as committed results keep
  them: :func:`find_log`) the same way, at most ``MAX_LOG_BYTES`` once
  decompressed, with the same row checks.
  Training rows carry, besides the global FP8 aggregates (``fp8/...``), every
  per-site statistic the model sows (``layers/<site>/<stat>``, e.g.
  ``layers/layer1/moe/experts_w13/x/saturated``, ``layers/layer0/ffn/swiglu/
  align_max``, ``layers/layer1/moe/tokens/count/3`` for expert 3), and for
  every operand amax ``.../amax_growth``: that amax over the largest one
  logged in the preceding ``growth_window`` steps
  (:func:`fp8jax.monitors.amax_growth`; NaN, written as null, until a row
  precedes it).
* ``<workdir>/tb/``: TensorBoard event files (tensorboardX), same scalars.
* stdout, one line per logged step:
  ``step 120/400 | loss 2.3456 | val 2.4012 @100 | 4.10 steps/s | 2,100 tok/s | ETA 1m08s``
  (``val ... @100``: the latest validation loss and the step it was measured at).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import stat
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tensorboardX import SummaryWriter

from fp8jax.monitors import amax_growth

# Steps over which an operand's amax growth is measured (the amax history a
# delayed-scaling recipe would keep at one row per step is 16; a trend needs more).
GROWTH_WINDOW = 100


def to_jsonable(x: Any) -> Any:
    """ConfigDict / numpy / jax values -> plain JSON types; NaN and +-Inf -> None (null)."""
    if hasattr(x, "to_dict"):
        return to_jsonable(x.to_dict())
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return to_jsonable(x.item())
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return to_jsonable(np.asarray(x).tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def as_float(x: Any) -> float:
    """A logged number as a float; ``None`` (a NaN or Inf written as null) -> NaN."""
    return math.nan if x is None else float(x)


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class DamagedLog(ValueError):
    """metrics.jsonl cannot be read as a run's log: a damaged line, not a regular file, too big."""


#: The largest metrics.jsonl any reader loads (bytes): a row of the tiny model is
#: about 5 KB, so this holds some 400,000 logged steps.  Read line by line: memory
#: holds the rows, never the file's lines at once.
MAX_LOG_BYTES = 2 << 30

#: Bytes a reader takes from the file at a time.
_CHUNK = 1 << 20

#: The longest line a reader takes (bytes): a row with every per-site statistic of
#: a large model is some hundreds of KB.
MAX_LINE_BYTES = 16 << 20

#: A run's log as training writes it, then its gzipped copy (committed results keep
#: that one, written by :func:`write_gz`).
LOG_NAMES = ("metrics.jsonl", "metrics.jsonl.gz")

#: The largest step a row may name: steps are counted in int32 (the train state's step).
MAX_STEP = 2**31 - 1


def row_problem(row: Any) -> str | None:
    """Why ``row`` (a parsed line) is not a metrics row, or None when it is one.

    A row is a JSON object with an integer ``"step"`` in [0, MAX_STEP] and
    numbers (or null, a NaN or Inf written by the writer) as every other value.
    """
    if not isinstance(row, dict):
        return "not a JSON object"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return 'no integer "step"' if step is None else f'"step" is {step!r}, not an integer'
    if not 0 <= step <= MAX_STEP:
        return f'"step" {step} is outside [0, {MAX_STEP}]'
    for k, v in row.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            return f"{k!r} is {type(v).__name__}, not a number"
        # An integer beyond float64's range would overflow where it is read as a float.
        if isinstance(v, int) and abs(v) > sys.float_info.max:
            return f"{k!r} is an integer beyond float64's range"
    return None


def find_log(run_dir: str | Path) -> Path | None:
    """The log of the run in ``run_dir``: its metrics.jsonl, else its metrics.jsonl.gz, else None.

    Anything of that name counts (a FIFO too): the reader refuses what is not
    a regular file, in one line, instead of it being passed over unsaid.
    """
    for name in LOG_NAMES:
        p = Path(run_dir) / name
        if os.path.lexists(p):
            return p
    return None


@contextmanager
def _open_log(path: Path) -> Iterator[BinaryIO | None]:
    """The log at ``path`` opened for reading its (decompressed) bytes; None when it does not
    exist.

    Opened without blocking and checked before reading: a FIFO or a device
    (a symlink to /dev/zero) is refused instead of hanging or filling memory;
    a plain file larger than MAX_LOG_BYTES is refused unread.  A ``.gz``
    path is decompressed as it is read (:func:`_lines` bounds what it
    expands to).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        yield None
        return
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise DamagedLog(f"{path} is not a regular file: give the run's own metrics.jsonl")
        if path.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="rb") as z:
                yield z
            return
        if st.st_size > MAX_LOG_BYTES:
            raise DamagedLog(_too_large(path, gzipped=False))
        yield f


def _too_large(path: Path, gzipped: bool) -> str:
    what = "decompresses to more than" if gzipped else "is larger than"
    return f"{path} {what} the {MAX_LOG_BYTES:,} bytes a metrics log may hold: not a run's log"


_NONBLANK = re.compile(rb"\S")


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of each non-blank line of the log at ``path`` (with its newline;
    the last one maybe without).

    Read in chunks of ``_CHUNK`` bytes and scanned in C: memory holds a chunk
    and one line, and runs of blank lines cost no Python step each, whatever
    the file holds.  DamagedLog when the log holds more than MAX_LOG_BYTES
    (decompressed), a line longer than MAX_LINE_BYTES, or is not complete
    gzip data.
    """
    gzipped = path.name.endswith(".gz")
    total = 0
    try:
        with _open_log(path) as f:
            if f is None:
                return
            buf, start, number, eof = b"", 0, 1, False  # buf[start] begins line `number`
            while True:
                m = _NONBLANK.search(buf, start)
                # Skip the blank lines before the next non-blank byte (or the end of buf).
                stop = len(buf) if m is None else m.start()
                last_nl = buf.rfind(b"\n", start, stop)
                if last_nl >= 0:
                    number += buf.count(b"\n", start, last_nl + 1)
                    start = last_nl + 1
                end = -1 if m is None else buf.find(b"\n", m.start())
                # The line so far (all of it when its newline is in buf) against the cap.
                if (len(buf) if end < 0 else end) - start > MAX_LINE_BYTES:
                    raise DamagedLog(
                        f"{path} line {number} is longer than the {MAX_LINE_BYTES:,} bytes a "
                        "row may hold: not a run's log"
                    )
                if end >= 0:
                    yield number, buf[start : end + 1]
                    number, start = number + 1, end + 1
                    continue
                if eof:
                    if m is not None:
                        yield number, buf[start:]
                    return
                chunk = f.read(_CHUNK)
                total += len(chunk)
                if total > MAX_LOG_BYTES:
                    raise DamagedLog(_too_large(path, gzipped))
                buf, start, eof = buf[start:] + chunk, 0, not chunk
    # OSError: not gzip data (BadGzipFile); EOFError: cut short; zlib.error: corrupt.
    except (OSError, EOFError, zlib.error) as e:
        if not gzipped:
            raise
        raise DamagedLog(
            f"{path} is not complete gzip data ({e}); recompress the run's "
            "metrics.jsonl (gzip -n) or delete the file"
        ) from None


def _parse_jsonl(path: Path, strict: bool = True) -> tuple[list[dict], bool, list[str]]:
    """(rows, whether the last line is torn, skipped).

    A last line that is not JSON is torn (a kill during a write).  Any other
    malformed line raises :class:`DamagedLog` when ``strict``; otherwise it
    is left out and described in ``skipped`` ("line N: why").  Read line by
    line (:func:`_lines`): a line that is not JSON is judged when the next
    non-empty line arrives (then it is not the last) or at the end (torn).
    """
    rows: list[dict] = []
    skipped: list[str] = []
    # (line number, why) of a line that is not JSON, until it is known to be the last.
    pending: tuple[int, str] | None = None

    def damaged(n: int, problem: str) -> None:
        if strict:
            raise DamagedLog(
                f"{path} line {n} is damaged ({problem}); repair or delete that line, "
                "then run the command again"
            )
        skipped.append(f"line {n}: {problem}")

    for n, line in _lines(path):
        if pending is not None:
            damaged(pending[0], pending[1])
            pending = None
        try:
            row = json.loads(line)
        # RecursionError: a line nested deeper than the parser goes.
        except (ValueError, RecursionError) as e:
            pending = (n, f"not a JSON object: {e}")
        else:
            problem = row_problem(row)
            if problem is None:
                rows.append(row)
            else:
                damaged(n, problem)
    # Only the last line can be torn by a kill during a write.
    return rows, pending is not None, skipped


def _jsonl(rows: list[dict]) -> str:
    """Rows as the log holds them: one ``json.dumps`` line each."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def write_gz(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as a gzipped log at ``path`` (e.g. ``<run>/metrics.jsonl.gz``).

    The same rows give the same bytes: the gzip header holds no time and no
    file name (mtime 0, as ``gzip -n``), so rewriting an unchanged log changes
    nothing git sees.  Written beside and renamed into place.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f, gzip.GzipFile("", "wb", 9, fileobj=f, mtime=0) as z:
        z.write(_jsonl(rows).encode())
    tmp.replace(path)
    return path


def read_jsonl(
    path: str | Path, say: Callable[[str], None] | None = None, *, skip_malformed: bool = False
) -> list[dict]:
    """Rows of a metrics.jsonl (or metrics.jsonl.gz) for a reader (summaries, comparisons, plots).

    ``path`` names the log; a ``metrics.jsonl`` that does not exist is read
    from its gzipped copy ``metrics.jsonl.gz`` beside it when there is one
    (the committed results keep their logs gzipped).  A torn last line (a
    kill during a write) is left out.  A malformed line
    before it (see :func:`row_problem`) raises :class:`DamagedLog` naming the
    file and the line, or with ``skip_malformed`` is left out.  What was left
    out is said in one line through ``say`` (default: a warning).  A file
    that is not a regular file, or is larger than MAX_LOG_BYTES, raises
    DamagedLog without being read.
    """
    p = Path(path)
    if p.name == LOG_NAMES[0] and not os.path.lexists(p):
        p = find_log(p.parent) or p
    rows, torn, skipped = _parse_jsonl(p, strict=not skip_malformed)
    if torn:
        skipped.append("a torn last line")
    if skipped:
        more = f" (+{len(skipped) - 3} more)" if len(skipped) > 3 else ""
        line = f"{p}: skipped {'; '.join(skipped[:3])}{more}"
        if say is None:
            warnings.warn(line, stacklevel=2)
        else:
            say(line)
    return rows


class MetricsWriter:
    """Writes metrics.jsonl + TensorBoard scalars and prints the progress line.

    ``rows`` holds the run's rows up to now (those kept from before a resume,
    then every row written).  Only the ``primary`` writer (JAX process 0 of
    a multi-process run) writes files and prints; the others keep ``rows``
    alone, so every process summarizes the same log and the files hold each
    row once.
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        tokens_per_step: int,
        start_step: int = 0,
        tensorboard: bool = True,
        stream=None,
        growth_window: int = GROWTH_WINDOW,
        primary: bool = True,
    ):
        self.workdir = Path(workdir)
        self.growth_window = int(growth_window)
        # (step, amax) rows of each operand within the growth window.
        self._amax: dict[str, list[tuple[int, float]]] = {}
        self.primary = bool(primary)
        self.rows: list[dict] = []
        if self.primary:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "metrics.jsonl"
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.stream = stream if stream is not None else sys.stdout
        self._last_val: tuple[int, float] | None = None
        self._truncate_after(start_step)
        self._t0 = time.perf_counter()
        self._step0 = start_step
        self._tb = None
        if tensorboard and self.primary:
            self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=start_step)

    def _truncate_after(self, step: int) -> None:
        """Keep rows up to ``step`` (none for a fresh run); drop a torn last line, saying so."""
        rows, torn, _ = _parse_jsonl(self.path)
        keep = [r for r in rows if 0 < step and r.get("step", 0) <= step]
        self.rows = [dict(r) for r in keep]
        for r in keep:
            self._remember_amax(int(r.get("step", 0)), r)
        vals = [r for r in keep if "val_loss" in r]
        if vals:
            self._last_val = (int(vals[-1]["step"]), as_float(vals[-1]["val_loss"]))
        if not self.primary:
            return
        if torn:
            print(
                f"warning: {self.path}: dropped a torn last line (the run was killed while "
                "writing it)",
                file=self.stream,
                flush=True,
            )
        if len(keep) != len(rows) or torn:
            # Renamed into place: another process reading the log sees the old
            # or the new file, never half of one.
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(_jsonl(keep))
            tmp.replace(self.path)

    def _remember_amax(self, step: int, row: dict) -> None:
        for k, v in row.items():
            if k.startswith("layers/") and k.endswith("/amax"):
                hist = self._amax.setdefault(k, [])
                hist.append((step, as_float(v)))
                # Keep what the next rows' windows can still reach.
                while hist and hist[0][0] < step - self.growth_window:
                    hist.pop(0)

    def _growth(self, step: int, row: dict) -> dict[str, float]:
        """``<site>/amax_growth`` of every per-site amax in ``row`` (before it is remembered)."""
        out = {}
        for k, v in row.items():
            if k.startswith("layers/") and k.endswith("/amax"):
                window = [
                    a for s, a in self._amax.get(k, []) if step - self.growth_window <= s < step
                ]
                out[k + "_growth"] = amax_growth(as_float(v), window)
        return out

    def reset_clock(self, step: int) -> None:
        """Start the steps/s clock at ``step`` (call after compilation)."""
        self._t0 = time.perf_counter()
        self._step0 = step

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (e.g. an evaluation) out of the steps/s clock."""
        self._t0 += seconds

    def rates(self, step: int) -> tuple[float, float]:
        dt = time.perf_counter() - self._t0
        done = step - self._step0
        sps = done / dt if dt > 0 and done > 0 else float("nan")
        return sps, sps * self.tokens_per_step

    def write(self, step: int, scalars: dict[str, float]) -> dict[str, float]:
        """Append one row (floats in memory, NaN/Inf as null in the file); no printing."""
        row: dict[str, Any] = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        row.update(self._growth(int(step), row))
        self._remember_amax(int(step), row)
        sps, tps = self.rates(step)
        if "loss" in row and math.isfinite(sps):
            row.setdefault("steps_per_s", sps)
            row.setdefault("tokens_per_s", tps)
        self.rows.append(dict(row))
        if self.primary:
            with self.path.open("a") as f:
                f.write(json.dumps(to_jsonable(row), allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if "val_loss" in row:
            self._last_val = (int(step), row["val_loss"])
        return row

    def progress(self, step: int, loss: float) -> str:
        """Print the step's progress line: loss, latest val loss @ its step, rates, ETA."""
        sps, tps = self.rates(step)
        eta = (self.total_steps - step) / sps if math.isfinite(sps) and sps > 0 else float("nan")
        parts = [f"step {step}/{self.total_steps}", f"loss {loss:.4f}"]
        if self._last_val is not None:
            val_step, val = self._last_val
            parts.append(f"val {val:.4f} @{val_step}")
        parts.append(f"{sps:.2f} steps/s" if math.isfinite(sps) else "- steps/s")
        parts.append(f"{tps:,.0f} tok/s" if math.isfinite(tps) else "- tok/s")
        parts.append(f"ETA {format_duration(eta)}")
        line = " | ".join(parts)
        if self.primary:
            print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def write_config(workdir: str | Path, config: Any, extra: dict | None = None) -> Path:
    """config.json: the config plus run facts (corpus fingerprint, param count...).

    Written to a temporary file and renamed, so a kill never leaves half a file.
    """
    p = Path(workdir) / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": to_jsonable(config), **to_jsonable(extra or {})}
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(p)
    return p
