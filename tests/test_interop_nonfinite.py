"""An Inf operand through the interop ops, against lax.

E4M3 (float8_e4m3fn) has no Inf code: an Inf element quantizes to NaN, so
with an E4M3 recipe every output that sums a product with it is NaN where
lax gives +-Inf (or NaN).  Scales come from the finite elements, so every
other output is bit for bit the output with that element set to 0.  The
bf16 recipe keeps lax's Inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import interop

DN = (((1,), (0,)), ((), ()))
K1, K2 = jax.random.split(jax.random.key(0))
X = jax.random.normal(K1, (4, 256))
W = jax.random.normal(K2, (256, 8))


def _check(got, lax_out, zeroed):
    """NaN exactly where lax is non-finite; elsewhere equal to the op on the zeroed operand."""
    got, lax_out, zeroed = map(np.asarray, (got, lax_out, zeroed))
    bad = ~np.isfinite(lax_out)
    assert bad.any() and (~bad).any()
    assert np.isnan(got[bad]).all()
    np.testing.assert_array_equal(got[~bad], zeroed[~bad])
    assert np.isfinite(got[~bad]).all()


@pytest.mark.parametrize("recipe", ["deepseek_v3", "current_tensor", "rowwise"])
def test_inf_operand_gives_nan_where_lax_gives_inf(recipe):
    f = interop.make_dot_general(recipe)
    lax_dot = lambda x, w: jax.lax.dot_general(x, w, DN)
    xi, xz = X.at[1, 3].set(jnp.inf), X.at[1, 3].set(0.0)
    _check(f(xi, W, DN), lax_dot(xi, W), f(xz, W, DN))
    wi, wz = W.at[5, 2].set(-jnp.inf), W.at[5, 2].set(0.0)
    _check(f(X, wi, DN), lax_dot(X, wi), f(X, wz, DN))
    # Gradients: Wgrad (x^T dy) sums the Inf of x into row 3 of dW; Dgrad (dy w^T) does not see it.
    dy = jax.random.normal(jax.random.key(1), (4, 8))
    grads = lambda fn, x: jax.vjp(lambda x, w: fn(x, w, DN), x, W)[1](dy)
    (dx, dw), (_, dwl), (dxz, dwz) = grads(f, xi), grads(jax.lax.dot_general, xi), grads(f, xz)
    _check(dw, dwl, dwz)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dxz))


def test_inf_operand_of_ragged_dot_gives_nan_where_lax_gives_inf():
    f = interop.make_ragged_dot("deepseek_v3")
    ws = jax.random.normal(K2, (2, 256, 8))
    gs = jnp.array([2, 2], jnp.int32)
    xi, xz = X.at[1, 3].set(jnp.inf), X.at[1, 3].set(0.0)
    _check(f(xi, ws, gs), jax.lax.ragged_dot(xi, ws, gs), f(xz, ws, gs))


def test_bf16_keeps_the_inf():
    xi = X.at[1, 3].set(jnp.inf)
    got = np.asarray(interop.make_dot_general("bf16")(xi, W, DN))
    want = np.asarray(jax.lax.dot_general(xi, W, DN))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
