"""fp8jax.train.injection: the inject block, massive activations, the delayed-state stress."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.nn import taps
from fp8jax.train import injection
from fp8jax.train.defaults import ConfigError, tiny_config, validate


def _reference_inject(h, first, scale, count):
    h64 = np.asarray(h, np.float64)
    mag = np.float64(np.float32(np.median(np.abs(h64)))) * np.float32(scale)
    out = h64.copy()
    out[np.ix_(np.asarray(first), np.arange(count))] += np.float32(mag)
    return out


@pytest.mark.parametrize("jit", [False, True])
def test_inject_massive_matches_a_float64_reference(jit):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((6, 5)).astype(np.float32)
    first = np.array([True, False, False, True, False, False])
    fn = lambda h: injection.inject_massive(h, jnp.asarray(first), 1e3, 2)  # noqa: E731
    got = np.asarray((jax.jit(fn) if jit else fn)(jnp.asarray(h)), np.float64)
    np.testing.assert_allclose(got, _reference_inject(h, first, 1e3, 2), rtol=1e-6)
    # Rows that are not first tokens and channels past count are untouched.
    np.testing.assert_array_equal(got[~first], h[~first])
    np.testing.assert_array_equal(got[:, 2:], h[:, 2:])


def test_inject_massive_refuses_more_channels_than_the_site_has():
    with pytest.raises(ValueError, match="exceeds the site's 3 channels"):
        injection.inject_massive(jnp.ones((2, 3)), jnp.array([True, False]), 10.0, 4)


def test_site_is_the_identity_without_a_hook_and_hooks_close():
    x = jnp.arange(6.0).reshape(2, 3)
    first = jnp.array([True, False])
    assert taps.site("residual", x, first) is x and not taps.site_open("residual")
    with taps.injecting("residual", lambda h, f: h + 1):
        assert taps.site_open("residual") and not taps.site_open("ffn_hidden")
        np.testing.assert_array_equal(taps.site("residual", x, first), x + 1)
        assert taps.site("ffn_hidden", x, first) is x
    assert not taps.site_open("residual")
    with pytest.raises(ValueError, match="unknown activation site"):
        with taps.injecting("attention", lambda h, f: h):
            pass


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(massive_activation_scale=-1.0), "massive_activation_scale"),
        (dict(massive_activation_scale=float("nan")), "massive_activation_scale"),
        (dict(massive_activation_count=-2), "massive_activation_count"),
        (dict(massive_activation_site="attn"), "massive_activation_site"),
        (dict(fp8_reset_every=-1), "fp8_reset_every"),
        (dict(fp8_amax_growth=0.5), "fp8_amax_growth"),
        (dict(fp8_amax_growth=float("inf")), "fp8_amax_growth"),
        (dict(fp8_reset_everyy=3), "not a field"),
    ],
)
def test_bad_inject_blocks_are_config_errors(fields, match):
    c = tiny_config()
    c.inject = dict(fields)
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_a_config_without_inject_changes_nothing():
    assert injection.fp8_state_stress({}, None) is None
    assert injection.fp8_state_stress({}, injection.inject_block()) is None
    loss = lambda model, tokens: 0.0  # noqa: E731
    assert injection.with_injection(loss, None) is loss
    assert injection.with_injection(loss, injection.inject_block()) is loss
    validate(tiny_config())


def test_fp8_state_stress_divides_and_resets():
    fresh = {"amax": jnp.zeros(3), "scale": jnp.ones(())}
    new = {"amax": jnp.array([4.0, 8.0, 2.0]), "scale": jnp.float32(2.0)}
    grow = injection.fp8_state_stress(fresh, injection.inject_block(fp8_amax_growth=4.0))
    out = grow(new, jnp.int32(0))
    np.testing.assert_array_equal(out["amax"], np.array([1.0, 2.0, 0.5], np.float32))
    assert float(out["scale"]) == 0.5
    every = injection.fp8_state_stress(fresh, injection.inject_block(fp8_reset_every=3))
    # Step s stores the fresh state when (s + 1) is a multiple of 3.
    kept = [float(jax.jit(every)(new, jnp.int32(s))["scale"]) for s in range(6)]
    assert kept == [2.0, 2.0, 1.0, 2.0, 2.0, 1.0]


def test_with_injection_opens_the_site_while_the_loss_is_traced():
    seen = []

    def loss(model, tokens):
        seen.append(taps.site_open("ffn_hidden"))
        return jnp.sum(taps.site("ffn_hidden", tokens, jnp.array([True, False])))

    block = injection.inject_block(
        massive_activation_scale=10.0,
        massive_activation_count=1,
        massive_activation_site="ffn_hidden",
    )
    wrapped = injection.with_injection(loss, block)
    tokens = jnp.array([[1.0, 1.0], [1.0, 1.0]])
    # median |h| = 1: 10 is added to channel 0 of the first row.
    assert float(jax.jit(lambda t: wrapped(None, t))(tokens)) == 14.0
    assert seen == [True] and not taps.site_open("ffn_hidden")


def test_a_comparison_run_with_an_unknown_inject_field_is_a_config_error():
    from fp8jax.lab import compare
    from fp8jax.train.defaults import comparison_block

    c = tiny_config()
    c.compare = comparison_block(
        "t", dict(bf16=dict(recipe="bf16"), x=dict(recipe="bf16", inject=dict(growth=2.0))), ""
    )
    with pytest.raises(ConfigError, match="compare.runs.x: inject.growth is not a field"):
        compare.run_config(c, "x", 0)
