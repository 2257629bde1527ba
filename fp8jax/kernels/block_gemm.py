"""Block-scaled FP8 GEMM (DeepSeek-V3 / DeepGEMM "1D2D" scaling): operands, references, entry points.

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
E4M3 and E5M2 operands may be mixed (the hybrid recipes' gradients).

The kernel is :mod:`fp8jax.kernels.mgpu_block_gemm` (Mosaic GPU, Hopper FP8
``wgmma``), which reads both operands **K-major**.  The entry points here
bring the operands there:

* :func:`block_scaled_matmul_nt` (B given as (N, K)): nothing to move.  In a
  linear layer y = x W with W (K, N), Dgrad ``dx = dy W^T`` is this call with
  ``bt = W`` as stored.
* :func:`block_scaled_matmul` ((K, N) B, Fprop's W): the caller's B is
  transposed once in XLA (FP8 codes, exact; its 128x128 block scales only
  change places).  ``fp8jax.gemm.weight_both_layouts`` saves that pass where
  W's quantizer writes W^T beside W (``mgpu_quantize.quantize_block_both``).
* :func:`block_scaled_matmul_tn` (Wgrad ``x^T dy``, 128x1 tiles along the
  tokens on both sides): both operands are transposed once (codes and scales)
  so that the tokens are minor.

Shapes that are not multiples of 128 are padded outside the kernel: data
with zeros (a zero product adds nothing), scales with ones (any finite value
would do, ones keep the padding obviously inert), and the result is cropped.

``block_scaled_matmul_reference`` is the same math in plain jnp (a scan over K
chunks, which XLA runs fast on CPU): the CPU path and the test oracle's sibling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import platforms
from fp8jax.formats import IEEE_FP8, KERNEL_FLOATS
from fp8jax.kernels import mgpu_block_gemm as mgpu

#: K chunk = scale tile = promotion interval of the two-level accumulation.
CHUNK = mgpu.CHUNK


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


# ----------------------------------------------------------------------------
# input checks and padding
# ----------------------------------------------------------------------------


def check_types(out_dtype, **codes: jax.Array) -> None:
    """The kernels' dtypes: FP8 ``codes`` (named as the caller's arguments), a wide
    ``out_dtype`` (:data:`fp8jax.formats.KERNEL_FLOATS`)."""
    for name, x in codes.items():
        if jnp.dtype(x.dtype) not in IEEE_FP8:
            raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if jnp.dtype(out_dtype) not in KERNEL_FLOATS:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")


def check_token_tiles(a_data, a_scale, b_data, b_scale, tile_group, out_dtype) -> None:
    """The grouped Wgrad's operands: FP8 codes of x and dy in 128-token tiles (T, 128, M)
    and (T, 128, N), one scale per tile and column (T, 1, M) / (T, 1, N), the expert
    of each tile (T,)."""
    if a_data.ndim != 3 or a_data.shape[1] != CHUNK or b_data.shape[:2] != a_data.shape[:2]:
        raise ValueError(
            f"grouped_wgrad takes (T, {CHUNK}, M) and (T, {CHUNK}, N) tiles, got "
            f"{a_data.shape} and {b_data.shape}"
        )
    t = a_data.shape[0]
    if tile_group.shape != (t,):
        raise ValueError(f"tile_group must be ({t},), got {tile_group.shape}")
    check_types(out_dtype, a_data=a_data, b_data=b_data)
    for name, scale, cols in (
        ("a_scale", a_scale, a_data.shape[2]),
        ("b_scale", b_scale, b_data.shape[2]),
    ):
        if scale.shape != (t, 1, cols):
            raise ValueError(f"{name} must have shape {(t, 1, cols)}, got {scale.shape}")


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
    check_types(out_dtype, a_data=a_data, b_data=b_data)
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


def check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype) -> tuple[int, int, int]:
    """Validate the 1D1D (Wgrad) operands; return (M, K, N) with K the contraction."""
    if at_data.ndim != 2 or b_data.ndim != 2:
        raise ValueError(f"at_data and b_data must be 2D, got {at_data.shape} and {b_data.shape}")
    check_types(out_dtype, at_data=at_data, b_data=b_data)
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


# ----------------------------------------------------------------------------
# entry points (the Mosaic GPU kernel)
# ----------------------------------------------------------------------------


def launch(kernel, *args: jax.Array, interpret, **kw) -> jax.Array:
    """``kernel(*args, interpret=..., **kw)`` with ``interpret`` resolved.

    ``interpret``: False compiles the kernel; None decides per lowering
    platform: compiled where the program is lowered for a CUDA GPU of compute
    capability >= 9.0 (lowered for "cuda" only, see
    :func:`fp8jax.platforms.only_on`), interpreted everywhere else; True runs
    Mosaic GPU's interpreter inside one host callback (:func:`_interpreted`);
    a ``plgpu.InterpretGPUParams`` runs the interpreter inline with those
    settings (e.g. race detection).
    """
    if interpret is None:

        def build(compiled: bool):
            if compiled:
                fn = functools.partial(kernel, interpret=False, **kw)
                return lambda: platforms.only_on(("cuda",), fn, *args)
            return lambda: _interpreted(kernel, args, kw)

        return platforms.choose(lambda p: p == "cuda" and platforms.cuda_at_least("9.0"), build)
    if interpret is True:
        return _interpreted(kernel, args, kw)
    return kernel(*args, interpret=interpret, **kw)


def _interpreted(kernel, args, kw) -> jax.Array:
    """The kernel in Mosaic GPU's interpreter, run inside one ``jax.pure_callback``.

    The interpreter orders its simulated threads with ordered host callbacks;
    a branch with such effects cannot sit next to the compiled kernel in one
    per-platform choice (JAX lowers the choice for CUDA with the compiled
    branch only, whose effects then do not match).  Behind a pure callback
    the interpreter's effects stay inside the host call.  Like every host
    callback it lowers for one platform at a time: a program that names the
    kernel explicitly does not export for several platforms at once.
    """
    params = mgpu.interpret_params()
    out = jax.eval_shape(functools.partial(kernel, interpret=params, **kw), *args)

    def host(*xs):
        return np.asarray(kernel(*xs, interpret=params, **kw))

    return jax.pure_callback(host, out, *args, vmap_method="sequential")


@functools.partial(
    jax.jit, static_argnames=("b_cols", "b_scale_nk", "out_dtype", "interpret", "stages")
)
def _padded_nt(a, a_scale, bt, b_scale_kc, *, b_cols, b_scale_nk, out_dtype, interpret, stages):
    """Pad to the kernel's tiles, run it, crop.  Shapes: see :func:`batched_matmul_nt`.

    Only dimensions whose edge tiles the kernel's TMA copies cannot take in
    place are padded (:func:`fp8jax.kernels.mgpu_block_gemm.edge_dim`: those
    under 128 or not a multiple of 32), so most shapes' operands and results
    reach the kernel and leave it with no copy.  The same products
    either way (a K that ends inside a run: zeros in the rest of it).
    """
    nb, m, k = a.shape
    n = bt.shape[1]
    mp, kp, np_ = (mgpu.edge_dim(d) for d in (m, k, n))
    kc = cdiv(kp, CHUNK)
    # Zero data padding adds exact zeros; unit scale padding keeps it inert.
    a_p = _pad_to(a, (nb, mp, kp), 0)
    b_p = _pad_to(bt, (nb, np_, kp), 0)
    # A's scales as (B, Kc, Mp): each K step loads one contiguous row of 128.
    sa_t = _pad_to(jnp.swapaxes(a_scale, 1, 2), (nb, kc, mp), 1.0)
    sb_shape = mgpu.b_scale_shape(nb, np_, kc, b_cols=b_cols, b_scale_nk=b_scale_nk)
    sb = _pad_to(b_scale_kc, sb_shape, 1.0)
    out = mgpu.matmul_nt(
        a_p,
        sa_t,
        b_p,
        sb,
        b_cols=b_cols,
        b_scale_nk=b_scale_nk,
        out_dtype=out_dtype,
        interpret=interpret,
        stages=stages,
    )
    return out[:, :m, :n]


def _check_batched(a_data, a_scale, bt_data, b_scale_kc, out_dtype, b_cols, b_scale_nk) -> None:
    if a_data.ndim != 3 or bt_data.ndim != 3:
        raise ValueError(f"a_data and bt_data must be 3D, got {a_data.shape} and {bt_data.shape}")
    nb, m, k = a_data.shape
    n = bt_data.shape[1]
    if bt_data.shape[::2] != (nb, k):
        raise ValueError(
            f"bt_data must be (B, N, K) for a_data {a_data.shape}, got {bt_data.shape}"
        )
    check_types(out_dtype, a_data=a_data, bt_data=bt_data)
    kc = cdiv(k, CHUNK)
    b_want = mgpu.b_scale_shape(nb, n, kc, b_cols=b_cols, b_scale_nk=b_scale_nk)
    want = {"a_scale": (nb, m, kc), "b_scale_kc": b_want}
    for (name, shape), sc in zip(want.items(), (a_scale, b_scale_kc)):
        if sc.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {sc.shape}")
        if jnp.dtype(sc.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {sc.dtype}")


def batched_matmul_nt(
    a_data: jax.Array,
    a_scale: jax.Array,
    bt_data: jax.Array,
    b_scale_kc: jax.Array,
    *,
    b_cols: bool = False,
    b_scale_nk: bool = False,
    out_dtype=jnp.bfloat16,
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """A batch of K-major block-scaled GEMMs: ``out[i] = a[i] @ bt[i]^T``, (B, M, N).

    ``a_data`` (B, M, K) FP8 with ``a_scale`` (B, M, Kc) 1x128 tile scales;
    ``bt_data`` (B, N, K) FP8 with ``b_scale_kc`` (B, Kc, Nc) 128x128 block
    scales, with ``b_scale_nk`` the same blocks as (B, Nc, Kc) (``bt``'s own
    block grid: Dgrad's weight scales as stored, read in place of a
    transposed copy), or with ``b_cols`` (B, Kc, N) scales of 128x1 tiles (one
    per row of ``bt`` and K run: Wgrad's token tiles).  ``interpret``: see
    :func:`launch`.
    """
    _check_batched(a_data, a_scale, bt_data, b_scale_kc, out_dtype, b_cols, b_scale_nk)
    return launch(
        _padded_nt,
        a_data,
        a_scale,
        bt_data,
        b_scale_kc,
        interpret=interpret,
        b_cols=b_cols,
        b_scale_nk=b_scale_nk,
        out_dtype=jnp.dtype(out_dtype),
        stages=stages,
    )


def block_scaled_matmul(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """FP8 block-scaled GEMM ``(M, K) x (K, N) -> (M, N)`` with FP32 accumulation.

    See the module docstring for layouts and math.  B is transposed to (N, K)
    in XLA before the kernel (FP8 ``wgmma`` reads K-major operands only).
    ``interpret``: see :func:`launch`; ``stages``: K steps in flight.
    """
    check_operands(a_data, a_scale, b_data, b_scale, out_dtype, b_layout="kn")
    return _single(a_data, a_scale, b_data.T, b_scale, out_dtype, interpret, stages)


def block_scaled_matmul_nt(
    a_data: jax.Array,
    a_scale: jax.Array,
    bt_data: jax.Array,
    bt_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """``block_scaled_matmul`` with B given transposed: ``out = A @ bt.T``.

    ``bt_data`` (N, K) FP8, ``bt_scale`` (ceil(N/128), ceil(K/128)).  Both
    operands are then K-major, the layout Hopper's FP8 ``wgmma`` reads: the
    kernel's own layout, nothing is moved (the kernel reads ``bt_scale`` as
    given, ``b_scale_nk``).  In a linear layer y = x W with W
    (K, N), Dgrad ``dx = dy W^T`` is exactly this call with ``bt = W``.
    """
    check_operands(a_data, a_scale, bt_data, bt_scale, out_dtype, b_layout="nk")
    return _single(
        a_data, a_scale, bt_data, bt_scale, out_dtype, interpret, stages, b_scale_nk=True
    )


def block_scaled_matmul_tn(
    at_data: jax.Array,
    at_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    interpret=None,
    stages: int = mgpu.STAGES,
) -> jax.Array:
    """Wgrad-style GEMM with 128x1 tiles on both operands ("1D1D"): ``at.T @ b``.

    ``at_data`` (K, M) FP8 with ``at_scale`` (ceil(K/128), M), ``b_data`` (K, N)
    with ``b_scale`` (ceil(K/128), N); K (the token axis in Wgrad) is contracted::

        out[m, n] = sum_c (sum_{k in c} at[k, m] b[k, n]) * at_scale[c, m] * b_scale[c, n]

    With x (T, K_in) and dy (T, N) quantized in 128x1 tiles along T, Wgrad
    ``dW = x^T dy`` is ``block_scaled_matmul_tn(x, sx, dy, sdy)``.  Both
    operands are token-major (MN-major for the MMA) while FP8 ``wgmma`` reads
    K-major operands only: both are transposed once in XLA (codes and tile
    scales; exact), one pass over x and dy against the GEMM's 2 M N K
    operations, and the kernel promotes each run with the row scales of
    ``at`` times the per-column scales of ``b``.
    """
    check_tn_operands(at_data, at_scale, b_data, b_scale, out_dtype)
    return _single(
        at_data.T, at_scale.T, b_data.T, b_scale, out_dtype, interpret, stages, b_cols=True
    )


def _single(
    a, a_scale, bt, b_scale, out_dtype, interpret, stages, *, b_cols=False, b_scale_nk=False
) -> jax.Array:
    """One K-major GEMM (a batch of one) of :func:`batched_matmul_nt`."""
    return batched_matmul_nt(
        a[None],
        a_scale[None],
        bt[None],
        b_scale[None],
        b_cols=b_cols,
        b_scale_nk=b_scale_nk,
        out_dtype=out_dtype,
        interpret=interpret,
        stages=stages,
    )[0]
