"""fp8jax.parallel on 8 simulated CPU devices: mesh, sharding rules, FP8 dispatch, FP8 gathers.

JAX fixes its device count when its backend starts: the flag below gives 8
CPU devices when this module is imported first (``pytest tests/test_parallel.py``);
in a larger run where the backend already started with fewer devices, each
test re-runs itself in a subprocess with the flag.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8jax  # noqa: E402
from fp8jax.grouped import grouped_dot  # noqa: E402
from fp8jax.layout import Layout  # noqa: E402
from fp8jax.operands import materialize  # noqa: E402
from fp8jax.parallel import dispatch as dsp  # noqa: E402
from fp8jax.parallel import fsdp, placement  # noqa: E402
from fp8jax.parallel.experts import sort_by_expert  # noqa: E402
from fp8jax.parallel.mesh import (  # noqa: E402
    axis_sizes,
    batch_sharding,
    global_batch,
    make_mesh,
    maybe_initialize_distributed,
)
from fp8jax.quant import QTensor  # noqa: E402


def on_8_devices(fn):
    """Run ``fn`` here when 8 devices exist, else in a subprocess that has them."""

    @functools.wraps(fn)
    def wrapper():
        if jax.device_count() >= 8:
            return fn()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", f"{__file__}::{fn.__name__}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]

    return wrapper


# --------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------


def test_axis_sizes_resolve_the_rest():
    assert axis_sizes(None, 8) == {"data": 8, "fsdp": 1, "expert": 1}
    assert axis_sizes({"data": 2, "fsdp": -1, "expert": 2}, 8) == {
        "data": 2,
        "fsdp": 2,
        "expert": 2,
    }
    assert axis_sizes((1, 4, 2), 8) == {"data": 1, "fsdp": 4, "expert": 2}
    assert axis_sizes({"expert": 1}, 1) == {"data": 1, "fsdp": 1, "expert": 1}
    for bad, msg in (
        ({"data": -1, "fsdp": -1}, "at most one"),
        ({"data": 3, "fsdp": -1}, "not a multiple"),
        ({"data": 2, "fsdp": 2, "expert": 1}, "needs 4 devices"),
        ({"model": 2}, "unknown mesh axes"),
        ({"data": 0}, "positive"),
    ):
        with pytest.raises(ValueError, match=msg):
            axis_sizes(bad, 8)


def test_no_distributed_without_request(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    assert maybe_initialize_distributed({"num_processes": 1}) is False
    assert maybe_initialize_distributed(None) is False


@on_8_devices
def test_mesh_and_process_batch():
    mesh = make_mesh({"data": 2, "fsdp": 2, "expert": -1})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2}
    rows = np.arange(16 * 4, dtype=np.int32).reshape(16, 4)
    arr = global_batch(rows, mesh)
    assert arr.sharding == batch_sharding(mesh)
    assert len(arr.addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(arr), rows)
    # Each device holds its own 2 rows.
    assert {s.data.shape for s in arr.addressable_shards} == {(2, 4)}
    with pytest.raises(ValueError, match="does not split"):
        global_batch(rows[:12], mesh)


# --------------------------------------------------------------------------
# Sharding rules
# --------------------------------------------------------------------------


@on_8_devices
def test_rules_shard_params_and_moments_alike():
    from fp8jax.models import ModelConfig, MoETransformer
    from fp8jax.train.optimizer import make_optimizer
    from fp8jax.train.state import create_train_state

    cfg = ModelConfig.tiny()
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=4, warmup_steps=1, moment_dtype="bfloat16")
    # Shapes only: the rules read paths and shapes, not values.
    model = nnx.eval_shape(
        lambda: MoETransformer(cfg, fp8jax.recipes.bf16(), rngs=nnx.Rngs(0), telemetry=False)
    )
    _, state = jax.eval_shape(lambda: create_train_state(model, tx))
    mesh = make_mesh((1, 4, 2))
    ps = placement.tree_shardings(state.params, mesh, cfg.n_routed_experts)
    e, d, f = cfg.n_routed_experts, cfg.d_model, cfg.d_expert
    w13 = ps["blocks"][1]["ffn"]["w13"].value
    # Experts over "expert", FSDP over the largest other divisible axis (2F = 128).
    assert w13.spec == P("expert", None, "fsdp"), (w13.spec, (e, d, 2 * f))
    # A Dense kernel: its first (input-feature) axis, whole rows of its (K, N) matrix.
    assert ps["blocks"][1]["ffn"]["shared"]["w13"]["kernel"].value.spec == P("fsdp", None, None)
    assert ps["embed"].value.spec == P("fsdp", None)  # (256, 64): the vocabulary axis
    os_ = placement.tree_shardings(state.opt_state, mesh, cfg.n_routed_experts)
    mu = os_[1].mu["blocks"][1]["ffn"]["w13"].value
    assert state.opt_state[1].mu["blocks"][1]["ffn"]["w13"].value.dtype == jnp.bfloat16
    assert mu.spec == w13.spec and os_[1].count.spec == P()
    # Placed: 8 experts over 2 shards, 128 columns over 4 -> (4, 64, 32) per device.
    w = placement.shard_tree({"ffn": {"w13": jnp.zeros((e, d, 2 * f))}}, mesh, e)["ffn"]["w13"]
    assert w.addressable_shards[0].data.shape == (e // 2, d, 2 * f // 4)


# --------------------------------------------------------------------------
# FP8 expert dispatch
# --------------------------------------------------------------------------

T_LOC, D, E, K, F = 16, 256, 8, 2, 128
FP32 = fp8jax.recipes.fp32()
DSV3 = fp8jax.recipes.deepseek_v3()
# The up-projection's recipe with DeepSeek-V3's power-of-two dispatch scales.
DSV3_POW2 = fp8jax.recipes.for_site(dataclasses.replace(DSV3, dispatch_pow2=True), "dispatch")
E4M3_NP = ml_dtypes.float8_e4m3fn


def _ep_mesh():
    return make_mesh({"data": 2, "fsdp": 1, "expert": 4})


def _routing(seed=0, n_tok=8 * T_LOC):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, D)).astype(np.float32) * np.exp(rng.normal(0, 2, (n_tok, 1)))
    scores = rng.standard_normal((n_tok, E))
    idx = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    gates = rng.uniform(0.1, 1.0, (n_tok, K)).astype(np.float32)
    return x.astype(np.float32), idx, gates


def _np_pow2_tiles(x):
    """Reference 1x128 E4M3 quantization with power-of-two scales (numpy / ml_dtypes)."""
    xt = x.reshape(x.shape[0], -1, 128).astype(np.float64)
    amax = np.maximum(np.abs(xt).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    codes = np.clip(xt / scale, -448, 448).astype(E4M3_NP)
    return (codes.astype(np.float64) * scale).reshape(x.shape)


@jax.custom_vjp
def _value(q):
    """A QTensor's values, with the straight-through cotangent contract (test consumer)."""
    return fp8jax.dequantize(q)


_value.defvjp(
    lambda q: (fp8jax.dequantize(q), q.scale),
    lambda s, g: (QTensor(g, jnp.zeros_like(s), Layout("tile", 1, 128)),),
)


@pytest.mark.parametrize("use_jit", [False, True])
def test_dispatch_stats_carry_no_gradient(use_jit):
    # The dispatch's telemetry under autodiff (the expert-parallel train
    # step): the same statistics, no gradient, and no differentiation of the
    # quantizer's other platforms' kernels (which have no JVP rule).
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)), jnp.float32)
    stats = dsp.dispatch_stats(x, DSV3)

    def amax(x):
        return dsp.dispatch_stats(x, DSV3)["amax"]

    fn = jax.jit(jax.value_and_grad(amax)) if use_jit else jax.value_and_grad(amax)
    value, grad = fn(x)
    assert float(value) == float(stats["amax"]) == float(np.max(np.abs(np.asarray(x))))
    assert not np.any(np.asarray(grad))


@on_8_devices
def test_dispatch_moves_fp8_codes_and_fp8_gradients():
    mesh = _ep_mesh()
    x, idx, _ = _routing()
    gt = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32) * 3.0
    bs = NamedSharding(mesh, P(("data", "fsdp", "expert")))

    def body(x, idx, gt):
        route = dsp.plan_route(idx, E, "expert")
        q = dsp.dispatch(x, route, "expert", DSV3_POW2)
        # The same rows in float32 (exact copies) let the test see what arrived.
        plain = dsp.dispatch(x, route, "expert", FP32)
        g_rows = dsp.dispatch(gt, route, "expert", FP32)
        loss = jnp.sum(_value(q) * g_rows)
        return q.data, q.scale, plain, route.group_sizes[None], route.dropped[None], loss[None]

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(("data", "fsdp", "expert")),) * 3,
            out_specs=P(("data", "fsdp", "expert")),
            check_vma=False,
        )
    )
    args = [jax.device_put(a, bs) for a in (x, idx, gt)]
    codes, scale, plain, gs, dropped, _ = fn(*args)
    assert codes.dtype == fp8jax.E4M3 and int(np.sum(dropped)) == 0
    # Dropless: every expert got all its assignments (the ones of its own data group).
    assert int(np.sum(gs)) == x.shape[0] * K
    plain = np.asarray(plain)
    n = int(np.sum(gs[:1]))
    ref = _np_pow2_tiles(plain[:n])
    got = np.asarray(codes[:n]).astype(np.float64) * np.repeat(np.asarray(scale[:n]), 128, axis=1)
    np.testing.assert_array_equal(got, ref)

    # Backward: the gradient of x is the sum over the k copies of the rows'
    # gradient after one E4M3 / power-of-two round trip.
    def loss(x):
        return jnp.sum(fn(x, args[1], args[2])[5])

    for f in (jax.grad(loss), jax.jit(jax.grad(loss))):
        dx = np.asarray(f(args[0]))
        np.testing.assert_array_equal(dx, (K * _np_pow2_tiles(gt)).astype(np.float32))


def _unsharded_ref(x, idx, gates, w, c, recipe):
    """Unsharded: the grouped GEMM over all tokens sorted by expert, then the BF16 combine.

    Returns (out, dw, gradient of each sorted row before its E4M3 round trip, token of each row).
    """
    order, token, gs = sort_by_expert(idx, E)

    def f(xs, w):
        y = grouped_dot(xs, w, gs, recipe=recipe, preferred_element_type=jnp.float32)
        # Combine: BF16 rows, gate-weighted sum in float32.
        y = y.astype(jnp.bfloat16)[jnp.argsort(order)].astype(jnp.float32).reshape(-1, K, F)
        return jnp.einsum("tkd,tk->td", y, gates)

    out, vjp = jax.vjp(f, x[token], w)
    dx_rows, dw = vjp(c)
    return out, dw, dx_rows, token


@on_8_devices
def test_ep_grouped_gemm_equals_unsharded_on_same_fp8_tokens():
    mesh = _ep_mesh()
    x, idx, gates = _routing(seed=2)
    w = (np.random.default_rng(3).standard_normal((E, D, F)) / 16).astype(np.float32)
    c = np.random.default_rng(4).standard_normal((x.shape[0], F)).astype(np.float32)
    bs = P(("data", "fsdp", "expert"))
    # The up-projection's recipe: deepseek_v3's tiles (float32 scales on the wire).
    rs = fp8jax.recipes.for_site(DSV3, "dispatch")

    def body(x, idx, gates, w_loc):
        route = dsp.plan_route(idx, E, "expert")
        q = dsp.dispatch(x, route, "expert", rs)
        y = grouped_dot(q, w_loc, route.group_sizes, recipe=rs, preferred_element_type=jnp.float32)
        return dsp.combine(y, route, gates, "expert")

    ep = jax.shard_map(
        body, mesh=mesh, in_specs=(bs, bs, bs, P("expert")), out_specs=bs, check_vma=False
    )

    @jax.jit
    def run(x, w):
        out, vjp = jax.vjp(lambda x, w: ep(x, idx, gates, w), x, w)
        return (out, *vjp(jnp.asarray(c)), *_unsharded_ref(x, idx, gates, w, c, rs))

    out, dx, dw, ref, dw_ref, dx_rows, token = (np.asarray(t) for t in run(x, w))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    # w: Wgrad quantizes x and dy in 128x1 tiles of each expert's tokens; here
    # each data group's tokens form their own tiles, so the E4M3 roundings
    # differ (measured 2.5%, about E4M3's own relative error) while the sum
    # over data groups is right.
    err_w = np.linalg.norm(dw - dw_ref) / np.linalg.norm(dw_ref)
    assert err_w < 5e-2, err_w
    # x: each row's gradient after one E4M3 / power-of-two round trip, summed per token.
    dx_ref = np.zeros_like(x, dtype=np.float64)
    np.add.at(dx_ref, token, _np_pow2_tiles(dx_rows))
    err = np.linalg.norm(dx - dx_ref) / np.linalg.norm(dx_ref)
    # Equal but for rows whose float32 Dgrad order flips one E4M3 rounding.
    assert err < 1e-3, err


@on_8_devices
def test_capacity_drops_are_counted():
    mesh = make_mesh({"data": 1, "fsdp": 1, "expert": 8})
    n_tok = 8 * T_LOC
    x = np.random.default_rng(5).standard_normal((n_tok, D)).astype(np.float32)
    # Every token picks experts 0 and 1 (one expert per shard: shards 0 and 1).
    idx = np.tile(np.array([[0, 1]], np.int32), (n_tok, 1))
    bs = P(("data", "fsdp", "expert"))

    def body(x, idx):
        route = dsp.plan_route(idx, E, "expert", capacity_factor=2.0)
        rows = dsp.dispatch(x, route, "expert", FP32)
        return rows, route.group_sizes[None], route.dropped[None]

    rows, gs, dropped = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(bs, bs), out_specs=bs, check_vma=False)
    )(x, idx)
    cap = dsp.capacity_rows(T_LOC * K, 8, 2.0)  # ceil(2 * 32 / 8) = 8 rows per (source, dest)
    assert cap == 8
    # Each source sends 16 rows to shard 0 and 16 to shard 1: 8 of each dropped.
    np.testing.assert_array_equal(np.asarray(dropped), np.full(8, 2 * (T_LOC - cap)))
    gs = np.asarray(gs).reshape(8)
    assert gs.tolist() == [8 * cap, 8 * cap] + [0] * 6
    # Shards 0 and 1 keep each source's first 8 tokens, unchanged.
    src_first = x.reshape(8, T_LOC, D)[:, :cap].reshape(8 * cap, D)
    for shard in (0, 1):
        got = np.asarray(rows).reshape(8, -1, D)[shard][: 8 * cap]
        np.testing.assert_array_equal(got, src_first)


def test_pow2_scales_pack_into_one_byte():
    s = jnp.asarray([2.0**-126, 2.0**-10, 1.0, 2.0**40], jnp.float32)
    e = dsp.pack_pow2(s)
    assert e.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(dsp.unpack_pow2(e)), np.asarray(s))
    assert dsp.fp8_dispatch_spec(fp8jax.recipes.bf16()) is None
    assert dsp.fp8_dispatch_spec(fp8jax.recipes.current_tensor()) is None
    with pytest.raises(ValueError, match="capacity_factor"):
        dsp.capacity_rows(8, 2, 0.0)


# --------------------------------------------------------------------------
# FP8 FSDP gathers
# --------------------------------------------------------------------------


@on_8_devices
def test_fp8_all_gather_equals_quantize_then_gather():
    mesh = make_mesh({"data": 1, "fsdp": 8, "expert": 1})
    rng = np.random.default_rng(6)
    w = rng.standard_normal((2, 8 * 128, 256)) * np.exp(rng.normal(0, 3, (2, 8 * 128, 1)))
    w = w.astype(np.float32)
    spec = DSV3.fprop.rhs
    for axis, in_spec in ((1, P(None, "fsdp", None)), (0, None)):
        if in_spec is None:
            # A leading axis never cuts a block: 8 experts over 8 shards.
            w = np.concatenate([w] * 4, axis=0)
            in_spec = P("fsdp", None, None)
        gather = jax.jit(
            jax.shard_map(
                lambda t, a=axis: fsdp.all_gather_fp8(t, spec, "fsdp", a),
                mesh=mesh,
                in_specs=in_spec,
                out_specs=P(),
                check_vma=False,
            )
        )
        q = gather(w)
        ref = fp8jax.schemes.quantize(jnp.asarray(w), spec, -1)
        assert q.data.dtype == fp8jax.E4M3
        np.testing.assert_array_equal(
            np.asarray(q.data).view(np.uint8), np.asarray(ref.data).view(np.uint8)
        )
        np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(ref.scale))


@on_8_devices
def test_gather_weight_gradient_is_reduce_scattered():
    mesh = make_mesh({"data": 1, "fsdp": 8, "expert": 1})
    rng = np.random.default_rng(7)
    w = rng.standard_normal((8 * 128, 128)).astype(np.float32)
    c = rng.standard_normal(w.shape).astype(np.float32)
    x = rng.standard_normal((16, 8 * 128)).astype(np.float32)
    spec = DSV3.fprop.rhs

    def body(w_shard, x_loc):
        # The gathered QTensor's values, straight through the rounding.
        wq = materialize(fsdp.gather_weight(w_shard, "fsdp", 0, spec=spec), jnp.float32)
        # Per-device partial loss on this device's rows of x: the gradient of
        # w is the sum over devices, which the reduce-scatter forms.
        return jnp.sum((x_loc @ wq) ** 2)[None] + jnp.sum(wq * c)[None] / 8

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P("fsdp", None), P("fsdp", None)),
        out_specs=P("fsdp"),
        check_vma=False,
    )
    dw = np.asarray(jax.jit(jax.grad(lambda w: jnp.sum(fn(w, x))))(w))
    wq = np.asarray(
        fp8jax.dequantize(fp8jax.schemes.quantize(jnp.asarray(w), spec, -1)), np.float64
    )
    # d/dw of sum ||x wq||^2 + sum(wq c) with the straight-through wq.
    ref = 2 * x.astype(np.float64).T @ (x.astype(np.float64) @ wq) + c
    np.testing.assert_allclose(dw, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(ValueError, match="multiple of"):
        jax.shard_map(
            lambda t: fsdp.all_gather_fp8(t, spec, "fsdp", 1),
            mesh=mesh,
            in_specs=P(None, "fsdp"),
            out_specs=P(),
            check_vma=False,
        )(w)


@on_8_devices
def test_fsdp_gathered_fp8_kernel_goes_into_the_gemm_with_its_codes():
    """deepseek_v3's Dense layer with its kernel split over fsdp = 2 gives the
    one-device loss, input gradient and kernel gradient bit for bit: the
    kernel arrives as the QTensor of quantizing it whole (no dequantize and
    quantize again), and its gradient is reduce-scattered in float32."""
    from fp8jax.nn import Dense

    mesh = make_mesh({"data": 1, "fsdp": 2, "expert": 1}, jax.devices()[:2])
    rng = np.random.default_rng(8)
    # Contracted axes (2, 128) merge into K = 256; lognormal rows give the
    # 128x128 blocks different scales.
    layer = Dense((2, 128), 128, recipe=DSV3, dtype="float32", name="d", rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    w = rng.standard_normal((2, 128, 128)) * np.exp(rng.normal(0, 2, (2, 128, 1)))
    params["kernel"].set_value(jnp.asarray(w, jnp.float32))
    x = jnp.asarray(rng.standard_normal((16, 2, 128)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)

    def loss_fn(model, x):
        return jnp.sum(model(x) * c)

    layouts = fsdp.kernel_layouts(layer)
    meshed = fsdp.fsdp_loss(loss_fn, mesh, DSV3, None, layouts)
    sharded = placement.shard_tree(params, mesh, None)
    assert tuple(sharded["kernel"].get_value().sharding.spec)[0] == "fsdp"

    def grads(fn, p):
        return jax.value_and_grad(lambda p, x: fn(nnx.merge(graph, p, rest), x), (0, 1))(p, x)

    with jax.set_mesh(mesh):
        gathered = jax.jit(lambda p: fsdp.gather_params(p, mesh, DSV3, None, layouts))(sharded)
        q = gathered["kernel"].get_value()
        ref = fp8jax.schemes.quantize(
            jnp.asarray(w.reshape(256, 128), jnp.float32), DSV3.fprop.rhs, 1
        )
        assert isinstance(q, QTensor) and q.shape == (256, 128)
        np.testing.assert_array_equal(
            np.asarray(q.data).view(np.uint8), np.asarray(ref.data).view(np.uint8)
        )
        np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(ref.scale))
        for run in (jax.jit(grads, static_argnums=0), grads):
            (l1, (g1, dx1)), (l2, (g2, dx2)) = run(loss_fn, params), run(meshed, sharded)
            assert float(l1) == float(l2)
            np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx2))
            dw1, dw2 = (np.asarray(g["kernel"].get_value()) for g in (g1, g2))
            assert dw2.dtype == np.float32
            np.testing.assert_array_equal(dw1, dw2)


# --------------------------------------------------------------------------
# The model on meshes = the model on one device
# --------------------------------------------------------------------------

# d_model 256: with fsdp = 2 every Dense kernel split on its first axis holds
# whole 128-row bands, so its FSDP gather moves FP8 blocks.
MESH_CFG = dict(
    max_seq_len=32,
    d_model=256,
    n_heads=4,
    head_dim=64,
    d_ff=512,
    d_expert=128,
    n_layers=1,
    n_dense_layers=0,
    dtype="float32",
)


def _loss_and_grads(recipe, sizes, tokens):
    """Loss and parameter gradients of the tiny model on a mesh of prod(sizes) devices."""
    from fp8jax.models import ModelConfig, MoETransformer, loss_fn
    from fp8jax.parallel.fsdp import fsdp_loss, kernel_layouts

    cfg = ModelConfig.tiny(**MESH_CFG)
    make = lambda: MoETransformer(cfg, recipe, rngs=nnx.Rngs(0), telemetry=False)
    abstract = nnx.eval_shape(make)
    graph, _ = nnx.split(abstract)
    # Initialised under jit: the same values on every mesh, fast.
    params, rest = jax.jit(lambda: nnx.state(make()))().split(nnx.Param, ...)
    mesh = make_mesh(sizes, jax.devices()[: int(np.prod(sizes))])
    params = placement.shard_tree(params, mesh, cfg.n_routed_experts)
    rest = jax.device_put(rest, placement.replicated_shardings(rest, mesh))
    loss = fsdp_loss(loss_fn, mesh, recipe, cfg.n_routed_experts, kernel_layouts(abstract))

    @jax.jit
    def step(params, rest, tok):
        f = lambda p: loss(nnx.merge(graph, p, rest), tok)
        return jax.value_and_grad(f, has_aux=True)(params)

    with jax.set_mesh(mesh):
        (value, _), grads = step(params, rest, global_batch(tokens, mesh))
    return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]


def _worst_leaf(ga, gb):
    return max(float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)) for a, b in zip(ga, gb))


@pytest.mark.slow
@on_8_devices
def test_meshes_match_one_device():
    """Loss and gradients on (8,1,1), (2,2,2), (1,4,2) = one device.

    fp32: the mesh machinery itself (batch split, FSDP gathers and
    reduce-scatters, expert dispatch and combine) adds only float32
    reduction order (bound 1e-5 per gradient leaf).  bf16 and deepseek_v3
    cast GEMM operands to BF16 / E4M3: a reduction-order difference that
    moves a value across a rounding boundary changes it by a whole BF16 or
    E4M3 step; deepseek_v3's expert parallelism also sends the tokens'
    gradients back in E4M3 and tiles each expert's Wgrad tokens per data
    group.  Their bound, per gradient leaf: the leaf's difference between
    the recipe and fp32 on one device (the mesh changes a gradient less than
    the recipe's own rounding does).  Measured worst leaves (relative L2):
    fp32 8.4e-7; bf16 7.7e-4 on (8,1,1), 3.8e-3 with experts split (BF16
    combine); deepseek_v3 2.9e-7 on (8,1,1), 5.1e-2 with experts split,
    against FP8-vs-fp32 differences of 6.6e-2 to 2.8e-1.
    """
    tokens = np.random.default_rng(0).integers(0, 256, (8, 32)).astype(np.int32)
    ref = {}
    for name in ("fp32", "bf16", "deepseek_v3"):
        recipe = fp8jax.registry.get(name)
        l1, g1 = ref[name] = _loss_and_grads(recipe, (1, 1, 1), tokens)
        if name == "fp32":
            bounds = [1e-5] * len(g1)
        else:
            g32 = ref["fp32"][1]
            bounds = [np.linalg.norm(a - b) / np.linalg.norm(a) for a, b in zip(g32, g1)]
        for sizes in ((8, 1, 1), (2, 2, 2), (1, 4, 2)):
            ln, gn = _loss_and_grads(recipe, sizes, tokens)
            assert abs(ln - l1) <= 1e-4 * abs(l1), (name, sizes, l1, ln)
            errs = [np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30) for a, b in zip(g1, gn)]
            print(f"{name} {sizes}: loss {l1:.7f} vs {ln:.7f}, worst leaf {max(errs):.2e}")
            bad = [(i, e, b) for i, (e, b) in enumerate(zip(errs, bounds)) if not e < b]
            assert not bad, (name, sizes, bad)


# --------------------------------------------------------------------------
# What the layers measure on meshes = what they measure on one device
# --------------------------------------------------------------------------

# A small model whose MoE has 8 experts: they split over 2 expert shards.
OBS_CFG = dict(MESH_CFG, n_layers=2, n_dense_layers=1)


def _observed(recipe, sizes, tokens, grads=False):
    """(telemetry, GEMM scopes the hooks saw, GradNoise gradients) of the model on a mesh.

    Telemetry and gradients are computed (jit) unless ``grads`` is None: then
    only traced (``jax.eval_shape``) for its keys.
    """
    from fp8jax.models import ModelConfig, MoETransformer, loss_fn
    from fp8jax.nn import taps
    from fp8jax.nn.grad_noise import GradNoise
    from fp8jax.parallel.fsdp import fsdp_loss, kernel_layouts

    cfg = ModelConfig.tiny(**OBS_CFG)
    make = lambda: MoETransformer(cfg, recipe, rngs=nnx.Rngs(0))
    abstract = nnx.eval_shape(make)
    graph = nnx.split(abstract, nnx.Param, GradNoise, ...)[0]
    params, noise, rest = jax.jit(lambda: nnx.state(make()))().split(nnx.Param, GradNoise, ...)
    mesh = make_mesh(sizes, jax.devices()[: int(np.prod(sizes))])
    params = placement.shard_tree(params, mesh, cfg.n_routed_experts)
    noise, rest = (
        jax.device_put(t, placement.replicated_shardings(t, mesh)) for t in (noise, rest)
    )
    loss = fsdp_loss(loss_fn, mesh, recipe, cfg.n_routed_experts, kernel_layouts(abstract))
    scopes = []

    def hook(scope, call, x, w, dims, **kw):
        scopes.append(scope)
        return call(x, w, dims, **kw)

    def fn(params, noise, tok):
        f = lambda p, n: loss(nnx.merge(graph, p, n, rest), tok)
        (_, aux), g_noise = jax.value_and_grad(f, argnums=1, has_aux=True)(params, noise)
        return aux["fp8"], g_noise

    with jax.set_mesh(mesh), taps.tapping(hook):
        args = (params, noise, global_batch(tokens, mesh))
        tele, g_noise = jax.jit(fn)(*args) if grads is not None else jax.eval_shape(fn, *args)
    return tele, scopes, g_noise


@on_8_devices
def test_moe_telemetry_keys_and_hooked_gemms_do_not_depend_on_the_mesh():
    """deepseek_v3 on (1,1,1), (1,1,2), (2,2,2): one set of telemetry keys (the
    routed experts' GEMMs and SwiGLU monitors included) and every GEMM hooked
    once, the two expert GEMMs of the MoE layer among them."""
    tokens = np.random.default_rng(0).integers(0, 256, (8, 32)).astype(np.int32)
    seen = {}
    for sizes in ((1, 1, 1), (1, 1, 2), (2, 2, 2)):
        tele, scopes, _ = _observed(DSV3, sizes, tokens, grads=None)
        seen[sizes] = ({k: sorted(v) for k, v in tele.items()}, sorted(scopes))
    keys, scopes = seen[(1, 1, 1)]
    for name in ("experts_w13/x", "experts_w2/w", "experts/swiglu", "tokens"):
        assert f"layer1/moe/{name}" in keys, sorted(keys)
    assert scopes.count("expert") == 2 and scopes.count("dense") > 0
    for sizes, got in seen.items():
        assert got == (keys, scopes), sizes


@pytest.mark.slow
@on_8_devices
def test_expert_parallel_telemetry_merges_to_the_one_device_values():
    """The routed experts' statistics come back out of the shard_map and merge
    over the devices: operand amax and fractions (deepseek_v3: of the tokens
    its FP8 dispatch quantizes; mxfp8: of the received rows, padding left
    out), the SwiGLU monitors and the gradient-noise norms of mxfp8's probes
    match one device (the mesh changes the activations by reduction order only)."""
    tokens = np.random.default_rng(1).integers(0, 256, (8, 32)).astype(np.int32)
    for name in ("deepseek_v3", "mxfp8"):
        _check_merged_telemetry(fp8jax.registry.get(name), tokens)


def _check_merged_telemetry(recipe, tokens):
    from fp8jax.nn.grad_noise import wants_probe

    ref_t, _, ref_g = _observed(recipe, (1, 1, 1), tokens)
    for sizes in ((1, 1, 2), (2, 1, 4)):
        tele, _, g = _observed(recipe, sizes, tokens)
        assert set(tele) == set(ref_t)
        for key in ref_t:
            if not key.startswith("layer1/moe/experts"):
                continue
            for stat, want in ref_t[key].items():
                want, got = float(want), float(tele[key][stat])
                if np.isnan(want):  # the noise ratio before the first step
                    assert np.isnan(got), (sizes, key, stat, got)
                    continue
                tol = 1e-3 if stat in ("saturated", "flushed") else 1e-2 * abs(want)
                assert abs(got - want) <= tol, (sizes, key, stat, want, got)
        moe = lambda t: t["blocks"][1]["ffn"]
        for var in ("w13_noise", "w2_noise") if wants_probe(recipe) else ():
            want = np.asarray(moe(ref_g)[var].get_value())
            got = np.asarray(moe(g)[var].get_value())
            assert want[0] > want[1] > 0, want
            np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=f"{sizes} {var}")


def test_merged_operand_fractions_leave_padding_rows_out():
    """Shards' fractions over padded buffers merge to the shares of the real rows
    (numpy count), amax to the largest."""
    from fp8jax.telemetry import merge_operand_stats, operand_stats

    rng = np.random.default_rng(3)
    spec = DSV3.fprop.lhs
    shards, real = [], []
    for n_real in (5, 0, 11):
        x = np.zeros((16, 256), np.float32)
        # Tiny values next to a large one in each tile: some flush to zero.
        x[:n_real] = rng.standard_normal((n_real, 256)) * np.exp(rng.normal(0, 6, (n_real, 256)))
        shards.append(
            operand_stats(jnp.asarray(x), fp8jax.schemes.quantize(jnp.asarray(x), spec, 1))
        )
        real.append(x[:n_real])
    stats_S = {k: jnp.stack([s[k] for s in shards]) for k in shards[0]}
    merged = merge_operand_stats(stats_S, jnp.array([16, 16, 16]), jnp.array([5, 0, 11]))
    allx = np.concatenate(real)
    whole = operand_stats(jnp.asarray(allx), fp8jax.schemes.quantize(jnp.asarray(allx), spec, 1))
    assert float(whole["flushed"]) > 0
    for k in ("amax", "saturated", "flushed"):
        np.testing.assert_allclose(float(merged[k]), float(whole[k]), rtol=1e-6, err_msg=k)


@on_8_devices
def test_fsdp_gathers_each_blocks_experts_as_its_own_recipe():
    """With high_precision_last, the last block's routed experts move unquantized
    (as its bf16-like recipe casts them) while the first block's move as FP8 blocks."""
    from fp8jax.models import ModelConfig, MoETransformer
    from fp8jax.parallel.fsdp import gather_params, kernel_layouts

    recipe = dataclasses.replace(DSV3, high_precision_last=0.5)
    cfg = ModelConfig.tiny(**dict(MESH_CFG, n_layers=2))
    model = nnx.eval_shape(lambda: MoETransformer(cfg, recipe, rngs=nnx.Rngs(0)))
    layouts = kernel_layouts(model)
    assert layouts[("blocks", "0", "ffn", "w13")].spec.quantized
    assert not layouts[("blocks", "1", "ffn", "w2")].spec.quantized
    params = jax.jit(lambda: nnx.state(MoETransformer(cfg, recipe, rngs=nnx.Rngs(0)), nnx.Param))()
    mesh = make_mesh((1, 2, 1), jax.devices()[:2])
    sharded = placement.shard_tree(params, mesh, cfg.n_routed_experts)
    with jax.set_mesh(mesh):
        out = jax.eval_shape(
            lambda p: gather_params(p, mesh, recipe, cfg.n_routed_experts, layouts), sharded
        )
    for name in ("w13", "w2"):
        first = out["blocks"][0]["ffn"][name].get_value()
        last = out["blocks"][1]["ffn"][name].get_value()
        assert isinstance(first, QTensor), name
        assert not isinstance(last, QTensor) and last.dtype == jnp.float32, (name, last)


def test_swiglu_caches_its_input_in_fp8():
    """Forward unchanged; backward = SwiGLU's gradient at the E4M3-tile-quantized input."""
    from fp8jax.models.moe import swiglu

    rng = np.random.default_rng(8)
    h = jnp.asarray(rng.standard_normal((16, 2, 256)) * 3, jnp.float32)
    g = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    plain = lambda h: swiglu(h, jnp.float32)
    cached = lambda h: swiglu(h, jnp.float32, DSV3)
    for f in (lambda fn: fn, jax.jit):
        np.testing.assert_array_equal(np.asarray(f(cached)(h)), np.asarray(f(plain)(h)))
        dh = np.asarray(jax.vjp(f(cached), h)[1](g)[0], np.float64)
        # Reference: float64 SwiGLU gradient at the dequantized 1x128 E4M3 tiles.
        ht = np.asarray(h, np.float64).reshape(16, 2, 2, 128)
        amax = np.maximum(np.abs(ht).max(-1, keepdims=True), 1e-4)
        scale = (amax / 448).astype(np.float32).astype(np.float64)
        hq = (np.clip(ht / scale, -448, 448).astype(E4M3_NP).astype(np.float64) * scale).reshape(
            16, 2, 256
        )
        a, b = hq[:, 0], hq[:, 1]
        sig = 1 / (1 + np.exp(-a))
        gg = np.asarray(g, np.float64)
        ref = np.stack([gg * b * sig * (1 + a * (1 - sig)), gg * a * sig], axis=1)
        np.testing.assert_allclose(dh, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


_CKPT_STAGE = """
import json, sys
from fp8jax.train.defaults import tiny_config
from fp8jax.train.loop import train
from fp8jax.train.run_log import read_jsonl
workdir, sizes, stop = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
c = tiny_config()
c.steps, c.log_every, c.eval_every, c.tensorboard = 20, 1, 0, False
c.mesh.data, c.mesh.fsdp, c.mesh.expert = sizes
train(c, workdir, stop_at=stop if stop > 0 else None)
rows = [r for r in read_jsonl(workdir + "/metrics.jsonl") if "loss" in r]
print("LOSSES", json.dumps({r["step"]: r["loss"] for r in rows}))
"""


@pytest.mark.slow
def test_checkpoint_restores_onto_other_meshes(tmp_path):
    """8 devices (2,2,2) to step 10, resumed on 8, 4 and 1 devices = the uninterrupted run.

    Same mesh: bit for bit.  Other meshes: measured 2e-3 relative over
    steps 31-60 of the 60-step run (deepseek_v3, BF16 activations: one
    flipped BF16 / E4M3 rounding grows over the steps); bound 2e-2 here.
    """
    import json
    import shutil

    def stage(devices, workdir, sizes, stop):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        out = subprocess.run(
            [sys.executable, "-c", _CKPT_STAGE, str(workdir), sizes, str(stop)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LOSSES"))
        return {int(k): v for k, v in json.loads(line.split(" ", 1)[1]).items()}

    full = stage(8, tmp_path / "full", "2,2,2", 0)
    stage(8, tmp_path / "a", "2,2,2", 10)
    for devices, sizes, tol in ((8, "2,2,2", 0.0), (4, "1,2,2", 2e-2), (1, "1,1,1", 2e-2)):
        wd = tmp_path / f"resume{devices}"
        shutil.copytree(tmp_path / "a", wd)
        got = stage(devices, wd, sizes, 0)
        for s in range(11, 21):
            assert abs(got[s] - full[s]) <= tol * abs(full[s]), (devices, s, got[s], full[s])
