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
  raises :class:`DamagedLog` (one line naming it), and nothing is rewritten.
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

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

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
    """A line of metrics.jsonl other than the last is not a JSON object."""


def _parse_jsonl(path: Path) -> tuple[list[dict], int | None]:
    """(rows, byte length of the complete lines if the last line is torn, else None)."""
    if not path.exists():
        return [], None
    blob = path.read_bytes()
    lines = blob.split(b"\n")
    rows: list[dict] = []
    offset = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if line.strip():
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                # Only the last line can be torn by a kill during a write.
                if last or all(not rest.strip() for rest in lines[i + 1 :]):
                    return rows, offset
                raise DamagedLog(
                    f"{path} line {i + 1} is damaged (not a JSON object: {e}); repair or delete "
                    "that line, then run the command again"
                ) from None
            rows.append(row)
        offset += len(line) + 1
    return rows, None


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl; a torn last line is skipped with a warning."""
    p = Path(path)
    rows, torn_at = _parse_jsonl(p)
    if torn_at is not None:
        warnings.warn(f"{p}: skipped a torn last line", stacklevel=2)
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
        rows, torn_at = _parse_jsonl(self.path)
        keep = [r for r in rows if 0 < step and r.get("step", 0) <= step]
        self.rows = [dict(r) for r in keep]
        for r in keep:
            self._remember_amax(int(r.get("step", 0)), r)
        vals = [r for r in keep if "val_loss" in r]
        if vals:
            self._last_val = (int(vals[-1]["step"]), as_float(vals[-1]["val_loss"]))
        if not self.primary:
            return
        if torn_at is not None:
            print(
                f"warning: {self.path}: dropped a torn last line (the run was killed while "
                "writing it)",
                file=self.stream,
                flush=True,
            )
        if len(keep) != len(rows) or torn_at is not None:
            # Renamed into place: another process reading the log sees the old
            # or the new file, never half of one.
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
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
