import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import ref_e5m6_tiles, ref_linear_grads, ref_round_e5m6, ref_spec_qdq

import fp8jax
from fp8jax import recipes, registry

DN = (((1,), (0,)), ((), ()))


# Operands with power-of-two scales, per site, in the paper's recipe (section 3.3.3).
PAPER_POW2 = {
    None: set(),
    "attn_out": {"fprop_x", "wgrad_x"},
    "dispatch": {"fprop_x", "wgrad_x"},
    "expert_down": {"dgrad_dy", "wgrad_dy"},
}


@pytest.mark.parametrize("site", list(PAPER_POW2), ids=str)
def test_deepseek_v3_scale_rule_per_site(site):
    r = recipes.deepseek_v3()
    rs = r if site is None else recipes.for_site(r, site)
    specs = rs.specs()
    assert {k for k, s in specs.items() if s.pow2} == PAPER_POW2[site]
    # Unified E4M3, 1x128 tiles for activations and gradients, 128x128 weight blocks.
    assert all(s.fmt == "e4m3" and s.tile == 128 and s.amax_floor == 0.0 for s in specs.values())
    assert specs["fprop_w"].granularity == specs["dgrad_w"].granularity == "block"
    assert {specs[k].granularity for k in ("fprop_x", "dgrad_dy", "wgrad_x", "wgrad_dy")} == {
        "tile"
    }
    assert rs.x_cache == ("e5m6" if site == "attn_out" else None)


def test_deepseek_v3_variants():
    pow2x = registry.get("deepseek_v3_pow2x")
    assert pow2x.name == "deepseek_v3_pow2x"
    assert {k for k, s in pow2x.specs().items() if s.pow2} == {"fprop_x", "wgrad_x"}
    # No site adds anything beyond x; the experts' dy keeps amax scales.
    for site in recipes.GEMM_SITES:
        assert recipes.for_site(pow2x, site).specs() == pow2x.specs()
    assert not recipes.for_site(pow2x, "expert_down").dgrad.lhs.pow2
    assert all(s.pow2 for s in recipes.deepseek_v3(pow2=True).specs().values())
    # Each site can be switched off for a comparison.
    r = recipes.deepseek_v3()
    off = dataclasses.replace(
        r, attn_out_pow2=False, attn_out_cache=None, dispatch_pow2=False, down_grad_pow2=False
    )
    for site in recipes.GEMM_SITES:
        assert recipes.for_site(off, site) == off


def _site_reference(x, w, g, recipe):
    """y, dx, dw in float64 of the documented dataflow, E5M6 cache included.

    "e5m6": x in E5M6 in 1x128 tiles along K with power-of-two scales;
    "e5m6_unscaled": x rounded to E5M6 (clipped at 65,024); either is
    re-quantized by Wgrad's spec in 128x1 tiles along the tokens.
    """
    caches = {"e5m6": ref_e5m6_tiles, "e5m6_unscaled": ref_round_e5m6}
    if recipe.x_cache not in caches:
        return ref_linear_grads(x, w, g, recipe)
    y, dx, _ = ref_linear_grads(x, w, g, recipe)
    xw = ref_spec_qdq(caches[recipe.x_cache](x).reshape(x.shape), recipe.wgrad.lhs, 1)
    dyw = ref_spec_qdq(g, recipe.wgrad.rhs, 1)
    return y, dx, np.einsum("bmk,bmn->bkn", xw, dyw)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("site", list(PAPER_POW2), ids=str)
def test_deepseek_v3_site_gemms_follow_their_scale_rule(site, jit):
    # Heavy-tailed x and dy, so amax and power-of-two scales give different
    # codes: each GEMM matches the float64 reference of its own rule and not
    # the other one's.
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, 256, 256)) * np.exp(rng.standard_normal((1, 256, 256)))).astype(
        np.float32
    )
    w = (rng.standard_normal((1, 256, 256)) / 16).astype(np.float32)
    g = (rng.standard_normal((1, 256, 256)) * np.exp(rng.standard_normal((1, 256, 256)))).astype(
        np.float32
    )
    r = recipes.deepseek_v3()
    rs = r if site is None else recipes.for_site(r, site)
    dims = (((2,), (1,)), ((0,), (0,)))

    def f(x, w, g):
        y, vjp = jax.vjp(lambda a, b: fp8jax.dot_general(a, b, dims, recipe=rs), x, w)
        return (y, *vjp(g))

    f = jax.jit(f) if jit else f
    got = [np.asarray(t, np.float64) for t in f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))]
    want = _site_reference(x, w, g, rs)
    # The other rule: power-of-two where the site has amax, and the reverse.
    flipped = dataclasses.replace(
        rs,
        fprop=recipes.GemmSpec(
            dataclasses.replace(rs.fprop.lhs, pow2=not rs.fprop.lhs.pow2), rs.fprop.rhs
        ),
        dgrad=recipes.GemmSpec(
            dataclasses.replace(rs.dgrad.lhs, pow2=not rs.dgrad.lhs.pow2), rs.dgrad.rhs
        ),
        wgrad=recipes.GemmSpec(
            dataclasses.replace(rs.wgrad.lhs, pow2=not rs.wgrad.lhs.pow2),
            dataclasses.replace(rs.wgrad.rhs, pow2=not rs.wgrad.rhs.pow2),
        ),
    )
    other = _site_reference(x, w, g, flipped)
    for name, a, ref, alt in zip(("y", "dx", "dw"), got, want, other):
        err, err_alt = _rel(a, ref), _rel(a, alt)
        assert err < 1e-5, (name, err)
        assert err_alt > 100 * max(err, 1e-7), (name, err_alt)


@pytest.mark.parametrize("name", ["deepseek_v3", "attn_out_e5m6_unscaled"])
def test_attn_out_cache_on_massive_activations(name):
    # Activations of 1e4-1e5 (beyond E5M6's 65,024): the paper's cache keeps
    # them (1x128 power-of-two tiles), the unscaled variant clips them; each
    # GEMM's Wgrad matches the float64 reference of its own cache only.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 256, 256)).astype(np.float32)
    x[0, [3, 77, 200], [5, 130, 255]] = [1.0e5, -3.0e4, 7.0e4]
    w = (rng.standard_normal((1, 256, 128)) / 16).astype(np.float32)
    g = rng.standard_normal((1, 256, 128)).astype(np.float32)
    rs = recipes.for_site(registry.get(name), "attn_out")
    dims = (((2,), (1,)), ((0,), (0,)))
    _, vjp = jax.vjp(lambda a, b: fp8jax.dot_general(a, b, dims, recipe=rs), x, w)
    dw = np.asarray(vjp(jnp.asarray(g))[1], np.float64)
    other = "e5m6_unscaled" if rs.x_cache == "e5m6" else "e5m6"
    want = _site_reference(x, w, g, rs)[2]
    alt = _site_reference(x, w, g, dataclasses.replace(rs, x_cache=other))[2]
    assert _rel(dw, want) < 1e-5
    assert _rel(dw, alt) > 1e-3
    exact = np.einsum("bmk,bmn->bkn", x.astype(np.float64), g.astype(np.float64))
    if name == "deepseek_v3":
        # Nothing clipped: within 10% of the exact product.
        assert _rel(dw, exact) < 0.1


def test_attn_out_e5m6_unscaled_is_a_named_variant():
    r = registry.get("attn_out_e5m6_unscaled")
    base = recipes.deepseek_v3()
    assert r.attn_out_cache == "e5m6_unscaled" and base.attn_out_cache == "e5m6"
    assert dataclasses.replace(r, name=base.name, attn_out_cache="e5m6") == base
    with pytest.raises(ValueError, match="x_cache must be one of"):
        dataclasses.replace(base, x_cache="e5m7")


def _rel(a, ref):
    return float(np.linalg.norm(np.asarray(a, np.float64) - ref) / np.linalg.norm(ref))


def test_pow2_requantization_for_wgrad_adds_no_error():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, 256)) * np.exp(rng.standard_normal((512, 1)))).astype(np.float32)
    ref = x.astype(np.float64)
    xj = jnp.asarray(x)

    def errors(pow2):
        direct = fp8jax.quantize(xj, fp8jax.E4M3, "tile", axis=0, pow2=pow2)
        cached = fp8jax.dequantize(fp8jax.quantize(xj, fp8jax.E4M3, "tile", axis=-1, pow2=pow2))
        requant = fp8jax.quantize(cached, fp8jax.E4M3, "tile", axis=0, pow2=pow2)
        return _rel(fp8jax.dequantize(direct), ref), _rel(fp8jax.dequantize(requant), ref)

    d_arb, r_arb = errors(False)
    d_p2, r_p2 = errors(True)
    assert r_arb > 1.2 * d_arb  # re-quantizing arbitrary scales adds error
    assert r_p2 <= 1.01 * d_p2  # power-of-two at both ends: none
    assert r_p2 < r_arb


@pytest.mark.parametrize("jit", [False, True])
def test_deepseek_v3_dgrad_keeps_tiny_gradients(jit):
    # With DeepSeek's 1e-4 amax floor on dy, a gradient of std 1e-9 lost 17%
    # of its elements to zero and Dgrad's output was ~12% off.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((128, 256)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((256, 128)).astype(np.float32) * 0.05)
    g = rng.standard_normal((128, 128)).astype(np.float32) * np.float32(1e-9)
    r = recipes.deepseek_v3()

    def dx_of(x, w, g):
        _, vjp = jax.vjp(lambda a: fp8jax.dot_general(a, w, DN, recipe=r), x)
        return vjp(g)[0]

    f = jax.jit(dx_of) if jit else dx_of
    dx = np.asarray(f(x, w, jnp.asarray(g)), np.float64)
    ref = g.astype(np.float64) @ np.asarray(w, np.float64).T
    assert _rel(dx, ref) < 0.06


def test_mxfp8_scale_rounding_presets():
    assert recipes.mxfp8() == registry.get("mxfp8")
    for spec in recipes.mxfp8().specs().values():
        assert spec.scale_rounding == "floor"
    ceil = registry.get("mxfp8_ceil")
    assert ceil.name == "mxfp8_ceil"
    assert {s.scale_rounding for s in ceil.specs().values()} == {"ceil"}
    # Only the rounding differs from the OCP preset.
    floor_specs = {
        k: dataclasses.replace(v, scale_rounding="ceil") for k, v in recipes.mxfp8().specs().items()
    }
    assert floor_specs == ceil.specs()
    with pytest.raises(ValueError, match="mxfp8"):
        recipes.QuantSpec("e4m3", "tile", scale_rounding="ceil")
    with pytest.raises(ValueError, match="scale_rounding"):
        recipes.QuantSpec("mxfp8", "tile", 32, scale_rounding="even")


def test_existing_presets_keep_every_gemm_spec():
    # The new fields default to what the presets always did: floor scales, no high-precision blocks.
    for name in ("deepseek_v3", "mxfp8", "hybrid_delayed", "current_tensor", "rowwise", "bf16"):
        r = registry.get(name)
        assert r.high_precision_last == 0.0
        assert all(s.scale_rounding == "floor" for s in r.specs().values())


@pytest.mark.parametrize(
    "n_layers,want", [(1, 1), (2, 1), (4, 1), (6, 1), (7, 2), (12, 2), (50, 8), (62, 10)]
)
def test_nvfp4_keeps_its_last_blocks_in_high_precision(n_layers, want):
    r = recipes.nvfp4()
    assert r.high_precision_last == recipes.NVFP4_HIGH_PRECISION_LAST
    assert recipes.high_precision_layers(r, n_layers) == want
    per_layer = [recipes.for_layer(r, i, n_layers) for i in range(n_layers)]
    assert all(p is r for p in per_layer[: n_layers - want])
    for p in per_layer[n_layers - want :]:
        assert not p.is_fp8 and p.compute_dtype == "bfloat16"
    # Today's recipe: every block NVFP4, the same GEMM specs as the default's quantized blocks.
    every = registry.get("nvfp4_all_layers")
    assert recipes.high_precision_layers(every, n_layers) == 0
    assert every.specs() == r.specs()
    with pytest.raises(ValueError, match="outside"):
        recipes.for_layer(r, n_layers, n_layers)
    with pytest.raises(ValueError, match="fraction"):
        dataclasses.replace(r, high_precision_last=1.5)


def test_one_registry_resolves_presets_and_variants_by_their_own_name():
    from fp8jax.variants import VARIANTS

    for name in (*recipes.PRESETS, *VARIANTS):
        assert registry.get(name).name == name
    assert not set(recipes.PRESETS) & set(VARIANTS)
    with pytest.raises(ValueError, match="unknown recipe 'acc_tile'; did you mean 'acc_tiles'"):
        registry.get("acc_tile")


def test_the_resolvers_old_name_is_the_registrys():
    # fp8jax.recipes.get resolved names before fp8jax.registry existed: it still does,
    # in a fresh interpreter too (the alias must not depend on import order).
    assert recipes.get is registry.get
    assert recipes.get("acc_tiles") == registry.get("acc_tiles")
    code = (
        "from fp8jax.recipes import get\n"
        "import fp8jax.registry\n"
        "assert get is fp8jax.registry.get and get('deepseek_v3').name == 'deepseek_v3'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------------
# UE8M0 scale format and DeepSeek-V3.1
# --------------------------------------------------------------------------


def test_quantspec_scale_fmt_validation():
    with pytest.raises(ValueError, match="pow2=True"):
        recipes.QuantSpec("e4m3", "tile", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        recipes.QuantSpec("e4m3", "tile", pow2=True, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="FP8 formats"):
        recipes.QuantSpec(None, scale_fmt="ue8m0", pow2=True)
    assert recipes.QuantSpec("e4m3", pow2=True, scale_fmt="ue8m0").scale_fmt == "ue8m0"


def test_deepseek_v3_1_is_pow2_ue8m0_everywhere_and_v3_unchanged():
    r = registry.get("deepseek_v3_1")
    assert r.name == "deepseek_v3_1"
    assert all(s.pow2 and s.scale_fmt == "ue8m0" for s in r.specs().values())
    assert all(s.scale_fmt == "float32" for s in recipes.deepseek_v3().specs().values())
    base = dataclasses.replace(recipes.deepseek_v3(pow2=True), name="deepseek_v3_1")
    assert recipes.with_ue8m0(base) == r


def _loss_and_grads(r, granularity=None):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((160, 300)) * 4, jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 200)) * 0.05, jnp.float32)

    def f(x, w):
        y = fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=r)
        return jnp.sum(jnp.tanh(y) ** 2), y

    (l, y), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)
    return [np.asarray(t) for t in (l, y, *g)]


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_ue8m0_gemm_outputs_and_grads_bit_identical_to_float32_pow2(granularity):
    spec = recipes.QuantSpec("e4m3", granularity, 128, pow2=True)
    r32 = recipes.Recipe(
        name="pow2",
        fprop=recipes.GemmSpec(spec, spec),
        dgrad=recipes.GemmSpec(spec, spec),
        wgrad=recipes.GemmSpec(spec, spec),
    )
    r8 = recipes.with_ue8m0(r32)
    assert all(s.scale_fmt == "ue8m0" for s in r8.specs().values())
    for a, b in zip(_loss_and_grads(r32), _loss_and_grads(r8)):
        np.testing.assert_array_equal(a, b)


def test_deepseek_v3_1_equals_deepseek_v3_pow2_and_pow2x_ue8m0_equals_pow2x():
    for a, b in zip(
        _loss_and_grads(recipes.deepseek_v3(pow2=True)), _loss_and_grads(recipes.deepseek_v3_1())
    ):
        np.testing.assert_array_equal(a, b)
    px = recipes.deepseek_v3_pow2x()
    for a, b in zip(_loss_and_grads(px), _loss_and_grads(recipes.with_ue8m0(px))):
        np.testing.assert_array_equal(a, b)


def test_deepseek_v3_1_expert_gemm_bit_identical():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 256, 128)) * 0.05, jnp.float32)
    gs = jnp.asarray([90, 166], jnp.int32)

    def run(r):
        f = lambda x, w: jnp.sum(jnp.tanh(fp8jax.ragged_dot(x, w, gs, recipe=r)) ** 2)
        return [np.asarray(t) for t in jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)[1]]

    for a, b in zip(run(recipes.deepseek_v3(pow2=True)), run(recipes.deepseek_v3_1())):
        np.testing.assert_array_equal(a, b)


def test_ue8m0_consumer_refuses_pre_quantized_non_pow2_operand():
    from fp8jax.quant import quantize

    x = jnp.asarray(np.random.default_rng(4).standard_normal((128, 256)), jnp.float32)
    w = jnp.ones((256, 128), jnp.float32)
    qx = quantize(x, fp8jax.E4M3, "tile", axis=-1)  # amax scales, not powers of two
    with pytest.raises(ValueError, match="powers of two"):
        fp8jax.dot_general(qx, w, (((1,), (0,)), ((), ())), recipe=recipes.deepseek_v3_1())


def test_a_recipe_names_an_impl_of_the_one_table():
    # recipes.IMPLS is the table the GEMM core chooses from; a recipe may name any
    # of its entries or "auto", never an impl only "auto" reaches (scaled_matmul).
    r = recipes.deepseek_v3()
    for scheme, impls in recipes.IMPLS.items():
        for impl in impls:
            assert dataclasses.replace(r, impl=impl).impl == impl, scheme
    assert dataclasses.replace(r, impl="auto").impl == "auto"
    for bad in ("scaled_matmul", "nope"):
        with pytest.raises(ValueError, match="impl must be one of"):
            dataclasses.replace(r, impl=bad)
    from fp8jax import gemm

    assert gemm.IMPLS is recipes.IMPLS  # the core reads the same table
