"""What made a run: the code (commit, clean tree), the machine, and the GEMM paths it ran.

Every run stores this record in its ``config.json`` (key ``provenance``), and
comparisons refuse to tabulate runs whose records disagree on the code
(:func:`check_same_code`).  What "reproduces" means here:

* bit for bit: the same commit, a clean tree, the same machine type (CPU
  model and instruction-set flags, or GPU) and the same jax / jaxlib / XLA
  flags give the same metrics, step by step;
* across machines: per-seed values differ (CPU kernels round differently
  in the last bits, and training amplifies that; on a CPU without bfloat16
  dot instructions "auto" also resolves another GEMM path, which the record
  names), so a rerun reproduces a comparison when its per-seed paired gaps
  fall inside the committed distribution
  (``fp8jax.lab.compare.reproduction_check``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax

from fp8jax import host_cpu, path_record
from fp8jax.train.defaults import ConfigError

# Instruction-set flags that change which CPU kernels XLA and numpy pick.
_ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
)
_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes", "flax", "optax")


def git_state(root: str | Path | None = None) -> dict | None:
    """Commit and cleanliness of the source tree (None outside a git checkout).

    ``dirty`` lists tracked files with uncommitted changes anywhere in the
    tree (code, configs, scripts): a run made from such a tree cannot be
    traced back to a commit.
    """
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    dirty = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": commit, "dirty": dirty}


def require_clean_tree(allow_mixed_code: bool = False) -> dict | None:
    """The git state, or ConfigError if the tree is modified or not a checkout.

    A comparison's runs come from one commit and a clean tree;
    ``allow_mixed_code`` lets a scratch comparison run anyway (its table then
    says so from the recorded state).
    """
    here = git_state()
    if not allow_mixed_code and (here is None or here["dirty"]):
        where = "no git checkout" if here is None else f"uncommitted changes in {here['dirty']}"
        raise ConfigError(
            f"a comparison runs from one commit and a clean tree, and this tree has {where}: "
            "commit first, then run (or pass --allow_mixed_code for a scratch comparison)"
        )
    return here


def _cpu() -> dict[str, Any]:
    fields = host_cpu.cpu_fields()
    flags = host_cpu.cpu_flags()
    # Marketing names can be vague ("AMD EPYC"); family / model / stepping are not.
    ident = "/".join(fields.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return {
        "model": host_cpu.cpu_model(),
        "family_model_stepping": ident,
        "isa": [f for f in _ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
    }


def machine() -> dict[str, Any]:
    """The machine and software a run's numbers depend on."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    devices = jax.devices()
    return {
        "cpu": _cpu(),
        "backend": jax.default_backend(),
        "devices": sorted({d.device_kind for d in devices}),
        "device_count": len(devices),
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": versions,
    }


def machine_type(record: dict) -> str:
    """One line naming what per-seed bit-for-bit reproduction needs to be equal."""
    cpu = record["cpu"]
    devices = ", ".join(record["devices"])
    versions = record["versions"]
    return (
        f"{cpu['model']} {cpu.get('family_model_stepping', '')} ({' '.join(cpu['isa'])}); "
        f"{record['backend']} {devices}; "
        f"jax {versions.get('jax')} jaxlib {versions.get('jaxlib')}"
        + (f"; XLA_FLAGS={record['xla_flags']}" if record["xla_flags"] else "")
    )


def gemm_paths(fn: Callable, *args: Any) -> dict[str, str]:
    """Trace ``fn(*args)`` (abstractly: no compilation, no FLOPs) and return its GEMM paths.

    ``{"dense/fprop": "chunked", "expert/wgrad": "plain bfloat16", ...}``: the
    implementation every GEMM of the traced computation resolved to (see
    ``fp8jax.path_record``).  Call it on a function that has not been traced
    with these argument shapes before, or JAX reuses that trace and nothing
    is reported.
    """
    with path_record.recording() as paths:
        jax.eval_shape(fn, *args)
    return path_record.as_table(paths)


def record(fn: Callable | None = None, *args: Any) -> dict[str, Any]:
    """The provenance of a run: git state, machine and (given a step function) GEMM paths."""
    out: dict[str, Any] = {"git": git_state(), "machine": machine()}
    if fn is not None:
        out["gemm_paths"] = gemm_paths(fn, *args)
    return out


def paths_text(paths: dict[str, str]) -> str:
    """A run's GEMM paths in one short phrase: one path, or the keys each path serves."""
    if not paths:
        return "?"
    by_path: dict[str, list[str]] = {}
    for key, path in paths.items():
        by_path.setdefault(path, []).append(key)
    if len(by_path) == 1:
        return next(iter(by_path))
    return "; ".join(f"{', '.join(keys)}: {path}" for path, keys in by_path.items())


def check_same_code(records: dict[str, dict]) -> list[str]:
    """Problems that stop runs from being tabulated together (empty: one commit, clean).

    ``records`` maps a run's name to its provenance record.
    """
    problems = []
    commits: dict[str | None, list[str]] = {}
    for name, rec in records.items():
        git = (rec or {}).get("git")
        commits.setdefault(git["commit"] if git else None, []).append(name)
        if git and git.get("dirty"):
            problems.append(f"{name} ran from a modified tree ({', '.join(git['dirty'][:3])})")
    if None in commits:
        problems.append(f"{len(commits[None])} run(s) record no commit, e.g. {commits[None][0]}")
    known = [c for c in commits if c is not None]
    if len(known) > 1:
        parts = ", ".join(f"{c[:10]} ({len(commits[c])} runs)" for c in known)
        problems.append(f"runs come from {len(known)} commits: {parts}")
    return problems
