"""scripts/hash_numerics.py: fingerprints that change with any bit and repeat for the same run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from script_loader import load_script


def _script():
    return load_script("hash_numerics")


def test_fingerprint_sees_every_bit_dtype_and_shape():
    fp = _script().fingerprint
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    flipped = x.copy()
    flipped.view(np.int32)[2, 3] ^= 1  # the last bit of one element
    base = fp({"a": x, "b": jnp.zeros(2)})
    assert base == fp({"a": x.copy(), "b": jnp.zeros(2)})
    assert base != fp({"a": flipped, "b": jnp.zeros(2)})
    assert base != fp({"a": x.reshape(4, 3), "b": jnp.zeros(2)})
    assert base != fp({"a": x, "b": jnp.zeros(2, jnp.bfloat16)})


def test_a_recipe_hashes_the_same_twice():
    # Small inputs: the dense and ragged cases of one recipe, run twice.
    script = _script()
    inputs = script.make_inputs(128, 256, 128, [100, 156], 128, 128)
    first = script.recipe_hashes("deepseek_v3", inputs, steps=False)
    assert first == script.recipe_hashes("deepseek_v3", inputs, steps=False)
    assert not any(v.startswith("ERR") for v in first.values()), first
    assert set(first) == {"dense", "ragged"}
