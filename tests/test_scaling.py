import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import ref_scale

import fp8jax
from fp8jax import scaling


def test_exact_div_matches_numpy_where_xla_rewrites():
    rng = np.random.default_rng(1)
    a = np.abs(rng.standard_normal(20000)).astype(np.float32) * 100
    got = np.asarray(jax.jit(lambda a: scaling.exact_div(a, jnp.float32(448.0)))(a))
    np.testing.assert_array_equal(got, a / np.float32(448.0))


@pytest.mark.parametrize("jit", [False, True])
def test_scale_from_amax(jit):
    # (float32 subnormal amaxes are flushed to zero by XLA: tested separately.)
    amax = np.array([0.0, 1e-37, 1.0, 448.0, 3.7, 1e30], np.float32)
    f = lambda a: scaling.scale_from_amax(a, fp8jax.E4M3)
    got = np.asarray((jax.jit(f) if jit else f)(jnp.asarray(amax)))
    ref = np.array([ref_scale(a, fp8jax.E4M3) for a in amax], np.float32)
    np.testing.assert_array_equal(got, ref)
    assert np.all(np.isfinite(got)) and np.all(got > 0)


def test_subnormal_amax_gives_a_usable_scale():
    s = float(scaling.scale_from_amax(jnp.float32(1e-40), fp8jax.E4M3))
    assert np.isfinite(s) and s > 0


def test_pow2_scales_round_up():
    amax = jnp.array([448.0, 449.0, 1.0, 0.3, 0.0], jnp.float32)
    s = np.asarray(scaling.scale_from_amax(amax, fp8jax.E4M3, pow2=True))
    np.testing.assert_array_equal(s, [1.0, 2.0, 2.0**-8, 2.0**-10, 1.0])
    assert np.all(np.asarray(amax) / s <= 448.0)


def test_amax_floor():
    s = scaling.scale_from_amax(jnp.float32(1e-8), fp8jax.E4M3, amax_floor=1e-4)
    assert float(s) == pytest.approx(1e-4 / 448.0, rel=1e-7)


def test_finite_amax_ignores_nonfinite():
    x = jnp.array([1.0, -3.0, jnp.inf, jnp.nan, -jnp.inf])
    assert float(scaling.finite_amax(x)) == 3.0


def test_delayed_update_max_and_most_recent():
    spec = fp8jax.QuantSpec("e4m3", "tensor", scaling="delayed")
    st = scaling.init_delayed_state(4)
    cfg = fp8jax.DelayedConfig(4, "max", 0)
    for a in [10.0, 448.0 * 2, 5.0]:
        st = scaling.update_delayed_state(st, jnp.float32(a), spec, cfg)
    np.testing.assert_array_equal(np.asarray(st.amax_history), [5.0, 896.0, 10.0, 0.0])
    assert float(st.scale) == pytest.approx(2.0)
    cfg_r = fp8jax.DelayedConfig(4, "most_recent", 1)
    st2 = scaling.update_delayed_state(st, jnp.float32(44.8), spec, cfg_r)
    assert float(st2.scale) == pytest.approx(0.1 * 2.0, rel=1e-6)
    # history_len=1 keeps only the newest amax
    st1 = scaling.update_delayed_state(
        scaling.init_delayed_state(1), jnp.float32(7.0), spec, fp8jax.DelayedConfig(1)
    )
    assert st1.amax_history.shape == (1,)


def test_merge_is_max_not_sum():
    a = scaling.DelayedState(jnp.array([3.0, 1.0]), jnp.float32(3.0 / 448))
    b = scaling.DelayedState(jnp.array([5.0, 1.0]), jnp.float32(5.0 / 448))
    m = scaling.merge_delayed_states(a, b)
    np.testing.assert_array_equal(np.asarray(m.amax_history), [5.0, 1.0])
    assert float(m.scale) == pytest.approx(5.0 / 448)


def test_delayed_requires_tensor_granularity():
    with pytest.raises(ValueError):
        fp8jax.QuantSpec("e4m3", "tile", scaling="delayed")
