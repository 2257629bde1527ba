"""Block-scaled FP8 GEMM (DeepSeek-V3 / DeepGEMM "1D2D" scaling) as a Pallas kernel.

Operands (the layout of ``fp8jax.quantize``'s "tile" and "block" granularities)::

    a_data  float8 (M, K)                 a_scale float32 (M, ceil(K/128))    one scale per 1x128 tile
    b_data  float8 (K, N)                 b_scale float32 (ceil(K/128), ceil(N/128))  one per 128x128 block

Math (``c`` runs over the 128-wide K chunks)::

    out[m, n] = sum_c ( sum_{k in c} a[m, k] * b[k, n] ) * a_scale[m, c] * b_scale[c, n // 128]

accumulated in FP32 and cast once to ``out_dtype`` (bfloat16 or float32).  This
is DeepGEMM's two-level accumulation: the tensor core sums the 128 products of
one chunk into a fresh FP32 partial (on Hopper with its own ~14-bit internal
accumulation), the partial leaves the tensor core, is multiplied by the two
scales and added to the FP32 main accumulator.  So the low-precision tensor-core
accumulation never spans more than 128 products (DeepSeek-V3's N_C = 128).

Shapes that are not multiples of the tiles are padded outside the kernel: data
with zeros (a zero product adds nothing), scales with ones (any finite value
would do, ones keep the padding obviously inert), and the result is cropped.

The kernel uses the Pallas **Triton** lowering: a grid over output tiles
(bm x bn), a ``fori_loop`` over the K chunks that Triton software-pipelines
(``num_stages``), and an FP8 x FP8 -> FP32 MMA per chunk that Triton maps to
Hopper's ``wgmma`` FP8 instructions (see ``_fp8_mma`` for why a custom
primitive).  On CPU it runs in Pallas interpret mode (slow; tests only).

``block_scaled_matmul_reference`` is the same math in plain jnp (a scan over K
chunks, which XLA runs fast on CPU): the CPU path and the test oracle's sibling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fp8jax import platforms
from fp8jax.kernels import _fp8_mma

#: K chunk = scale tile = promotion interval of the two-level accumulation.
CHUNK = 128

_FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# ----------------------------------------------------------------------------
# input checks and padding
# ----------------------------------------------------------------------------


def check_operands(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    out_dtype,
    *,
    b_layout: str = "kn",
    b_batch: bool = False,
) -> tuple[int, int, int]:
    """Validate shapes/dtypes; return (M, K, N).  ``b_layout`` "kn": B is (K, N); "nk": (N, K)."""
    lead = 1 if b_batch else 0
    if a_data.ndim != 2 or b_data.ndim != 2 + lead:
        raise ValueError(
            f"a_data must be 2D and b_data {2 + lead}D, got {a_data.shape} and {b_data.shape}"
        )
    if jnp.dtype(a_data.dtype) not in _FP8_DTYPES or jnp.dtype(b_data.dtype) not in _FP8_DTYPES:
        raise TypeError(
            f"a_data and b_data must be float8_e4m3fn or float8_e5m2, got {a_data.dtype}, {b_data.dtype}"
        )
    if a_data.dtype != b_data.dtype:
        # Triton's FP8 MMA takes one operand type; mixed E4M3/E5M2 is not supported here.
        raise TypeError(
            f"a_data and b_data must share a dtype, got {a_data.dtype} and {b_data.dtype}"
        )
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    m, k = a_data.shape
    if b_layout == "kn":
        kb, n = b_data.shape[lead:]
    elif b_layout == "nk":
        n, kb = b_data.shape[lead:]
    else:
        raise ValueError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")
    if kb != k:
        raise ValueError(f"contraction mismatch: a_data {a_data.shape}, b_data {b_data.shape}")
    kc, nc = cdiv(k, CHUNK), cdiv(n, CHUNK)
    if a_scale.shape != (m, kc):
        raise ValueError(
            f"a_scale must have shape (M, ceil(K/128)) = {(m, kc)}, got {a_scale.shape}"
        )
    want_b = (kc, nc) if b_layout == "kn" else (nc, kc)
    if b_batch:
        want_b = (b_data.shape[0], *want_b)
    if b_scale.shape != want_b:
        raise ValueError(f"b_scale must have shape {want_b}, got {b_scale.shape}")
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if jnp.dtype(s.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {s.dtype}")
    return m, k, n


def check_blocks(block_m: int, block_n: int) -> None:
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if block_n < 16 or block_n > CHUNK or CHUNK % block_n:
        # Every output tile then lies inside one 128-column scale block of B,
        # so the kernel needs one scalar B scale per K chunk.
        raise ValueError(f"block_n must be a power of two in [16, 128], got {block_n}")


def check_int32_offsets(*arrays: jax.Array) -> None:
    """The Triton lowering indexes each operand with int32 element offsets."""
    for x in arrays:
        # Size after padding the two matrix dims (at most) to multiples of 128.
        padded = 1
        for i, d in enumerate(x.shape):
            padded *= round_up(d, CHUNK) if i >= x.ndim - 2 else d
        if padded >= 2**31:
            raise ValueError(
                f"operand of shape {x.shape} is too large for int32 offsets in the Triton "
                "kernel; split it (e.g. fewer experts per call)"
            )


def _pad_to(x: jax.Array, shape: tuple[int, ...], value) -> jax.Array:
    pads = [(0, t - s) for s, t in zip(x.shape, shape)]
    if all(p == (0, 0) for p in pads):
        return x
    return jnp.pad(x, pads, constant_values=jnp.asarray(value, x.dtype))


def expand_b_scale(b_scale_kn: jax.Array, n: int) -> jax.Array:
    """(Kc, Nc) block scales -> (Kc, N) per-column scales (column n uses block n // 128)."""
    return jnp.repeat(b_scale_kn, CHUNK, axis=-1)[..., :n]


# ----------------------------------------------------------------------------
# pure-jnp reference (the CPU path)
# ----------------------------------------------------------------------------


def block_scaled_matmul_reference(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """Same math as ``block_scaled_matmul`` in plain jnp (any backend).

    A scan over the K chunks: each chunk's FP8 x FP8 product is summed in FP32
    into a fresh partial, scaled by ``a_scale[:, c, None] * b_scale[c, n // 128]``
    and added to the FP32 accumulator; one cast to ``out_dtype`` at the end.
    (A scan of 2D dots rather than one batched dot: XLA on CPU runs a batched
    FP8 dot followed by a rescale-and-sum orders of magnitude slower.)
    """
    m, k, n = check_operands(a_data, a_scale, b_data, b_scale, out_dtype)
    kc = cdiv(k, CHUNK)
    kp = kc * CHUNK
    a_p = _pad_to(a_data, (m, kp), 0)
    b_p = _pad_to(b_data, (kp, n), 0)
    a_chunks = a_p.reshape(m, kc, CHUNK).transpose(1, 0, 2)  # (Kc, M, 128)
    b_chunks = b_p.reshape(kc, CHUNK, n)  # (Kc, 128, N)
    sa = a_scale.T  # (Kc, M)
    sb = expand_b_scale(b_scale, n)  # (Kc, N)

    def step(acc, xs):
        a_c, b_c, sa_c, sb_c = xs
        # FP8 products are exact in FP32; the chunk sum is an FP32 partial.
        partial = jnp.dot(a_c, b_c, preferred_element_type=jnp.float32)
        # The two scales are applied to the FP32 partial (promotion point).
        return acc + partial * (sa_c[:, None] * sb_c[None, :]), None

    acc0 = jnp.zeros((m, n), jnp.float32)
    acc, _ = lax.scan(step, acc0, (a_chunks, b_chunks, sa, sb))
    # One rounding to the output dtype, after all FP32 accumulation.
    return acc.astype(out_dtype)


# ----------------------------------------------------------------------------
# the Pallas kernel
# ----------------------------------------------------------------------------


def tile_ij(pid, n_m: int, n_n: int, group_m: int):
    """Map a 1D program id to an output tile (i, j), grouping ``group_m`` row tiles.

    Consecutive programs walk down a column of ``group_m`` row tiles before moving
    right, so the B panels they share stay in L2 (the usual Triton "grouped order").
    """
    # Program ids are non-negative, so truncating lax.div/lax.rem equal floor
    # division and lower to single integer ops (jnp's // and % add sign fix-ups).
    width = group_m * n_n
    first_m = lax.div(pid, width) * group_m
    size = jnp.minimum(n_m - first_m, group_m)
    local = lax.rem(pid, width)
    return first_m + lax.rem(local, size), lax.div(local, size)


def _mma(a, b, *, trans_a, trans_b):
    if _fp8_mma.TRITON_RULE_INSTALLED:
        return _fp8_mma.fp8_mma(a, b, trans_a=trans_a, trans_b=trans_b)
    return _fp8_mma._dot_f32(a, b, trans_a=trans_a, trans_b=trans_b)


def chunk_loop(
    load_a,
    load_b,
    load_sa,
    load_sb,
    n_k: int,
    bm: int,
    bn: int,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    b_cols: bool = False,
):
    """FP32 accumulator of one output tile: the two-level accumulation over ``n_k`` chunks.

    ``load_sa(c)``: (bm,) row scales of chunk c; ``load_sb(c)``: a scalar (one
    128x128 block of B) or, with ``b_cols``, (bn,) per-column scales.
    """

    def body(c, acc):
        a = load_a(c)  # (bm, 128) FP8, or (128, bm) when trans_a
        b = load_b(c)  # (128, bn) FP8, or (bn, 128) when trans_b
        partial = _mma(a, b, trans_a=trans_a, trans_b=trans_b)  # fresh FP32 partial
        # Promotion: scale the FP32 partial by the row scales of A's tiles and
        # B's block (or column) scales of this chunk, then add in FP32.
        if b_cols:
            return acc + partial * load_sa(c)[:, None] * load_sb(c)[None, :]
        scale = load_sa(c) * load_sb(c)  # (bm,)
        return acc + partial * scale[:, None]

    return lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32))


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, n_k, bm, bn, trans_a, trans_b, b_cols):
    def chunk(c):
        return pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)

    def load_a(c):
        return a_ref[chunk(c), :] if trans_a else a_ref[:, chunk(c)]

    def load_b(c):
        return b_ref[:, chunk(c)] if trans_b else b_ref[chunk(c), :]

    def load_sb(c):
        return sb_ref[c, :] if b_cols else sb_ref[c, 0]

    acc = chunk_loop(
        load_a,
        load_b,
        lambda c: sa_ref[c, :],
        load_sb,
        n_k,
        bm,
        bn,
        trans_a=trans_a,
        trans_b=trans_b,
        b_cols=b_cols,
    )
    # Single rounding of the FP32 accumulator to the output dtype.
    o_ref[...] = acc.astype(o_ref.dtype)


def launch(kernel: Callable, *args: jax.Array, interpret: bool | None, **kw) -> jax.Array:
    """``kernel(*args, interpret=..., **kw)``, with ``interpret=None`` decided per platform.

    None: the compiled Triton kernel where the program is lowered for a CUDA
    GPU of compute capability >= 9.0 (``fp8jax.platforms``), Pallas interpret
    mode (the same math as XLA operations) on every other platform.
    """
    if interpret is not None:
        return kernel(*args, interpret=bool(interpret), **kw)

    def build(compiled: bool):
        if compiled:
            # Triton lowers for CUDA only: dead zeros in any other branch of a
            # multi-platform export.
            fn = functools.partial(kernel, interpret=False, **kw)
            return lambda: platforms.only_on(("cuda",), fn, *args)
        return lambda: kernel(*args, interpret=True, **kw)

    return platforms.choose(lambda p: p == "cuda" and platforms.cuda_at_least("9.0"), build)


def _compiler_params(num_warps: int | None, num_stages: int | None, interpret: bool):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu_triton

    return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype",
        "block_m",
        "block_n",
        "a_layout",
        "b_layout",
        "b_cols",
        "group_m",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _block_scaled_matmul(
    a_data,
    sa_t,
    b_data,
    sb,
    *,
    out_dtype,
    block_m,
    block_n,
    a_layout,
    b_layout,
    b_cols,
    group_m,
    num_warps,
    num_stages,
    interpret,
):
    """Launch the kernel.

    a_data: (M, K) ("mk") or (K, M) ("km"); sa_t: (Kc, M) row scales per chunk.
    b_data: (K, N) ("kn") or (N, K) ("nk"); sb: (Kc, Nc) block scales, or with
    ``b_cols`` (Kc, N) per-column scales.
    """
    trans_a = a_layout == "km"
    trans_b = b_layout == "nk"
    m = a_data.shape[1] if trans_a else a_data.shape[0]
    k = a_data.shape[0] if trans_a else a_data.shape[1]
    n = b_data.shape[0] if trans_b else b_data.shape[1]
    bm, bn = block_m, block_n
    mp, kp, np_ = round_up(m, bm), round_up(k, CHUNK), round_up(n, CHUNK)
    kc, nc = kp // CHUNK, np_ // CHUNK
    n_m, n_n = mp // bm, np_ // bn

    # Zero data padding adds exact zeros; unit scale padding keeps it inert.
    a_p = _pad_to(a_data, (kp, mp) if trans_a else (mp, kp), 0)
    b_p = _pad_to(b_data, (np_, kp) if trans_b else (kp, np_), 0)
    # A's scales as (Kc, Mp): the kernel loads one contiguous row of bm scales
    # per chunk.
    sa_t = _pad_to(sa_t, (kc, mp), 1.0)
    sb = _pad_to(sb, (kc, np_) if b_cols else (kc, nc), 1.0)

    def ij(pid):
        return tile_ij(pid, n_m, n_n, group_m)

    def a_map(pid):
        i = ij(pid)[0]
        return (0, i) if trans_a else (i, 0)

    def sa_map(pid):
        return 0, ij(pid)[0]

    def b_map(pid):
        j = ij(pid)[1]
        return (j, 0) if trans_b else (0, j)

    def sb_map(pid):
        if b_cols:
            return 0, ij(pid)[1]
        # bn divides 128: tile j lies in scale block (j * bn) // 128.
        return 0, lax.div(ij(pid)[1] * bn, CHUNK)

    def o_map(pid):
        return ij(pid)

    kernel = functools.partial(
        _kernel, n_k=kc, bm=bm, bn=bn, trans_a=trans_a, trans_b=trans_b, b_cols=b_cols
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(n_m * n_n,),
        in_specs=[
            pl.BlockSpec((kp, bm) if trans_a else (bm, kp), a_map),
            pl.BlockSpec((kc, bm), sa_map),
            pl.BlockSpec((bn, kp) if trans_b else (kp, bn), b_map),
            pl.BlockSpec((kc, bn) if b_cols else (kc, 1), sb_map),
        ],
        out_specs=pl.BlockSpec((bm, bn), o_map),
        compiler_params=_compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="fp8_block_scaled_matmul",
    )(a_p, sa_t, b_p, sb)
    return out[:m, :n]


def block_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int = 8,
) -> jax.Array:
    """FP8 block-scaled GEMM ``(M, K) x (K, N) -> (M, N)`` with FP32 accumulation.

    See the module docstring for layouts and math.  ``interpret=None`` runs the
    compiled Triton kernel where the program is lowered for a Hopper or later GPU
    and Pallas interpret mode elsewhere (:func:`launch`).
    ``num_warps``/``num_stages`` (Triton) default to 8/4 for ``block_m >= 128``
    and 4/4 below; ``group_m`` is the L2 grouping of the tile order.
    """
    check_operands(a_data, a_scale, b_data, b_scale, out_dtype, b_layout="kn")
    check_blocks(block_m, block_n)
    check_int32_offsets(a_data, b_data)
    return launch(
        _block_scaled_matmul,
        a_data,
        # (M, Kc) -> (Kc, M): one contiguous row of block_m scales per chunk.
        a_scale.T,
        b_data,
        b_scale,
        a_layout="mk",
        b_cols=False,
        **_launch_args(
            out_dtype, block_m, block_n, "kn", group_m, num_warps, num_stages, interpret
        ),
    )


def block_scaled_matmul_nt(
    a_data: jax.Array,
    a_scale: jax.Array,
    bt_data: jax.Array,
    bt_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int = 8,
) -> jax.Array:
    """``block_scaled_matmul`` with B given transposed: ``out = A @ bt.T``.

    ``bt_data`` (N, K) FP8, ``bt_scale`` (ceil(N/128), ceil(K/128)).  Both
    operands are then K-major, the layout Hopper's FP8 ``wgmma`` reads natively
    (with (K, N) B, Triton transposes B tiles on the way to shared memory).  In a
    linear layer y = x W with W (K, N), Dgrad ``dx = dy W^T`` is exactly this call
    with ``bt = W``, no transpose needed.
    """
    check_operands(a_data, a_scale, bt_data, bt_scale, out_dtype, b_layout="nk")
    check_blocks(block_m, block_n)
    check_int32_offsets(a_data, bt_data)
    return launch(
        _block_scaled_matmul,
        a_data,
        a_scale.T,
        bt_data,
        # Scales are tiny: keep one (Kc, Nc) layout inside the kernel.
        bt_scale.T,
        a_layout="mk",
        b_cols=False,
        **_launch_args(
            out_dtype, block_m, block_n, "nk", group_m, num_warps, num_stages, interpret
        ),
    )


def check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype) -> tuple[int, int, int]:
    """Validate the 1D1D (Wgrad) operands; return (M, K, N) with K the contraction."""
    if at_data.ndim != 2 or b_data.ndim != 2:
        raise ValueError(f"at_data and b_data must be 2D, got {at_data.shape} and {b_data.shape}")
    for name, x in (("at_data", at_data), ("b_data", b_data)):
        if jnp.dtype(x.dtype) not in _FP8_DTYPES:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if at_data.dtype != b_data.dtype:
        raise TypeError(
            f"at_data and b_data must share a dtype, got {at_data.dtype}, {b_data.dtype}"
        )
    if jnp.dtype(out_dtype) not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    k, m = at_data.shape
    kb, n = b_data.shape
    if kb != k:
        raise ValueError(f"contraction mismatch: at_data {at_data.shape}, b_data {b_data.shape}")
    kc = cdiv(k, CHUNK)
    if at_scale.shape != (kc, m):
        raise ValueError(
            f"at_scale must have shape (ceil(K/128), M) = {(kc, m)}, got {at_scale.shape}"
        )
    if b_scale.shape != (kc, n):
        raise ValueError(
            f"b_scale must have shape (ceil(K/128), N) = {(kc, n)}, got {b_scale.shape}"
        )
    for name, sc in (("at_scale", at_scale), ("b_scale", b_scale)):
        if jnp.dtype(sc.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {sc.dtype}")
    return m, k, n


def block_scaled_matmul_tn_reference(
    at_data: jax.Array,
    at_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """Same math as ``block_scaled_matmul_tn`` in plain jnp (scan over K chunks)."""
    m, k, n = check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype)
    kc = cdiv(k, CHUNK)
    a_chunks = _pad_to(at_data, (kc * CHUNK, m), 0).reshape(kc, CHUNK, m)
    b_chunks = _pad_to(b_data, (kc * CHUNK, n), 0).reshape(kc, CHUNK, n)

    def step(acc, xs):
        a_c, b_c, sa_c, sb_c = xs
        # FP8 products are exact in FP32; the chunk sum is an FP32 partial.
        partial = lax.dot_general(
            a_c, b_c, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        # Both operands' 128x1 tile scales are applied to the FP32 partial.
        return acc + partial * sa_c[:, None] * sb_c[None, :], None

    acc, _ = lax.scan(step, jnp.zeros((m, n), jnp.float32), (a_chunks, b_chunks, at_scale, b_scale))
    # One rounding to the output dtype, after all FP32 accumulation.
    return acc.astype(out_dtype)


def block_scaled_matmul_tn(
    at_data: jax.Array,
    at_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int = 8,
) -> jax.Array:
    """Wgrad-style GEMM with 128x1 tiles on both operands ("1D1D"): ``at.T @ b``.

    ``at_data`` (K, M) FP8 with ``at_scale`` (ceil(K/128), M), ``b_data`` (K, N)
    with ``b_scale`` (ceil(K/128), N); K (the token axis in Wgrad) is contracted::

        out[m, n] = sum_c (sum_{k in c} at[k, m] b[k, n]) * at_scale[c, m] * b_scale[c, n]

    With x (T, K_in) and dy (T, N) quantized in 128x1 tiles along T, Wgrad
    ``dW = x^T dy`` is ``block_scaled_matmul_tn(x, sx, dy, sdy)``.
    Both operands are token-major (MN-major for the MMA), while Hopper's FP8
    ``wgmma`` reads only K-major tiles: transposing FP8 tiles on their way to
    shared memory keeps Triton from pipelining the loads (no ``cp.async``;
    loads and math do not overlap).  So both are transposed once in memory,
    one pass over x and dy against the GEMM's 2 M N K operations, and the
    kernel runs the K-major ("nk") layout with per-column scales for b.
    """
    check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype)
    check_blocks(block_m, block_n)
    check_int32_offsets(at_data, b_data)
    return launch(
        _block_scaled_matmul,
        at_data.T,
        at_scale,
        b_data.T,
        b_scale,
        a_layout="mk",
        b_cols=True,
        **_launch_args(
            out_dtype, block_m, block_n, "nk", group_m, num_warps, num_stages, interpret
        ),
    )


def _launch_args(out_dtype, block_m, block_n, b_layout, group_m, num_warps, num_stages, interpret):
    if num_warps is None:
        # Two warpgroups (2 x m64 wgmma) for a 128-row tile, one below.
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 4
    if group_m < 1:
        raise ValueError(f"group_m must be >= 1, got {group_m}")
    return dict(
        out_dtype=jnp.dtype(out_dtype),
        block_m=block_m,
        block_n=block_n,
        b_layout=b_layout,
        group_m=group_m,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
