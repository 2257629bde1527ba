"""Checks of a training config against the machine, before anything is allocated.

:func:`fp8jax.train.defaults.validate` checks a config on its own; these
checks need the devices (so they run after ``jax.distributed`` is set up) and
raise the same one-line :class:`~fp8jax.train.defaults.ConfigError`:

* the mesh sizes must multiply to the device count (:func:`resolve_mesh`);
* every batch must split over the mesh's devices (:func:`check_batches`);
* the tokens and float32 logits of one step must fit in memory
  (:func:`check_memory`).  That is a lower bound of what a step needs (the
  activations and parameters come on top), so a refused config cannot have
  fitted, and a batch a million times too large is refused in one line
  instead of failing in a numpy allocation.

:func:`mesh_facts` names what a run resolved (mesh, device and process
counts) for its output and ``config.json``.
"""

from __future__ import annotations

import math

import jax
import ml_collections

from fp8jax import host_memory
from fp8jax.models import ModelConfig
from fp8jax.parallel.mesh import AXES, axis_sizes
from fp8jax.train.defaults import ConfigError
from fp8jax.train.fields import size_text

SIMULATE_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count=N"


def _mesh_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{a}={sizes[a]}" for a in AXES)


def resolve_mesh(config: ml_collections.ConfigDict, n_devices: int | None = None) -> dict[str, int]:
    """``{axis: size}`` of ``config.mesh`` on ``n_devices`` (default: every device).

    ConfigError when the sizes cannot multiply to the device count, naming the
    fix and how to simulate devices on a CPU.
    """
    n = jax.device_count() if n_devices is None else int(n_devices)
    asked = {a: int(config.mesh[a]) for a in AXES}
    try:
        return axis_sizes(asked, n)
    except ValueError as e:
        known = math.prod(s for s in asked.values() if s > 0)
        if any(s == 0 or s < -1 for s in asked.values()) or list(asked.values()).count(-1) > 1:
            why = str(e)
        elif -1 in asked.values():
            why = f"the other axes use {known} devices, which does not divide the {n} available"
        else:
            why = f"it uses {known} devices but {n} are available"
        raise ConfigError(
            f"mesh {_mesh_text(asked)} does not fit this machine: {why}; make the sizes "
            f"multiply to {n} (one of --config.mesh.data/fsdp/expert may be -1: the rest), "
            f"or on a CPU simulate N devices with {SIMULATE_DEVICES}"
        ) from None


def check_batches(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> None:
    """ConfigError unless batch_size (and eval_batch_size, when evaluating) split over the mesh.

    One message names every batch field that does not split, each with a fix.
    """
    n = math.prod(sizes.values())
    names = ["batch_size"] + (["eval_batch_size"] if int(config.eval_batches) > 0 else [])
    bad = [(name, int(config[name])) for name in names if int(config[name]) % n]
    if not bad:
        return
    what = " and ".join(f"{name} {b}" for name, b in bad)
    verb = "does" if len(bad) == 1 else "do"
    fixes = " ".join(f"--config.{name}={max(n, b // n * n)}" for name, b in bad)
    raise ConfigError(
        f"{what} {verb} not split over the {n} devices of mesh {_mesh_text(sizes)}: use "
        f"{'a multiple' if len(bad) == 1 else 'multiples'} of {n}, e.g. {fixes}"
    )


def available_memory() -> int | None:
    """Bytes one device can hold: the accelerator's limit, or the host's available RAM (CPU)."""
    dev = jax.local_devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return int(limit) if limit else None
    return host_memory.available_memory()


def step_memory_lower_bound(
    config: ml_collections.ConfigDict, mcfg: ModelConfig, seq: int, n_devices: int
) -> tuple[int, int]:
    """(host bytes, bytes per device) that one step needs at least.

    Host: the training batch (int32 tokens plus the int64 window indices that
    gather it) and the validation set.  Device: float32 logits of one
    microbatch and their gradient, and the logits of one evaluation batch,
    split over the devices.
    """
    b, bv = int(config.batch_size), int(config.eval_batch_size)
    n_val = int(config.eval_batches)
    host = b * seq * (4 + 8) + n_val * bv * seq * (4 + 8)
    micro = b // max(int(config.microbatches), 1)
    # float32 logits [rows, seq, vocab]: forward value and its gradient.
    device = (2 * micro + (bv if n_val else 0)) * seq * mcfg.vocab_size * 4 // max(n_devices, 1)
    return host, device


def check_memory(
    config: ml_collections.ConfigDict,
    mcfg: ModelConfig,
    seq: int,
    n_devices: int,
    available: int | None = None,
) -> None:
    """ConfigError when :func:`step_memory_lower_bound` exceeds the memory there is.

    On a CPU the host and the devices share the same RAM, so both count.
    """
    avail = available_memory() if available is None else available
    if not avail:
        return
    host, device = step_memory_lower_bound(config, mcfg, seq, n_devices)
    on_cpu = jax.local_devices()[0].platform == "cpu"
    need = host + device * jax.local_device_count() if on_cpu else device
    if need > avail:
        where = "this machine has" if on_cpu else "a device holds"
        raise ConfigError(
            f"batch_size {config.batch_size} x seq_len {seq} (eval {config.eval_batches} x "
            f"{config.eval_batch_size}) needs more than {size_text(need)} for its tokens and logits "
            f"alone, but {where} {size_text(avail)}: lower --config.batch_size or "
            "--config.eval_batch_size, or raise --config.microbatches"
        )


def mesh_facts(sizes: dict[str, int]) -> dict:
    """What a run resolved: mesh sizes, device and process counts, platform."""
    return {
        "mesh": dict(sizes),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "platform": jax.devices()[0].platform,
    }


def mesh_line(facts: dict) -> str:
    """One line for the run's output: 'mesh data=8 x fsdp=1 x expert=1 on 8 cpu devices, ...'."""
    return (
        f"mesh {_mesh_text(facts['mesh'])} on {facts['device_count']} {facts['platform']} "
        f"device(s), {facts['process_count']} process(es)"
    )
