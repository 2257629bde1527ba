"""Block-scaled FP8 GEMM kernel (Mosaic GPU interpret mode on CPU) vs a float64 numpy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8jax.kernels import availability
from fp8jax.kernels import block_gemm as bg

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
U32 = 2.0**-24  # unit roundoff of float32
U_BF16 = 2.0**-8  # unit roundoff of bfloat16


# ----------------------------------------------------------------------------
# independent float64 oracle
# ----------------------------------------------------------------------------


def fp8(rng, shape, dtype=E4M3, spread=100.0):
    """Random FP8 data covering most of the E4M3 range (saturated by clipping)."""
    x = rng.standard_normal(shape) * spread
    fmax = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x, -fmax, fmax).astype(dtype)


def scales(rng, shape):
    """Non-power-of-two float32 scales over three decades."""
    return (10.0 ** rng.uniform(-4, -1, shape)).astype(np.float32)


def dequant_rows(data, scale):
    """(M, K) data with one scale per 1x128 tile -> float64."""
    k = data.shape[1]
    return data.astype(np.float64) * np.repeat(scale.astype(np.float64), 128, axis=1)[:, :k]


def dequant_blocks(data, scale):
    """(K, N) data with one scale per 128x128 block -> float64."""
    k, n = data.shape
    s = np.repeat(np.repeat(scale.astype(np.float64), 128, axis=0), 128, axis=1)[:k, :n]
    return data.astype(np.float64) * s


def oracle(a, sa, b, sb):
    """Exact result (float64) and |A| @ |B| (the scale of rounding errors)."""
    a64, b64 = dequant_rows(a, sa), dequant_blocks(b, sb)
    return a64 @ b64, np.abs(a64) @ np.abs(b64)


def tolerance(mag, ref, k, out_dtype):
    """FP32 accumulation bound plus one rounding to the output dtype.

    Each 128-chunk sum (<= 127 roundings), two scale products and one add per
    chunk into the accumulator: error <= (k + 3 * ceil(k/128) + 4) * u32 * (|A|@|B|).
    """
    kc = bg.cdiv(k, 128)
    tol = (k + 3 * kc + 4) * U32 * mag
    if jnp.dtype(out_dtype) == jnp.bfloat16:
        tol = tol + U_BF16 * np.abs(ref)
    return tol + 1e-30


def make_case(seed, m, k, n, dtype=E4M3):
    rng = np.random.default_rng(seed)
    a, b = fp8(rng, (m, k), dtype), fp8(rng, (k, n), dtype)
    sa, sb = scales(rng, (m, bg.cdiv(k, 128))), scales(rng, (bg.cdiv(k, 128), bg.cdiv(n, 128)))
    return a, sa, b, sb


def assert_close(got, a, sa, b, sb, out_dtype):
    ref, mag = oracle(a, sa, b, sb)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == ref.shape
    err = np.abs(got - ref)
    tol = tolerance(mag, ref, a.shape[1], out_dtype)
    worst = np.unravel_index(np.argmax(err / tol), err.shape)
    assert np.all(err <= tol), f"max err/tol {np.max(err / tol):.3g} at {worst}"


# ----------------------------------------------------------------------------
# kernel in interpret mode
# ----------------------------------------------------------------------------

# (M, K, N): ragged in every dim, several tiles and K chunks, a single row,
# and an exact multiple of the 128x128 tiles.
SHAPES = [
    (37, 300, 200),
    (128, 256, 256),
    (1, 130, 7),
    (20, 128, 129),
]


@pytest.mark.parametrize(
    "m,k,n,out_dtype",
    [(*s, jnp.float32) for s in SHAPES] + [(*s, jnp.bfloat16) for s in SHAPES[::2]],
)
def test_kernel_matches_float64(m, k, n, out_dtype):
    a, sa, b, sb = make_case(m * 7 + k + n, m, k, n)
    got = bg.block_scaled_matmul(a, sa, b, sb, out_dtype=out_dtype, interpret=True)
    assert got.dtype == jnp.dtype(out_dtype)
    assert_close(got, a, sa, b, sb, out_dtype)


@pytest.mark.parametrize("m,k,n", SHAPES[:2])
def test_kernel_nt_layout_matches_float64(m, k, n):
    a, sa, b, sb = make_case(1 + m, m, k, n)
    got = bg.block_scaled_matmul_nt(
        a,
        sa,
        np.ascontiguousarray(b.T),
        np.ascontiguousarray(sb.T),
        out_dtype=jnp.float32,
        interpret=True,
    )
    assert_close(got, a, sa, b, sb, jnp.float32)


def test_kernel_e5m2_operands():
    a, sa, b, sb = make_case(3, 24, 260, 70, dtype=E5M2)
    got = bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=True)
    assert_close(got, a, sa, b, sb, jnp.float32)


def test_kernel_mixed_e4m3_e5m2_operands():
    """The hybrid recipes' Dgrad: E5M2 gradients times E4M3 weights, one wgmma type each."""
    a, sa, _, _ = make_case(4, 24, 260, 70, dtype=E5M2)
    _, _, b, sb = make_case(4, 24, 260, 70, dtype=E4M3)
    got = bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=True)
    assert_close(got, a, sa, b, sb, jnp.float32)


def test_scales_are_applied_per_chunk_and_block():
    """Scaling one K chunk of one row, or one 128x128 block of B, changes exactly its share."""
    a, sa, b, sb = make_case(5, 16, 256, 256)
    base = np.asarray(bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=True))
    sb2 = sb.copy()
    sb2[1, 0] *= 4.0  # K chunk 1, N block 0
    got = np.asarray(bg.block_scaled_matmul(a, sa, b, sb2, out_dtype=jnp.float32, interpret=True))
    assert_close(got, a, sa, b, sb2, jnp.float32)
    np.testing.assert_array_equal(got[:, 128:], base[:, 128:])
    assert np.all(got[:, :128] != base[:, :128])


def test_reference_matches_float64():
    for m, k, n in SHAPES[:2]:
        a, sa, b, sb = make_case(11 + k, m, k, n)
        for out_dtype in (jnp.float32, jnp.bfloat16):
            got = bg.block_scaled_matmul_reference(a, sa, b, sb, out_dtype=out_dtype)
            assert_close(got, a, sa, b, sb, out_dtype)


def test_kernel_jits_and_has_no_padding_leak():
    """Inside jit, with inputs whose padded region would matter if not zero/one."""
    a, sa, b, sb = make_case(9, 17, 140, 33)
    f = jax.jit(lambda *xs: bg.block_scaled_matmul(*xs, out_dtype=jnp.float32, interpret=True))
    assert_close(f(a, sa, b, sb), a, sa, b, sb, jnp.float32)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a, sa, b, sb: (a, sa[:, :1], b, sb), "a_scale"),
        (lambda a, sa, b, sb: (a, sa, b, sb[:1]), "b_scale"),
        (lambda a, sa, b, sb: (a, sa, b[:-1], sb), "contraction"),
        (lambda a, sa, b, sb: (a, sa.astype(np.float64), b, sb), "float32"),
        (lambda a, sa, b, sb: (a.astype(np.float32), sa, b, sb), "float8"),
    ],
)
def test_bad_inputs_raise(change, match):
    args = change(*make_case(0, 8, 256, 128))
    with pytest.raises((ValueError, TypeError), match=match):
        bg.block_scaled_matmul(*args, interpret=True)


def test_bad_out_dtype_raises():
    a, sa, b, sb = make_case(0, 8, 128, 128)
    with pytest.raises(TypeError, match="out_dtype"):
        bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float16, interpret=True)


# ----------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only expectation")
def test_kernel_not_available_on_cpu():
    assert availability.kernel_available() is False


def test_self_check_answers_from_inside_a_jit_trace():
    # "auto" asks while tracing a GEMM: the check must run, not be staged into that trace.
    answers = []

    @jax.jit
    def traced(x):
        answers.append(availability.check_error(interpret=True))
        return x + 1

    traced(jnp.ones(3))
    assert answers == [None]


@pytest.mark.gpu
@pytest.mark.skipif(not availability.hopper_gpu(), reason="needs a Hopper+ NVIDIA GPU")
def test_compiled_kernel_passes_its_self_check_on_a_hopper_gpu():
    # A broken kernel on a Hopper GPU is a failure here, not a skip.
    assert availability.self_check_error() is None
    assert availability.kernel_available()


def test_nt_layout_matches_kn():
    a, sa, b, sb = make_case(21, 20, 200, 140)
    got_nt = bg.block_scaled_matmul_nt(
        a, sa, b.T.copy(), sb.T.copy(), out_dtype=jnp.float32, interpret=True
    )
    assert_close(got_nt, a, sa, b, sb, jnp.float32)


# ----------------------------------------------------------------------------
# GPU (compiled Mosaic GPU kernel); skipped on CPU
# ----------------------------------------------------------------------------


def tensor_core_tolerance(mag, ref, out_dtype):
    """Hopper sums each 128-product chunk with ~13 fraction bits (DESIGN.md): allow 2^-11."""
    tol = 2.0**-11 * mag
    if jnp.dtype(out_dtype) == jnp.bfloat16:
        tol = tol + U_BF16 * np.abs(ref)
    return tol


@pytest.mark.gpu
@pytest.mark.skipif(not availability.hopper_gpu(), reason="needs a Hopper+ NVIDIA GPU")
@pytest.mark.parametrize(
    "m,k,n",
    # Whole tiles; padded edges; edges read and written in place (multiples of 32).
    [(256, 512, 384), (300, 7168 // 8, 257), (4096, 1024, 512), (288, 416, 160), (544, 1056, 576)],
)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_gpu_kernel_matches_float64(m, k, n, layout):
    a, sa, b, sb = make_case(m + n, m, k, n)
    if layout == "kn":
        got = bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.bfloat16, interpret=False)
    else:
        got = bg.block_scaled_matmul_nt(
            a, sa, b.T.copy(), sb.T.copy(), out_dtype=jnp.bfloat16, interpret=False
        )
    ref, mag = oracle(a, sa, b, sb)
    err = np.abs(np.asarray(jnp.asarray(got, jnp.float32), np.float64) - ref)
    assert np.all(err <= tensor_core_tolerance(mag, ref, jnp.bfloat16))


# ----------------------------------------------------------------------------
# 1D1D (Wgrad) variant: 128x1 tiles on both operands, A read transposed
# ----------------------------------------------------------------------------


def make_tn_case(seed, t, m, n):
    rng = np.random.default_rng(seed)
    at, b = fp8(rng, (t, m)), fp8(rng, (t, n))
    sat, sb = scales(rng, (bg.cdiv(t, 128), m)), scales(rng, (bg.cdiv(t, 128), n))
    return at, sat, b, sb


def tn_oracle(at, sat, b, sb):
    t = at.shape[0]
    a64 = at.astype(np.float64) * np.repeat(sat.astype(np.float64), 128, axis=0)[:t]
    b64 = b.astype(np.float64) * np.repeat(sb.astype(np.float64), 128, axis=0)[:t]
    return a64.T @ b64, np.abs(a64).T @ np.abs(b64)


@pytest.mark.parametrize("t,m,n", [(300, 70, 140), (128, 16, 256)])
def test_tn_kernel_matches_float64(t, m, n):
    at, sat, b, sb = make_tn_case(t + m, t, m, n)
    got = bg.block_scaled_matmul_tn(at, sat, b, sb, out_dtype=jnp.float32, interpret=True)
    ref, mag = tn_oracle(at, sat, b, sb)
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= tolerance(mag, ref, t, jnp.float32))
    got_ref = bg.block_scaled_matmul_tn_reference(at, sat, b, sb, out_dtype=jnp.bfloat16)
    err = np.abs(np.asarray(got_ref.astype(jnp.float32), np.float64) - ref)
    assert np.all(err <= tolerance(mag, ref, t, jnp.bfloat16))


def test_tn_bad_scale_raises():
    at, sat, b, sb = make_tn_case(0, 130, 16, 16)
    with pytest.raises(ValueError, match="b_scale"):
        bg.block_scaled_matmul_tn(at, sat, b, sb[:1], interpret=True)


# ----------------------------------------------------------------------------
# integration with fp8jax.dot_general's canonical GEMMs
# ----------------------------------------------------------------------------


def np_dequant(q) -> np.ndarray:
    """float64 dequantization of a 3D QTensor from its data and scale layout alone."""
    data = np.asarray(q.data).astype(np.float64)
    s = np.asarray(q.scale, np.float64)
    if q.granularity == "tile":
        s = np.repeat(s, q.tile, axis=q.axis)
    else:  # block
        s = np.repeat(np.repeat(s, q.tile, axis=-2), q.tile, axis=-1)
    return data * s[tuple(slice(0, d) for d in data.shape)]


@pytest.mark.parametrize("canon", ["fprop", "dgrad", "wgrad"])
def test_gemm_core_runs_the_kernel(canon):
    import dataclasses

    import fp8jax
    from fp8jax import gemm

    recipe = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl="pallas")
    rng = np.random.default_rng(3)
    e4 = fp8jax.E4M3
    bsz, m, k, n = 2, 40, 200, 100
    if canon == "fprop":  # x (B,M,K) tiles along K, w (B,K,N) blocks
        a = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, m, k))), e4, "tile", axis=2)
        b = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, k, n))), e4, "block")
        ref_fn = lambda a64, b64: a64 @ b64
    elif canon == "dgrad":  # dy (B,M,N) tiles along N, w (B,K,N) blocks
        a = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, m, n))), e4, "tile", axis=2)
        b = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, k, n))), e4, "block")
        ref_fn = lambda a64, b64: a64 @ np.swapaxes(b64, 1, 2)
    else:  # x (B,M,K) and dy (B,M,N), 128x1 tiles along M
        a = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, m, k))), e4, "tile", axis=1)
        b = fp8jax.quantize(jnp.asarray(rng.standard_normal((bsz, m, n))), e4, "tile", axis=1)
        ref_fn = lambda a64, b64: np.swapaxes(a64, 1, 2) @ b64
    assert gemm.select_impl(recipe, a, b, canon) == "pallas"
    got = gemm.gemm(a, b, canon, recipe)
    assert got.dtype == jnp.float32
    a64, b64 = np_dequant(a), np_dequant(b)
    ref, mag = ref_fn(a64, b64), ref_fn(np.abs(a64), np.abs(b64))
    contraction = {"fprop": k, "dgrad": n, "wgrad": m}[canon]
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= tolerance(mag, ref, contraction, jnp.float32))
    # impl="xla" and per-tensor operands leave the GEMM to XLA
    xla = dataclasses.replace(recipe, impl="xla")
    assert gemm.select_impl(xla, a, b, canon) == "xla"
    qt = fp8jax.quantize(jnp.ones((bsz, m, k)), e4, "tensor")
    with pytest.raises(ValueError, match="pallas"):
        gemm.select_impl(recipe, qt, b, canon)
