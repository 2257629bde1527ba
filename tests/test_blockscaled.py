import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import blockscaled as bs
from fp8jax import gemm
from fp8jax import microscaling as mx


def test_dispatch_decisions():
    avail = bs.native_block_gemm_available
    assert avail("gpu", "10.0") and avail("cuda", "12.0")
    assert not avail("gpu", "9.0")  # Hopper: no block-scaled tensor cores
    assert not avail("cpu", None) and not avail("tpu", None)
    assert not avail("gpu", None) and not avail("gpu", "unknown")
    # This machine: the device's own answer.
    dev = jax.devices()[0]
    assert bs.device_native_block_gemm() == avail(
        dev.platform, getattr(dev, "compute_capability", None)
    )


def test_block_formats_in_the_gemm_table():
    # One table decides: "auto" on a device without native block GEMMs and
    # "xla" dequantize both operands to float32; other impls are refused.
    a = mx.quantize_mxfp8(jnp.ones((1, 4, 64)), 2)
    b = mx.quantize_mxfp8(jnp.ones((1, 64, 8)), 1)
    r = fp8jax.recipes.mxfp8()
    if not bs.device_native_block_gemm():
        assert gemm.select_impl(r, a, b, "fprop") == "xla"
    assert gemm.select_impl(dataclasses.replace(r, impl="xla"), a, b, "fprop") == "xla"
    with pytest.raises(ValueError, match="not 'pallas'"):
        gemm.select_impl(dataclasses.replace(r, impl="pallas"), a, b, "fprop")
    fp8 = fp8jax.quantize(jnp.ones((1, 64, 8)), fp8jax.E4M3, "block")
    with pytest.raises(ValueError, match="mixes schemes"):
        gemm.select_impl(r, a, fp8, "fprop")
    with pytest.raises(ValueError, match="FP8"):
        gemm.select_impl(dataclasses.replace(r, accumulation=fp8jax.Accumulation()), a, b, "fprop")
    # Named for a platform without the native GEMM: refused at lowering.
    assert "compute capability >= 10.0" in gemm.unsupported("scaled_matmul", "cpu")


def test_dispatch_without_scaled_matmul(monkeypatch):
    monkeypatch.delattr(jax.nn, "scaled_matmul")
    assert not bs.native_block_gemm_available("gpu", "10.0")


@pytest.mark.parametrize("fmt,two_d_b", [("mxfp8", False), ("nvfp4", False), ("nvfp4", True)])
def test_scaled_matmul_args_match_the_emulation(fmt, two_d_b):
    # The arguments handed to jax.nn.scaled_matmul, multiplied as its
    # documentation defines it (data * repeated scales, einsum over K), times
    # alpha, equal the emulated product: the layout logic is right even
    # where the native GEMM cannot run.
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (2, 5, 70)) * jnp.exp(jax.random.normal(kb, (2, 5, 1)))
    b = jax.random.normal(kb, (2, 19, 70))
    qa = bs.quantize_block_operand(a, fmt, "tile", 2)
    qb = bs.quantize_block_operand(b, fmt, "block" if two_d_b else "tile", 2)
    d, e, sd, se, alpha = bs.scaled_matmul_args(qa, qb)
    blk = bs.BLOCK_FORMATS[fmt]
    assert (
        d.shape[-1] % blk == 0
        and sd.shape == (2, 5, d.shape[-1] // blk)
        and se.shape == (2, 19, e.shape[-1] // blk)
    )
    a_s = np.asarray(d, np.float64) * np.repeat(np.asarray(sd, np.float64), blk, -1)
    b_s = np.asarray(e, np.float64) * np.repeat(np.asarray(se, np.float64), blk, -1)
    native_def = np.einsum("bmk,bnk->bmn", a_s, b_s) * float(alpha)
    emulated = np.asarray(
        gemm.dot(mx.dequantize_blocks(qa), mx.dequantize_blocks(qb), (((2,), (2,)), ((0,), (0,)))),
        np.float64,
    )
    np.testing.assert_allclose(
        emulated, native_def, rtol=1e-5, atol=1e-5 * np.abs(native_def).max()
    )
    exact = np.einsum(
        "bmk,bnk->bmn",
        np.asarray(mx.dequantize_blocks(qa), np.float64),
        np.asarray(mx.dequantize_blocks(qb), np.float64),
    )
    np.testing.assert_allclose(emulated, exact, rtol=1e-5, atol=1e-6 * np.abs(exact).max())


def test_hadamard_pair_cancels_in_the_product():
    x = jax.random.normal(jax.random.key(1), (1, 37, 6))  # wgrad: contraction over axis 1
    dy = jax.random.normal(jax.random.key(2), (1, 37, 4))
    xt, dyt = bs.hadamard_pair(x, 1, dy, 1, seed=3)
    assert xt.shape == (1, 48, 6) and dyt.shape == (1, 48, 4)
    want = np.einsum("bmk,bmn->bkn", np.asarray(x, np.float64), np.asarray(dy, np.float64))
    got = np.einsum("bmk,bmn->bkn", np.asarray(xt, np.float64), np.asarray(dyt, np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_operand_key_reproducible_and_data_dependent():
    t = jax.random.normal(jax.random.key(0), (8, 16))
    k1 = jax.random.key_data(bs.operand_key(0, 1, t))
    np.testing.assert_array_equal(k1, jax.random.key_data(bs.operand_key(0, 1, t)))
    assert not np.array_equal(k1, jax.random.key_data(bs.operand_key(0, 2, t)))
    assert not np.array_equal(k1, jax.random.key_data(bs.operand_key(1, 1, t)))
    assert not np.array_equal(k1, jax.random.key_data(bs.operand_key(0, 1, t.at[0, 0].add(1e-3))))


def _documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """jax.nn.scaled_matmul as its documentation defines it, in float32 (runs on CPU)."""
    a = lhs.astype(jnp.float32) * jnp.repeat(
        lhs_scales.astype(jnp.float32), lhs.shape[-1] // lhs_scales.shape[-1], -1
    )
    b = rhs.astype(jnp.float32) * jnp.repeat(
        rhs_scales.astype(jnp.float32), rhs.shape[-1] // rhs_scales.shape[-1], -1
    )
    return jnp.einsum("bmk,bnk->bmn", a, b, precision=jax.lax.Precision.HIGHEST).astype(
        preferred_element_type
    )


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_native_path_wiring_through_dot_general(monkeypatch, name):
    # Pretend to be a Blackwell GPU whose scaled_matmul computes what its
    # documentation says: dot_general's three GEMMs through the native path
    # (layouts, transposes, padding of K, tensor scales) equal the emulation.
    from fp8jax import registry

    recipe = registry.get(name)
    x = jax.random.normal(jax.random.key(0), (37, 70))
    w = jax.random.normal(jax.random.key(1), (70, 45)) * 0.1
    dy = jax.random.normal(jax.random.key(2), (37, 45))
    dn = (((1,), (0,)), ((), ()))

    def run():
        f = lambda x, w: fp8jax.dot_general(x, w, dn, recipe=recipe)  # noqa: E731
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy))

    emulated = run()
    calls = []

    def fake(*args, **kw):
        calls.append(args[0].shape)
        return _documented_scaled_matmul(*args, **kw)

    # The table's CUDA row on this platform, a device that has the native
    # GEMM, and the call run here instead of being lowered for CUDA only.
    scheme = "mx" if name == "mxfp8" else "nvfp4"
    here = fp8jax.platforms.local_platform()
    monkeypatch.setitem(gemm.AUTO, (scheme, here), gemm.AUTO[scheme, "cuda"])
    monkeypatch.setattr(bs, "native_block_gemm_available", lambda platform, cc: True)
    monkeypatch.setattr(bs.platforms, "only_on", lambda platforms, fn, *args: fn(*args))
    monkeypatch.setattr(jax.nn, "scaled_matmul", fake)
    native = run()
    assert len(calls) == 3  # fprop, dgrad, wgrad
    for got, want in zip(native, emulated):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max())
        )


def test_spec_errors():
    t = jnp.ones((2, 8, 64))
    with pytest.raises(ValueError, match="unknown block format"):
        bs.quantize_block_operand(t, "mxfp6", "tile", 2)
    with pytest.raises(ValueError, match="cover the contraction axis"):
        bs.quantize_block_operand(jnp.ones((4, 8, 64)), "nvfp4", "block", 0)
    assert (
        bs.is_block_format("nvfp4")
        and not bs.is_block_format("e4m3")
        and not bs.is_block_format(None)
    )
    with pytest.raises(ValueError, match=r"\(B, rows, K\)"):
        q = bs.quantize_block_operand(t, "mxfp8", "tile", 1)
        bs.scaled_matmul_args(q, q)


def test_block_telemetry_fractions():
    from fp8jax.telemetry import operand_stats

    x = np.ones((2, 32), np.float32)
    x[0, 0] = 511.0  # X = 2^0: 511 > 464 clips to 448 (saturated); 470 too; 460 rounds to 448
    x[0, 1] = 470.0
    x[0, 2] = 460.0
    x[1, 0] = 448.0
    x[1, 1:4] = 1e-4  # below half of E4M3's smallest subnormal 2^-9: flushed
    st = operand_stats(jnp.asarray(x), mx.quantize_mxfp8(jnp.asarray(x)))
    assert float(st["saturated"]) == 2 / 64 and float(st["flushed"]) == 3 / 64
    # NVFP4: the block max maps to 6 within E4M3's rounding of the scale, so
    # nothing saturates; values below 1/4 of a step flush.
    y = np.ones((1, 16), np.float32)
    y[0, 0] = 100.0
    sn = operand_stats(jnp.asarray(y), mx.quantize_nvfp4(jnp.asarray(y)))
    assert float(sn["saturated"]) == 0 and float(sn["flushed"]) == 15 / 16
