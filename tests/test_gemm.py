"""The GEMM core: implementation choice, the chunked-codes path, named dot algorithms."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import gemm, host_cpu, scaling
from fp8jax.grouped import grouped_dot

FP8_PRESETS = ["deepseek_v3", "current_tensor", "rowwise", "hybrid_delayed"]
ALL_PRESETS = FP8_PRESETS + ["bf16", "fp32"]


def _q(t, granularity, axis=-1):
    return fp8jax.quantize(jnp.asarray(t, jnp.float32), fp8jax.E4M3, granularity, axis=axis)


@pytest.mark.parametrize("bf16_dot,want", [(True, "chunked"), (None, "chunked"), (False, "xla")])
def test_auto_on_cpu_follows_the_bfloat16_dot_instructions(monkeypatch, bf16_dot, want):
    # "chunked" dots FP8 codes as bfloat16: where the CPU has no bfloat16 dot
    # (XLA widens to float32 per run) "auto" takes one float32 dot instead;
    # unknown hardware keeps "chunked".
    monkeypatch.setattr(host_cpu, "has_bf16_dot", lambda: bf16_dot)
    a = _q(np.ones((1, 4, 256)), "tile", 2)
    b = _q(np.ones((1, 256, 8)), "block")
    assert gemm.auto_impl("fp8", "cpu", a, b) == want


def test_select_impl_dispatch_on_cpu():
    r = fp8jax.recipes.deepseek_v3()
    a = _q(np.ones((1, 4, 256)), "tile", 2)
    b = _q(np.ones((1, 256, 8)), "block")
    # Off the kernels, "auto" is "chunked" for FP8 (on a CPU: unless it has
    # no bfloat16 dot instructions, then "xla") and "xla" for the block formats.
    per_tensor = _q(np.ones((1, 4, 256)), "tensor"), _q(np.ones((1, 256, 8)), "tensor")
    assert gemm.auto_impl("fp8", "tpu", *per_tensor) == "chunked"
    for backend in ("cpu", "tpu"):
        assert gemm.auto_impl("mx", backend) == gemm.auto_impl("nvfp4", backend) == "xla"
    with pytest.raises(ValueError, match="no implementation"):
        gemm.auto_impl("fp8", "abacus")
    if jax.default_backend() == "cpu":
        want = "xla" if host_cpu.has_bf16_dot() is False else "chunked"
        assert gemm.select_impl(r, a, b, "fprop") == want
        assert gemm.select_impl(dataclasses.replace(r, impl="xla"), a, b, "fprop") == "xla"
    # Hardware FP8 dots: named for any platform, refused (at lowering) on a CPU.
    for impl in ("fp8", "fp8_fast"):
        assert gemm.select_impl(dataclasses.replace(r, impl=impl), a, b, "fprop", "cpu") == impl
        assert "GPU or TPU" in gemm.unsupported(impl, "cpu")
        assert gemm.unsupported(impl, "cuda") is None and gemm.unsupported(impl, "tpu") is None
    assert gemm.select_impl(dataclasses.replace(r, impl="chunked"), a, b, "fprop") == "chunked"
    assert gemm.select_impl(dataclasses.replace(r, impl="pallas"), a, b, "fprop") == "pallas"
    # The emulator wins whatever impl says; unquantized operands run "plain".
    emu = fp8jax.recipes.deepseek_v3(accumulation=fp8jax.Accumulation())
    assert gemm.select_impl(emu, a, b, "fprop") == "emulate"
    assert gemm.select_impl(r, jnp.ones((1, 4, 256)), b, "fprop") == "plain"
    with pytest.raises(ValueError, match="impl"):
        dataclasses.replace(r, impl="cublas")


def test_auto_on_tpu_takes_the_mosaic_kernel_where_the_layouts_fit():
    tiles, blocks = _q(np.ones((1, 4, 256)), "tile", 2), _q(np.ones((1, 256, 8)), "block")
    assert gemm.auto_impl("fp8", "tpu", tiles, blocks) == "pallas"
    assert gemm.auto_impl("fp8", "tpu") == "chunked"  # no operands: layouts unknown
    r = fp8jax.recipes.deepseek_v3()
    impl, how = gemm._decision(r, tiles, blocks, "fprop", "tpu")
    assert (impl, how) == ("pallas", "mosaic")
    assert gemm.describe_path(impl, r, tiles, blocks, how) == "pallas tpu"
    # The CPU keeps its path: the kernel is lowered for TPU only.
    assert gemm._decision(r, tiles, blocks, "fprop", "cpu")[0] != "pallas"


def test_auto_on_cuda_follows_the_target():
    # Hopper and later: the Pallas kernel where the layouts fit, "chunked"
    # elsewhere (hardware FP8 dots are named, not chosen); an Ampere target
    # has no FP8 tensor cores.
    tiles, blocks = _q(np.ones((1, 4, 256)), "tile", 2), _q(np.ones((1, 256, 8)), "block")
    per_tensor = _q(np.ones((1, 4, 256)), "tensor"), _q(np.ones((1, 256, 8)), "tensor")
    assert gemm.auto_impl("fp8", "cuda", tiles, blocks) == "pallas"
    assert gemm.auto_impl("fp8", "cuda", *per_tensor) == "chunked"
    assert gemm.auto_impl("fp8", "rocm", tiles, blocks) == "chunked"
    with fp8jax.platforms.cuda_target("8.0"):
        assert gemm.auto_impl("fp8", "cuda", tiles, blocks) == "chunked"
        assert "8.9" in gemm.unsupported("fp8", "cuda")
    with fp8jax.platforms.cuda_target("10.0"):
        assert gemm.auto_impl("mx", "cuda") == "scaled_matmul"
    assert gemm.auto_impl("mx", "cuda") == "xla"  # Hopper: no block-scaled tensor cores


def test_hardware_fp8_dots_are_refused_where_lowered_for_a_cpu():
    r = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl="fp8")
    x, w = jnp.ones((4, 256)), jnp.ones((256, 128))
    f = lambda x, w: fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=r)  # noqa: E731
    with pytest.raises(ValueError, match="hardware FP8 dots"):
        jax.jit(f).trace(x, w).lower(lowering_platforms=("cpu",))
    # The same traced program lowers for a GPU: FP8 operands, the named algorithm.
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "lhs_precision_type = f8E4M3FN" in text


def _f64(op):
    return np.asarray(fp8jax.dequantize(op), np.float64)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("spec", [("tile", "block"), ("tensor", "tensor"), ("row", "row")])
def test_chunked_path_matches_float64(kind, spec, use_jit):
    """chunked = exact products, float32 sums: |y - y64| <= (L + 2R + 2) u sum|a b|.

    L is the run length (128 for tiles / blocks, all of K per tensor or row:
    R = 1 run).  The products of FP8 codes are exact; within one run XLA sums
    them in float32 in its own order (L - 1 roundings of at most u = 2^-24
    relative to the running |sum| <= sum|a b|).  The scale fl(s_a s_b) is one
    rounding.  Promotion, acc + run_sum * s: XLA fuses it into one FMA (one
    rounding per run), but whether it fuses is XLA's code generation, so the
    bound allows two (product, then sum) per run: 2R.  One more u of slack
    for the linearisation.  The float64 reference dequantizes the same codes
    and scales exactly.
    """
    rng = np.random.default_rng(0)
    bsz, m, k, n = 2, 37, 300, 45  # odd shapes: partial tiles and blocks
    ga, gb = spec
    x = rng.standard_normal((bsz, m, k)) * np.exp(rng.uniform(-3, 3, (1, 1, k)))
    w = rng.standard_normal((bsz, k, n))
    dy = rng.standard_normal((bsz, m, n))
    if kind == "fprop":
        a, b = _q(x, ga, 2), _q(w, gb, 1)
        ref = lambda a, b: np.einsum("bmk,bkn->bmn", a, b)
        length = k
    elif kind == "dgrad":
        a, b = _q(dy, ga, 2), _q(w, gb, 2)
        ref = lambda a, b: np.einsum("bmn,bkn->bmk", a, b)
        length = n
    else:
        a, b = _q(x, "tile" if ga == "tile" else ga, 1), _q(dy, "tile" if ga == "tile" else ga, 1)
        ref = lambda a, b: np.einsum("bmk,bmn->bkn", a, b)
        length = m
    recipe = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl="chunked")
    fn = jax.jit(gemm.gemm, static_argnums=(2, 3)) if use_jit else gemm.gemm
    got = np.asarray(fn(a, b, kind, recipe), np.float64)
    want = ref(_f64(a), _f64(b))
    mag = ref(np.abs(_f64(a)), np.abs(_f64(b)))
    # Tiles and blocks: runs of 128; per tensor / per row: one run of all of K.
    runs = -(-length // 128) if ga == "tile" else 1
    run_len = min(length, 128) if ga == "tile" else length
    bound = (run_len + 2 * runs + 2) * 2.0**-24 * mag
    assert np.all(np.abs(got - want) <= bound)
    # The dequantize-then-dot path obeys the same kind of bound (plus one rounding per operand).
    xla = np.asarray(gemm.gemm(a, b, kind, dataclasses.replace(recipe, impl="xla")), np.float64)
    assert np.all(np.abs(xla - want) <= (length + 4) * 2.0**-24 * mag)


@pytest.mark.parametrize("use_jit", [False, True])
def test_chunked_bound_holds_for_one_long_run(use_jit):
    """Per-tensor scales: one run of K = 4096 positive products, where sums grow the most.

    The float32 sum of L exact products in any order is within (L - 1) u
    sum|a b| of the exact sum; one run is scaled once, by fl(s_a s_b): the
    scale product and the multiply, 2 roundings (no accumulator to fuse).
    """
    rng = np.random.default_rng(3)
    k = 4096
    a = _q(rng.uniform(0, 1, (1, 4, k)), "tensor", 2)
    b = _q(rng.uniform(0, 1, (1, k, 3)), "tensor", 1)
    recipe = dataclasses.replace(fp8jax.recipes.current_tensor(), impl="chunked")
    fn = jax.jit(gemm.gemm, static_argnums=(2, 3)) if use_jit else gemm.gemm
    got = np.asarray(fn(a, b, "fprop", recipe), np.float64)
    want = np.einsum("bmk,bkn->bmn", _f64(a), _f64(b))
    assert np.all(np.abs(got - want) <= (k + 2) * 2.0**-24 * want)


@pytest.mark.parametrize("name", FP8_PRESETS)
def test_every_preset_runs_chunked_end_to_end(name):
    """dot_general with impl='chunked' vs 'xla': the same quantized GEMMs, float32 apart."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 70, 200)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((200, 90)) / 14, jnp.float32)
    dn = (((2,), (0,)), ((), ()))
    base = fp8jax.registry.get(name)
    state = scaling.init_delayed_gemm_state(base) if fp8jax.needs_state(base) else None

    # A loss linear in y: dy does not depend on the forward's rounding.
    c = jnp.asarray(rng.standard_normal((3, 70, 90)), jnp.float32)

    def grads(impl):
        r = dataclasses.replace(base, impl=impl)
        f = lambda x, w: jnp.sum(fp8jax.dot_general(x, w, dn, recipe=r, state=state) * c)
        return jax.grad(f, (0, 1))(x, w)

    for a, b in zip(grads("chunked"), grads("xla")):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def _dots(jaxpr, out):
    """Every dot_general / ragged_dot equation of a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            out.append(eqn)
        for v in eqn.params.values():
            for sub in v if isinstance(v, list | tuple) else [v]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _dots(sub.jaxpr, out)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _dots(sub, out)
    return out


def _named(eqn) -> bool:
    p = eqn.params.get("precision")
    if isinstance(p, jax.lax.DotAlgorithmPreset):
        return p != jax.lax.DotAlgorithmPreset.DEFAULT
    if isinstance(p, tuple):
        return all(q == jax.lax.Precision.HIGHEST for q in p)
    return False


@pytest.mark.parametrize("name", ALL_PRESETS)
@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_every_float32_dot_names_its_algorithm(name, impl):
    """Forward + backward of every preset, dense and grouped: no float32 dot at the backend's default."""
    base = dataclasses.replace(fp8jax.registry.get(name), impl=impl)
    state = scaling.init_delayed_gemm_state(base) if fp8jax.needs_state(base) else None
    x = jnp.ones((2, 40, 130), jnp.float32)
    w = jnp.ones((130, 20), jnp.float32)
    we = jnp.ones((3, 130, 20), jnp.float32)
    gs = jnp.asarray([30, 0, 40], jnp.int32)

    def loss(x, w, we):
        y = fp8jax.dot_general(x, w, (((2,), (0,)), ((), ())), recipe=base, state=state)
        z = grouped_dot(x.reshape(80, 130), we, gs, recipe=base, state=state)
        return jnp.sum(y) + jnp.sum(z)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, w, we)
    dots = _dots(jaxpr.jaxpr, [])
    assert dots
    for eqn in dots:
        if any(v.aval.dtype in (jnp.float32, jnp.bfloat16) for v in eqn.invars):
            assert _named(eqn), f"{name}: {eqn.primitive} on {[v.aval for v in eqn.invars]}"


def test_model_layers_name_their_algorithm():
    """The high-precision layers (router, attention core, head) and the MoE combine too."""
    from flax import nnx

    from fp8jax.models import ModelConfig, MoETransformer, loss_fn

    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_dense_layers=1, n_heads=2, head_dim=16,
        d_ff=64, n_routed_experts=4, top_k=2, d_expert=16, max_seq_len=16,
    )  # fmt: skip
    model = MoETransformer(cfg, fp8jax.recipes.bf16(), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 8), jnp.int32)

    def f(params):
        return loss_fn(nnx.merge(graphdef, params), tokens)[0]

    dots = _dots(jax.make_jaxpr(jax.grad(f))(params).jaxpr, [])
    assert dots and all(_named(e) for e in dots)


@pytest.mark.parametrize("use_jit", [False, True])
@pytest.mark.parametrize(
    ("impl", "kind", "spec"),
    [
        ("chunked", "fprop", "block"),
        ("chunked", "dgrad", "block"),
        ("chunked", "fprop", "tensor"),
        ("xla", "dgrad", "block"),
    ],
)
def test_indexed_b_equals_gathered_b(use_jit, impl, kind, spec):
    """gemm(a, b, b_index=i) is gemm(a, b[i]) up to float32 summation order within a run,
    and near the float64 product."""
    rng = np.random.default_rng(5)
    # Three batch elements (tiles) over two experts' weights; K = 320 (3 runs, the last short).
    a_shape = (3, 8, 320) if kind == "fprop" else (3, 8, 16)
    a = _q(rng.normal(size=a_shape), "tile", 2)
    w = _q(rng.normal(size=(2, 320, 16)), spec)
    index = jnp.asarray([1, 0, 1])
    recipe = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl=impl)

    def run(a, w, index):
        return gemm.gemm(a, w, kind, recipe, b_index=index), gemm.gemm(
            a, gemm.take_batch(w, index), kind, recipe
        )

    got, want = (jax.jit(run) if use_jit else run)(a, w, index)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    wf = _f64(w)[np.asarray(index)]
    ref = np.einsum("bmk,bkn->bmn", _f64(a), wf) if kind == "fprop" else None
    if ref is None:
        ref = np.einsum("bmn,bkn->bmk", _f64(a), wf)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "change, want",
    [({}, True), ({"pow2": True}, False), ({"amax_floor": 1e-4}, False), ({"tile": 64}, False)],
)
def test_dgrad_writes_the_wgrad_tiles_only_where_they_are_the_wgrads(change, want):
    # The quantizing Dgrad kernel's 128-token tiles of dy replace the column
    # quantizer's only where the Wgrad spec quantizes as the Dgrad's does, and
    # where the Wgrad's operand has the kernel's form (codes as dy, float32
    # scales (B, ceil(M/128), N)).
    from fp8jax.operands import quantize_operand

    recipe = fp8jax.recipes.deepseek_v3()
    dy = jax.ShapeDtypeStruct((1, 300, 256), jnp.bfloat16)
    wgrad_spec = dataclasses.replace(recipe.wgrad.rhs, **change)
    take = functools.partial(quantize_operand, spec=wgrad_spec, caxis=1, recipe=recipe)
    qdy_w = jax.eval_shape(take, dy)[0]
    got = gemm._dgrad_writes_wgrad_tiles(dy, recipe.dgrad.lhs, wgrad_spec, qdy_w)
    assert got == want
    if want:
        assert qdy_w.scale.shape == (1, 3, 256) and qdy_w.data.dtype == jnp.float8_e4m3fn
    assert not gemm._dgrad_writes_wgrad_tiles(dy, recipe.dgrad.lhs, None, qdy_w)


@pytest.mark.parametrize("use_jit", [False, True])
def test_fprop_reads_the_weights_transposed_codes_where_its_quantizer_wrote_them(use_jit):
    # The Mosaic GPU kernel (its interpreter here) reads w K-major: given the
    # codes transposed (as fp8jax.mgpu_quantize.quantize_block_both writes them
    # beside w's), it reads those instead of transposing w's: the same product.
    r = dataclasses.replace(fp8jax.recipes.deepseek_v3(), impl="pallas")
    rng = np.random.default_rng(3)
    qx = _q(rng.normal(size=(1, 128, 256)), "tile", 2)
    qw = _q(rng.normal(size=(1, 256, 128)), "block")
    codes_t = jnp.swapaxes(qw.data, 1, 2)

    def run(codes_t):
        return gemm.gemm(qx, qw, "fprop", r, out_dtype=jnp.bfloat16, b_codes_t=codes_t)

    run = jax.jit(run) if use_jit else run
    want = np.asarray(run(None), np.float32)
    np.testing.assert_array_equal(np.asarray(run(codes_t), np.float32), want)
    # They are what the kernel reads: other codes, another product.
    other = np.asarray(run(jnp.flip(codes_t, axis=1)), np.float32)
    assert not np.array_equal(other, want)
    # Codes of another shape, or for another GEMM, are refused.
    with pytest.raises(ValueError, match="b_codes_t"):
        run(qw.data)
    with pytest.raises(ValueError, match="b_codes_t"):
        gemm.gemm(qx, qw, "dgrad", r, b_codes_t=codes_t)
