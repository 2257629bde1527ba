"""Run logs: metrics.jsonl, config.json, TensorBoard events, a progress line.

* ``<workdir>/config.json``: the run's config (written once, at the start).
* ``<workdir>/metrics.jsonl``: one JSON object per logged step
  (``{"step": ..., "loss": ..., ...}``; validation rows carry ``val_loss``).
  On resume, rows beyond the restored step are dropped first, so the file
  reads like the log of one uninterrupted run.
* ``<workdir>/tb/``: TensorBoard event files (tensorboardX), same scalars.
* stdout: ``step 120/400 | loss 2.3456 | val 2.4012 | 4.1 steps/s | 2,100 tok/s | ETA 1m08s``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def to_jsonable(x: Any) -> Any:
    """ConfigDict / numpy / jax values -> plain JSON types."""
    if hasattr(x, "to_dict"):
        return to_jsonable(x.to_dict())
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        a = np.asarray(x)
        return a.item() if a.ndim == 0 else a.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def read_jsonl(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Writes metrics.jsonl + TensorBoard scalars and prints the progress line."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        tokens_per_step: int,
        start_step: int = 0,
        tensorboard: bool = True,
        print_every: int = 1,
        stream=None,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / "metrics.jsonl"
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.print_every = max(int(print_every), 1)
        self.stream = stream if stream is not None else sys.stdout
        self._truncate_after(start_step)
        self._t0 = time.perf_counter()
        self._step0 = start_step
        self._last_val: float | None = None
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=start_step)

    def _truncate_after(self, step: int) -> None:
        rows = read_jsonl(self.path)
        keep = [r for r in rows if r.get("step", 0) <= step]
        if len(keep) != len(rows) or (step == 0 and rows):
            if step == 0:
                keep = []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in keep))

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

    def write(self, step: int, scalars: dict[str, Any]) -> dict:
        row = {"step": int(step), **{k: to_jsonable(v) for k, v in scalars.items()}}
        sps, tps = self.rates(step)
        if "loss" in row and math.isfinite(sps):
            row.setdefault("steps_per_s", sps)
            row.setdefault("tokens_per_s", tps)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if "val_loss" in row:
            self._last_val = row["val_loss"]
        if "loss" in row and (step % self.print_every == 0 or step == self.total_steps):
            self.progress(step, row["loss"])
        elif "val_loss" in row and "loss" not in row:
            self.progress(step, None)
        return row

    def progress(self, step: int, loss: float | None) -> str:
        sps, tps = self.rates(step)
        eta = (self.total_steps - step) / sps if math.isfinite(sps) and sps > 0 else float("nan")
        parts = [f"step {step}/{self.total_steps}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if self._last_val is not None:
            parts.append(f"val {self._last_val:.4f}")
        parts.append(f"{sps:.2f} steps/s" if math.isfinite(sps) else "- steps/s")
        parts.append(f"{tps:,.0f} tok/s" if math.isfinite(tps) else "- tok/s")
        parts.append(f"ETA {format_duration(eta)}")
        line = " | ".join(parts)
        print(line, file=self.stream, flush=True)
        return line

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def write_config(workdir: str | Path, config: Any, extra: dict | None = None) -> Path:
    """config.json: the config plus run facts (corpus fingerprint, param count...)."""
    p = Path(workdir) / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    payload = {"config": to_jsonable(config), **to_jsonable(extra or {})}
    p.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return p
