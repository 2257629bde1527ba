"""Pack committed results as summaries: ``python scripts/pack_results.py [DIR ...]``.

A comparison folder under ``experiments/results`` keeps what a reader reads
(README, results.md, results.json with every per-seed value, the plots, the
command) and, per run, ``runs/<label>/seed<k>/``:

* ``metrics.jsonl.gz``: the run's log with the run-level columns of every
  logged step (loss, val_loss, grad_norm, lr, tokens_per_s, the ``fp8/...``
  aggregates: everything :func:`fp8jax.train.loop.summarize`, the comparison
  tables and the loss plots read), gzipped with no time or name in the header
  (:func:`fp8jax.train.run_log.write_gz`), so the same rows give the same
  bytes.  The per-site columns (``layers/<site>/<stat>``, some 95% of a log)
  are left out; the rerun command in the README writes them again.
* ``config.json``: the run's config and provenance (commit, GEMM paths,
  machine), the same JSON on one line.

Plots are stored as 256-colour palette PNGs (a third of the size; the plots
have a few thousand colours, almost all antialiasing blends).  Each step
leaves what is already packed as it is, so a second pass changes no byte.
Prints the bytes of each DIR (default: experiments/results) before and after.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from fp8jax.train.run_log import LOG_NAMES, find_log, read_jsonl, write_gz

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"

#: Columns of a per-run log that committed results do not keep (per-site telemetry).
PER_SITE = "layers/"


def run_level(rows: list[dict]) -> list[dict]:
    """``rows`` without their per-site columns (a row left with its step alone is dropped)."""
    kept = [{k: v for k, v in r.items() if not k.startswith(PER_SITE)} for r in rows]
    return [r for r in kept if len(r) > 1]


def pack_run(run: Path) -> None:
    """Write ``run``'s log as metrics.jsonl.gz (run-level columns) and its config on one line."""
    log = find_log(run)
    rows = run_level(read_jsonl(log))
    gz = run / LOG_NAMES[1]
    # Rewritten only when the rows differ: an unchanged log keeps its bytes.
    if log != gz or rows != read_jsonl(gz):
        write_gz(gz, rows)
    if log != gz:
        log.unlink()
    config = run / "config.json"
    if config.is_file():
        text = json.dumps(json.loads(config.read_text()), separators=(",", ":")) + "\n"
        if config.read_text() != text:
            config.write_text(text)


def pack_plot(png: Path) -> None:
    """Store an RGB(A) plot as a 256-colour palette PNG (already packed: left as it is)."""
    from PIL import Image

    with Image.open(png) as im:
        if im.mode == "P":
            return
        if im.mode == "RGBA" and im.getchannel("A").getextrema()[0] < 255:
            return  # transparent pixels: a palette would flatten them
        # Median cut, no dithering: flat plot colours stay flat.
        q = im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=0)
    buf = io.BytesIO()
    q.save(buf, "PNG", optimize=True)
    if len(buf.getvalue()) < png.stat().st_size:
        png.write_bytes(buf.getvalue())


def size(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pack(folder: Path) -> None:
    """Pack every run (a folder with a log, below a ``runs/`` folder) and plot under ``folder``."""
    runs = sorted({m.parent for name in LOG_NAMES for m in folder.rglob(name) if "runs" in m.parts})
    for run in runs:
        pack_run(run)
    for png in sorted(folder.rglob("*.png")):
        pack_plot(png)


def main(argv: list[str]) -> int:
    for raw in argv or [str(RESULTS)]:
        folder = Path(raw)
        before = size(folder)
        pack(folder)
        print(f"{folder}: {before:,} -> {size(folder):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
