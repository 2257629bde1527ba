"""The device mesh: axes ("data", "fsdp", "expert"), processes and per-process batches.

* ``data``: pure data parallelism; parameters replicated.
* ``fsdp``: data parallelism with parameters, FP32 master weights and AdamW
  moments sharded (ZeRO-3); weights are gathered for use (in FP8 for FP8
  recipes, see :mod:`fp8jax.parallel.fsdp`) and gradients reduce-scattered.
* ``expert``: expert parallelism; routed experts are split over it and
  tokens travel to their experts' devices (see :mod:`fp8jax.parallel.dispatch`).

The batch axis of every token array is split over all three axes together
(``BATCH_SPEC``): each device holds global_batch / device_count sequences.

Sizes come from a config mapping ``{"data": d, "fsdp": f, "expert": e}``;
one size may be -1 meaning "the rest" (device_count / product of the
others).  The default ``{"data": -1, "fsdp": 1, "expert": 1}`` is data
parallelism over every device, which on one device is the plain
single-device run.

Several processes (multi-host GPU/TPU, or one process per GPU): call
:func:`maybe_initialize_distributed` before anything touches a JAX device.
It runs ``jax.distributed.initialize`` when the config's ``num_processes``
is > 1 or the environment names a coordinator (``JAX_COORDINATOR_ADDRESS``);
``jax.devices()`` then lists every process's devices and each process feeds
its own rows of the global batch (:func:`global_batch`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "expert")
# Tokens: the batch axis over every device (data, fsdp and expert shards all
# see different sequences).
BATCH_SPEC = P(AXES)
DEFAULT_SIZES = {"data": -1, "fsdp": 1, "expert": 1}


def axis_sizes(sizes: Mapping[str, int] | Sequence[int] | None, n_devices: int) -> dict[str, int]:
    """Resolve mesh sizes (one may be -1 = "the rest") to ``{axis: size}`` for ``n_devices``."""
    if sizes is None:
        sizes = DEFAULT_SIZES
    if isinstance(sizes, Mapping):
        unknown = set(sizes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; axes are {AXES}")
        raw = [int(sizes.get(a, 1)) for a in AXES]
    else:
        raw = [int(s) for s in sizes]
        if len(raw) != len(AXES):
            raise ValueError(f"mesh sizes must give {len(AXES)} values {AXES}, got {raw}")
    if raw.count(-1) > 1:
        raise ValueError(f"at most one mesh size may be -1, got {dict(zip(AXES, raw))}")
    if any(s == 0 or s < -1 for s in raw):
        raise ValueError(f"mesh sizes must be positive or -1, got {dict(zip(AXES, raw))}")
    known = math.prod(s for s in raw if s != -1)
    if -1 in raw:
        if n_devices % known:
            raise ValueError(
                f"{n_devices} devices do not split into {dict(zip(AXES, raw))} "
                f"({n_devices} is not a multiple of {known})"
            )
        raw[raw.index(-1)] = n_devices // known
    if math.prod(raw) != n_devices:
        raise ValueError(
            f"mesh {dict(zip(AXES, raw))} needs {math.prod(raw)} devices, {n_devices} available"
        )
    return dict(zip(AXES, raw))


def make_mesh(
    sizes: Mapping[str, int] | Sequence[int] | None = None, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ("data", "fsdp", "expert") mesh over ``devices`` (default: every device of every process).

    The axes are ``Auto``: jit's partitioner places the collectives of code
    written for one device; ``shard_map`` regions (dispatch, FP8 gathers)
    take over explicitly where the collective's precision matters.
    """
    devs = list(jax.devices() if devices is None else devices)
    shape = axis_sizes(sizes, len(devs))
    return jax.make_mesh(
        tuple(shape[a] for a in AXES),
        AXES,
        axis_types=(AxisType.Auto,) * len(AXES),
        devices=devs,
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [B, ...]: the batch axis split over every device of ``mesh``."""
    return NamedSharding(mesh, BATCH_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local_rows: np.ndarray, mesh: Mesh) -> jax.Array:
    """The global batch array from this process's rows (``jax.make_array_from_process_local_data``).

    Every process passes its own ``global_batch / process_count`` rows; on
    one process this is a ``device_put`` with the batch sharding.
    """
    local_rows = np.asarray(local_rows)
    n_local = mesh.local_mesh.size if jax.process_count() > 1 else mesh.size
    if local_rows.shape[0] % n_local:
        raise ValueError(
            f"this process's batch of {local_rows.shape[0]} rows does not split over its "
            f"{n_local} devices"
        )
    global_shape = (local_rows.shape[0] * jax.process_count(), *local_rows.shape[1:])
    return put_process_rows(local_rows, global_shape, mesh)


def process_rows(shape: Sequence[int], mesh: Mesh, batch_axis: int = 0) -> tuple[int, int]:
    """Rows ``lo:hi`` (along ``batch_axis``) of a global batch of ``shape`` this process feeds.

    The batch axis is split over every device of the mesh; a process feeds
    the contiguous rows its own devices hold (all of them on one process).
    """
    n = shape[batch_axis]
    if n % mesh.size:
        raise ValueError(
            f"a batch of {n} rows does not split over the mesh's {mesh.size} devices; "
            f"make it a multiple of {mesh.size}"
        )
    if jax.process_count() == 1:
        return 0, n
    sharding = NamedSharding(mesh, P(*([None] * batch_axis), AXES))
    rows = [
        idx[batch_axis] for idx in sharding.addressable_devices_indices_map(tuple(shape)).values()
    ]
    return min(r.start for r in rows), max(r.stop for r in rows)


def put_process_rows(
    local_rows: np.ndarray, shape: Sequence[int], mesh: Mesh, batch_axis: int = 0
) -> jax.Array:
    """The global batch of ``shape`` from this process's rows (:func:`process_rows`)."""
    sharding = NamedSharding(mesh, P(*([None] * batch_axis), AXES))
    if jax.process_count() == 1:
        return jax.device_put(local_rows, sharding)
    return jax.make_array_from_process_local_data(sharding, local_rows, tuple(shape))


def put_batch(full_rows: np.ndarray, mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """A global batch every process holds in full, split over ``mesh`` along ``batch_axis``.

    Each process hands over only the rows its own devices hold
    (``jax.make_array_from_process_local_data``); one process is a plain
    ``device_put``.
    """
    full_rows = np.asarray(full_rows)
    lo, hi = process_rows(full_rows.shape, mesh, batch_axis)
    local = np.take(full_rows, np.arange(lo, hi), axis=batch_axis)
    return put_process_rows(local, full_rows.shape, mesh, batch_axis)


def maybe_initialize_distributed(cfg: Mapping[str, Any] | None = None) -> bool:
    """Run ``jax.distributed.initialize`` when several processes are asked for; True if it ran.

    Asked for: ``cfg["num_processes"] > 1`` (with ``coordinator_address`` and
    ``process_id`` from the config, or from the environment /
    cluster auto-detection when absent), or ``JAX_COORDINATOR_ADDRESS`` set
    in the environment.  Must run before any JAX computation.
    """
    cfg = dict(cfg or {})
    n_proc = int(cfg.get("num_processes") or os.environ.get("JAX_NUM_PROCESSES", 1) or 1)
    coord = cfg.get("coordinator_address") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if n_proc <= 1 and not coord:
        return False
    if jax.distributed.is_initialized():
        return False
    pid = cfg.get("process_id")
    if pid is None and "JAX_PROCESS_ID" in os.environ:
        pid = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(
        coordinator_address=coord or None,
        num_processes=n_proc if n_proc > 1 else None,
        process_id=None if pid is None or pid < 0 else int(pid),
    )
    return True
