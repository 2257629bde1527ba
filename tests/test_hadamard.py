import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_microscaling as ref

from fp8jax import hadamard


def test_hadamard_matrix_is_orthogonal_and_symmetric():
    for n in (1, 2, 4, 16, 32):
        h = hadamard.hadamard_matrix(n)
        np.testing.assert_array_equal(h @ h.T, n * np.eye(n))
        np.testing.assert_array_equal(h, h.T)
        assert set(np.unique(h)) <= {-1.0, 1.0}
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard_matrix(12)


def test_random_signs_seeded():
    s0 = np.asarray(hadamard.random_signs(0))
    assert s0.shape == (16,) and set(np.unique(s0)) == {-1.0, 1.0}
    np.testing.assert_array_equal(s0, np.asarray(hadamard.random_signs(0)))
    assert not np.array_equal(s0, np.asarray(hadamard.random_signs(1)))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("shape,axis", [((37, 5), 0), ((3, 50), -1), ((2, 19, 3), 1)])
def test_rht_bit_exact_vs_reference_and_matrix(shape, axis, jit):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    s = hadamard.random_signs(3)
    f = lambda v: hadamard.rht(v, s, axis)  # noqa: E731
    y = np.asarray((jax.jit(f) if jit else f)(jnp.asarray(x)))
    n = x.shape[axis]
    assert y.shape[axis] == n + (-n) % 16
    np.testing.assert_array_equal(y, ref.rht(x, np.asarray(s), axis))
    # Against the explicit matrix Q = H diag(s) / 4 in float64, per block.
    q = hadamard.hadamard_matrix(16) * np.asarray(s, np.float64)[None, :] / 4
    xm = np.moveaxis(x.astype(np.float64), axis, -1)
    xm = np.concatenate([xm, np.zeros(xm.shape[:-1] + ((-n) % 16,))], -1)
    want = (xm.reshape(xm.shape[:-1] + (-1, 16)) @ q.T).reshape(xm.shape)
    np.testing.assert_allclose(
        np.moveaxis(y, axis, -1), want, rtol=1e-6, atol=1e-6 * np.abs(x).max()
    )


def test_rht_cancels_in_float64_products():
    # Wgrad: dW = x^T dy contracts the token axis; transforming both operands
    # along it leaves the product unchanged (orthonormal blocks).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((45, 7)) * np.exp2(rng.integers(-8, 8, (45, 1)))
    dy = rng.standard_normal((45, 5))
    x[3, 2] = 1e4  # an outlier
    with jax.enable_x64(True):
        s = hadamard.random_signs(11).astype(jnp.float64)
        xt = hadamard.rht(jnp.asarray(x), s, axis=0)
        dyt = hadamard.rht(jnp.asarray(dy), s, axis=0)
        assert xt.dtype == jnp.float64
        dw = np.asarray(xt.T @ dyt)
        back = np.asarray(hadamard.inverse_rht(xt, s, axis=0))
    np.testing.assert_allclose(dw, x.T @ dy, rtol=1e-12, atol=1e-12 * np.abs(x.T @ dy).max())
    np.testing.assert_allclose(back[:45], x, rtol=1e-13, atol=1e-13 * np.abs(x).max())
    np.testing.assert_allclose(back[45:], 0.0, atol=1e-13 * np.abs(x).max())


def test_rht_spreads_an_outlier_over_the_block():
    v = np.zeros(16, np.float32)
    v[5] = 64.0
    y = np.asarray(hadamard.rht(jnp.asarray(v), hadamard.random_signs(0)))
    # One spike becomes 16 values of equal magnitude 64 / 4; the norm is kept.
    np.testing.assert_array_equal(np.abs(y), np.full(16, 16.0))
    assert np.linalg.norm(y) == np.linalg.norm(v)


def test_rht_errors():
    with pytest.raises(ValueError, match="power of two"):
        hadamard.rht(jnp.ones(12), jnp.ones(12))
    with pytest.raises(ValueError, match="1-d"):
        hadamard.rht(jnp.float32(1.0), jnp.ones(16))
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard.inverse_rht(jnp.ones(20), jnp.ones(16))
