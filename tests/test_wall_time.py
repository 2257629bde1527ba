"""Wall time round-robin (``fp8jax.wall_time``): the call order, the counts, bad counts refused."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from fp8jax import wall_time


def test_time_calls_round_robin_keeps_state():
    order = []

    def make(name):
        def f(x):
            order.append(name)
            return x + 1

        return f

    x = jnp.zeros((4,))
    t = wall_time.time_calls(
        {"a": (make("a"), (x,)), "b": (make("b"), (x,))}, warmup=1, iters=3, min_sample_s=0.0
    )
    assert set(t) == {"a", "b"}
    for v in t.values():
        assert v["inner"] == 1 and v["iters"] == 3
        assert 0 < v["min_s"] <= v["median_s"] <= v["max_s"]
    # warmup + first timing per case, then the samples alternate a, b, a, b, ...
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 3


def test_time_call_rejects_bad_counts():
    with pytest.raises(ValueError):
        wall_time.time_call(lambda: jnp.zeros(()), (), iters=0)
    with pytest.raises(ValueError):
        wall_time.time_call(lambda: jnp.zeros(()), (), warmup=-1)
