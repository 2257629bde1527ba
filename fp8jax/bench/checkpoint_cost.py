"""What checkpoint checksums cost at save and at restore, on a training config's state.

The state is the config's initial :class:`~fp8jax.train.state.TrainState`
(the shapes and dtypes every checkpoint of the run has; values do not change
the cost of hashing or writing them).  Per repeat, each timed once, in order:

* ``save_s``: orbax's save of the state (a checkpoint without checksums);
* ``record_s``: :func:`fp8jax.train.checksums.record`, what a save adds
  (hashing every array on the host);
* ``restore_s``: orbax's restore into the template plus the finiteness check
  (what a reader did before checksums);
* ``verify_s``: :func:`fp8jax.train.checksums.first_mismatch` on the restored
  state, what a reader adds;
* ``checkpointer_save_s`` / ``try_restore_s``: the checkpointer's whole save
  and checked restore, for reference (they also check free space and keep
  orbax's reader threads quiet).

The ratios are of medians over repeats: ``(save + record) / save`` and
``(restore + verify) / restore``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _timed(fn) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(config_path: str | Path, repeats: int = 5) -> dict[str, Any]:
    """Medians (s) of each part over ``repeats`` saves and restores, the state's bytes and
    the two ratios."""
    import jax
    import orbax.checkpoint as ocp

    from fp8jax.train import checksums
    from fp8jax.train.checkpoint import Checkpointer, all_finite
    from fp8jax.train.defaults import config_file
    from fp8jax.train.loop import setup

    config = config_file(str(config_path))
    times: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    with tempfile.TemporaryDirectory() as tmp:
        run = setup(config, Path(tmp) / "run")
        state = run.state
        ck = Checkpointer(Path(tmp) / "ckpt", keep=2 * repeats + 1)
        for i in range(repeats):
            plain = state._replace(step=np.int32(2 * i + 1))
            _, t = _timed(
                lambda s=plain: (
                    ck.manager.save(int(s.step), args=ocp.args.StandardSave(s), force=True),
                    ck.manager.wait_until_finished(),
                )
            )
            add("save_s", t)
            rec, t = _timed(lambda s=plain: checksums.record(s))
            add("record_s", t)
            checked = state._replace(step=np.int32(2 * i + 2))
            _, t = _timed(lambda s=checked: ck.save(s, force=True))
            add("checkpointer_save_s", t)

            def plain_restore(step=2 * i + 1):
                back = ck.restore(state, step)
                return back, all_finite(back)

            (back, finite), t = _timed(plain_restore)
            add("restore_s", t)
            mismatch, t = _timed(lambda b=back, r=rec: checksums.first_mismatch(b, r))
            add("verify_s", t)
            if mismatch is not None or not finite:
                raise RuntimeError(f"the state did not read back as saved: {mismatch}")
            (_, problem), t = _timed(lambda step=2 * i + 2: ck.try_restore(state, step))
            add("try_restore_s", t)
            if problem is not None:
                raise RuntimeError(f"the checked restore failed: {problem}")
        ck.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {
        "config": str(config_path),
        "repeats": repeats,
        "arrays": len(jax.tree.leaves(state)),
        "state_bytes": int(sum(np.asarray(a).nbytes for a in jax.tree.leaves(state))),
        "median_s": med,
        "save_ratio": (med["save_s"] + med["record_s"]) / med["save_s"],
        "restore_ratio": (med["restore_s"] + med["verify_s"]) / med["restore_s"],
    }


def report(r: dict[str, Any]) -> str:
    """The lines the benchmark prints."""
    m = r["median_s"]
    mb = r["state_bytes"] / 1e6
    return "\n".join(
        [
            f"{r['config']}: state of {r['arrays']} arrays, {mb:,.1f} MB; medians of "
            f"{r['repeats']} repeats",
            f"save:    orbax {m['save_s'] * 1e3:8.1f} ms + checksums {m['record_s'] * 1e3:7.1f} ms"
            f"  -> {r['save_ratio']:.3f}x  (checkpointer's whole save "
            f"{m['checkpointer_save_s'] * 1e3:.1f} ms)",
            f"restore: orbax {m['restore_s'] * 1e3:8.1f} ms + checksums {m['verify_s'] * 1e3:7.1f} ms"
            f"  -> {r['restore_ratio']:.3f}x  (checkpointer's checked restore "
            f"{m['try_restore_s'] * 1e3:.1f} ms)",
        ]
    )
