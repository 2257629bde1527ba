"""Checks of a config against the machine: mesh sizes, batch splits and a memory lower
bound each raise one ConfigError line naming the fix, before anything is allocated."""

import pytest

from fp8jax.models import ModelConfig
from fp8jax.train import preflight
from fp8jax.train.defaults import ConfigError, tiny_config


def _mesh(data, fsdp=1, expert=1):
    c = tiny_config()
    c.mesh.data, c.mesh.fsdp, c.mesh.expert = data, fsdp, expert
    return c


def test_mesh_resolves_the_rest_and_names_how_to_simulate_devices():
    assert preflight.resolve_mesh(_mesh(-1, 2), 8) == {"data": 4, "fsdp": 2, "expert": 1}
    assert preflight.resolve_mesh(_mesh(2, 2, 2), 8) == {"data": 2, "fsdp": 2, "expert": 2}
    with pytest.raises(ConfigError) as e:
        preflight.resolve_mesh(_mesh(3), 8)
    msg = str(e.value)
    assert "uses 3 devices but 8 are available" in msg and "multiply to 8" in msg
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="does not divide the 8 available"):
        preflight.resolve_mesh(_mesh(-1, 3), 8)
    with pytest.raises(ConfigError, match="at most one mesh size may be -1"):
        preflight.resolve_mesh(_mesh(-1, -1), 8)
    with pytest.raises(ConfigError, match="positive or -1"):
        preflight.resolve_mesh(_mesh(0), 8)


def test_batches_must_split_over_the_mesh():
    c = tiny_config()
    sizes = {"data": 8, "fsdp": 1, "expert": 1}
    preflight.check_batches(c, sizes)  # 8 and 8
    c.batch_size = 6
    with pytest.raises(ConfigError, match=r"batch_size 6 does not split over the 8 devices"):
        preflight.check_batches(c, sizes)
    c.batch_size, c.eval_batch_size = 16, 12
    with pytest.raises(ConfigError, match=r"--config.eval_batch_size=8"):
        preflight.check_batches(c, sizes)
    # Both wrong: one message names both, so the first fix is not refused for the other.
    c.batch_size, c.eval_batch_size = 6, 12
    with pytest.raises(ConfigError) as e:
        preflight.check_batches(c, sizes)
    assert str(e.value).startswith("batch_size 6 and eval_batch_size 12 do not split over the 8")
    assert str(e.value).endswith("--config.batch_size=8 --config.eval_batch_size=8")
    # Without evaluation the evaluation batch is never built.
    c.eval_batches, c.batch_size = 0, 16
    preflight.check_batches(c, sizes)


def test_memory_lower_bound_counts_tokens_and_logits():
    c = tiny_config()
    mcfg = ModelConfig.tiny()
    c.batch_size, c.microbatches, c.eval_batches, c.eval_batch_size = 8, 2, 3, 4
    host, device = preflight.step_memory_lower_bound(c, mcfg, 64, 2)
    # int32 tokens + int64 gather indices, training batch and validation set.
    assert host == 8 * 64 * 12 + 3 * 4 * 64 * 12
    # float32 logits (value and gradient) of one microbatch of 4, one eval batch of 4, /2.
    assert device == (2 * 4 + 4) * 64 * mcfg.vocab_size * 4 // 2
    preflight.check_memory(c, mcfg, 64, 1, available=10**9)
    c.batch_size = 10**12
    with pytest.raises(ConfigError) as e:
        preflight.check_memory(c, mcfg, 64, 1, available=10**9)
    assert "needs more than" in str(e.value) and "lower --config.batch_size" in str(e.value)


def test_mesh_line_names_mesh_devices_and_processes():
    facts = {
        "mesh": {"data": 2, "fsdp": 2, "expert": 2},
        "device_count": 8,
        "process_count": 1,
        "platform": "cpu",
    }
    line = preflight.mesh_line(facts)
    assert line == "mesh data=2 x fsdp=2 x expert=2 on 8 cpu device(s), 1 process(es)"
