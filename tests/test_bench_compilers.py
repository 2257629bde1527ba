"""fp8jax.bench.compilers: the census of compiled programs, and deviceless compiles.

The census is checked on a hand-written HLO module (every rule: GEMM kinds,
loops and trip counts, conditionals, XLA's estimates and the distrusted ones,
rooflines), then on real compiles for an H100 (where the jax CUDA plugin is
installed: CI's GPU-image environment) and for tpu7x (where libtpu is).  No
test asserts a time: only structure (which kernels, loops, temporaries).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.bench import compilers, predicted
from fp8jax.bench.gemm_cases import Shape

# A module as XLA's GPU compiler prints it (trimmed to what the census reads):
# a quantize fusion with XLA's estimate, a loop of 4 trips around a cuBLASLt
# FP8 GEMM and a quantizer's fusion, a conditional whose dearer branch counts, and a
# fusion whose estimate is absurd for its bytes.
HLO = """\
HloModule m, is_scheduled=true

%fused_q (p0: bf16[256,256]) -> f8e4m3fn[256,256] {
  %p0 = bf16[256,256]{1,0} parameter(0)
  ROOT %c = f8e4m3fn[256,256]{1,0} convert(%p0)
}

%body (arg: (s32[], f32[256,256])) -> (s32[], f32[256,256]) {
  %arg = (s32[], f32[256,256]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %acc = f32[256,256]{1,0} get-tuple-element(%arg), index=1
  %a8 = f8e4m3fn[256,64]{1,0} parameter(1)
  %b8 = f8e4m3fn[64,256]{1,0} parameter(2)
  %mm = f32[256,256]{1,0} custom-call(%a8, %b8), custom_call_target="__cublas$lt$matmul$f8"
  %add = f32[256,256]{1,0} fusion(%acc, %mm), kind=kLoop, calls=%fused_q, metadata={op_name="jit(f)/while/body/jit(_quantize_online)/convert"}, backend_config={"reification_cost":[{"exec_time_us":2.5}]}
  ROOT %t = (s32[], f32[256,256]) tuple(%i, %add)
}

%cond (arg: (s32[], f32[256,256])) -> pred[] {
  %arg = (s32[], f32[256,256]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%cheap (x: bf16[256,256]) -> bf16[256,256] {
  %x = bf16[256,256]{1,0} parameter(0)
  ROOT %f = bf16[256,256]{1,0} fusion(%x), kind=kLoop, calls=%fused_q, backend_config={"reification_cost":[{"exec_time_us":1.0}]}
}

%dear (x: bf16[256,256]) -> bf16[256,256] {
  %x = bf16[256,256]{1,0} parameter(0)
  ROOT %f2 = bf16[256,256]{1,0} fusion(%x), kind=kLoop, calls=%fused_q, backend_config={"reification_cost":[{"exec_time_us":3.0}]}
}

ENTRY %main (x: bf16[256,256], w: bf16[256,256], p: pred[]) -> bf16[256,256] {
  %x = bf16[256,256]{1,0} parameter(0)
  %w = bf16[256,256]{1,0} parameter(1)
  %p = pred[] parameter(2)
  %q = f8e4m3fn[256,256]{1,0} fusion(%x), kind=kInput, calls=%fused_q, metadata={op_name="jit(f)/quantize"}, backend_config={"reification_cost":[{"exec_time_us":4.0}]}
  %init = (s32[], f32[256,256]) tuple(%x, %x)
  %loop = (s32[], f32[256,256]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %br = bf16[256,256]{1,0} conditional(%p, %x, %x), true_computation=%cheap, false_computation=%dear
  %absurd = bf16[256,256]{1,0} fusion(%x), kind=kCustom, calls=%fused_q, backend_config={"reification_cost":[{"exec_time_us":18000.0}]}
  ROOT %y = bf16[256,256]{1,0} custom-call(%q, %w), custom_call_target="__gpu$xla.gpu.triton"
}
"""


def test_census_reads_kernels_loops_branches_and_estimates():
    t = compilers.target("h100")
    c = compilers.census_of_text(HLO, t, temp=1234)
    assert c.gemm_kernels == {"cuBLASLt FP8": 1, "Pallas Triton": 1}
    # The loop's fusion is a quantizer's (its op_name says so).
    assert c.loops == [{"name": "loop", "trips": 4, "gemms": 1, "quantizers": 1}]
    assert c.gemm_in_loop
    # The quantize fusion, the loop's fusion, the dearer branch's fusion, the absurd one.
    assert c.fusions == 4
    assert c.temp_bytes == 1234
    # The loop's fusion 4 times, the dearer branch; the absurd estimate replaced
    # by its bytes at HBM speed (2 x 128 KiB at the config's 3.35 TB/s).
    floor = 2 * 256 * 256 * 2 / 3_352_320_000_000 * 1e6
    assert c.other_us == pytest.approx(4.0 + 4 * 2.5 + 3.0 + floor)
    assert c.distrusted == [{"name": "absurd", "xla_us": 18000.0, "used_us": round(floor, 3)}]
    # The loop's fusion 4 times first, then the quantize.
    assert c.top_other[0] == {
        "us": 10.0,
        "name": "add",
        "op": "jit(f)/while/body/jit(_quantize_online)/convert",
    }
    assert c.top_other[1] == {"us": 4.0, "name": "q", "op": "jit(f)/quantize"}
    # GEMM FLOPs: 4 trips of 256x64x256 and one 256^3 (a square custom call).
    assert c.gemm_flops == pytest.approx(4 * 2 * 256 * 64 * 256 + 2 * 256**3)


# Three fusions calling two copies of one kernel (names and metadata apart)
# and a third, different kernel; two of them made by the quantizer.
KERNELS_HLO = """\
HloModule k

%fused_a (p0: bf16[64,128]) -> f32[64,1] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %c = f32[64,128]{1,0} convert(%p0), metadata={op_name="jit(f)/a"}
  ROOT %r = f32[64,1]{1,0} reshape(%c)
}

%fused_a.1 (param_0.3: bf16[64,128]) -> f32[64,1] {
  %param_0.3 = bf16[64,128]{1,0} parameter(0)
  %convert.7 = f32[64,128]{1,0} convert(%param_0.3), metadata={op_name="jit(f)/b"}
  ROOT %reshape.2 = f32[64,1]{1,0} reshape(%convert.7)
}

%fused_b (p0: bf16[64,128]) -> bf16[64,128] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  ROOT %n = bf16[64,128]{1,0} negate(%p0)
}

ENTRY %main (x: bf16[64,128], y: bf16[64,128]) -> (f32[64,1], f32[64,1], bf16[64,128]) {
  %x = bf16[64,128]{1,0} parameter(0)
  %y = bf16[64,128]{1,0} parameter(1)
  %f1 = f32[64,1]{1,0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="jit(f)/jit(_quantize_online)/max"}
  %f2 = f32[64,1]{1,0} fusion(%y), kind=kLoop, calls=%fused_a.1, metadata={op_name="jit(f)/jit(_quantize_online)/max"}
  %f3 = bf16[64,128]{1,0} fusion(%x), kind=kLoop, calls=%fused_b, metadata={op_name="jit(f)/neg"}
  ROOT %t = (f32[64,1], f32[64,1], bf16[64,128]) tuple(%f1, %f2, %f3)
}
"""


# A TPU module (trimmed): a Pallas tile-layout kernel whose result feeds a Pallas GEMM.
TPU_HLO = """\
HloModule t, is_scheduled=true

ENTRY %main (x: f8e4m3fn[256,256], w: f8e4m3fn[256,256]) -> bf16[256,256] {
  %x = f8e4m3fn[256,256]{1,0} parameter(0)
  %w = f8e4m3fn[256,256]{1,0} parameter(1)
  %fp8_window_tiles.2 = f8e4m3fn[256,256]{1,0} custom-call(%x, %x), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/fp8_window_tiles/pallas_call"}
  ROOT %fp8_grouped_block_scaled_matmul_nn.1 = bf16[256,256]{1,0} custom-call(%fp8_window_tiles.2, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/fp8_grouped_block_scaled_matmul_nn/pallas_call"}
}
"""


def test_census_names_a_kernel_by_itself_not_by_its_operands():
    # The GEMM's line names the tiles' kernel as an operand: still a GEMM.
    c = compilers.census_of_text(TPU_HLO, compilers.target("tpu7x"))
    assert c.gemm_kernels == {"Mosaic TPU": 1}
    assert c.other_kernels == 1


def test_kernel_census_counts_copies_of_a_kernel_once():
    assert compilers.kernel_census(KERNELS_HLO) == {
        "fusions": 3,
        "distinct kernels": 2,
        "distinct instructions": 3 + 2,
        "quantizer kernels": 1,
        "quantizer instructions": 3,
    }


def test_kernel_census_of_a_cpu_compile_finds_the_quantizers_kernels():
    # Two quantizations of operands of one shape and an unrelated op: XLA's
    # CPU program holds two copies of the quantizer's kernels.
    def f(x, y, z):
        qx = fp8jax.quantize(x, fp8jax.E4M3, "tile", axis=-1)
        qy = fp8jax.quantize(y, fp8jax.E4M3, "tile", axis=-1)
        return qx.data, qx.scale, qy.data, qy.scale, (z * 3 + 1).astype(jnp.bfloat16)

    x = jnp.ones((64, 256), jnp.bfloat16)
    text = jax.jit(f).lower(x, x, jnp.ones((8,), jnp.float32)).compile().as_text()
    kc = compilers.kernel_census(text)
    assert kc["fusions"] == text.count(" fusion(")
    assert kc["distinct kernels"] < kc["fusions"]
    assert 0 < kc["quantizer kernels"] < kc["distinct kernels"]
    assert 0 < kc["quantizer instructions"] < kc["distinct instructions"]


def test_unknown_target_is_one_line():
    with pytest.raises(ValueError, match="unknown compile target 'h900'; known"):
        compilers.target("h900")


def _cuda_or_skip():
    t = compilers.target("h100")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    return t


def _census(program, shapes, t):
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    return compilers.predict(program, args, t)


def test_h100_auto_fwd_bwd_has_three_fp8_kernels_and_no_gemm_loop():
    t = _cuda_or_skip()
    shape = [(256, 512), (512, 256)]
    bf16 = _census(predicted.gemm_program(None), shape, t)
    auto = _census(predicted.gemm_program(fp8jax.recipes.deepseek_v3()), shape, t)
    assert sum(bf16.gemm_kernels.values()) == 3
    assert sum(auto.gemm_kernels.values()) == 3, auto.gemm_kernels
    assert not any(k.startswith("XLA") or k.startswith("cuBLAS") for k in auto.gemm_kernels)
    assert not auto.gemm_in_loop, auto.loops
    assert auto.gemm_flops == pytest.approx(bf16.gemm_flops)
    # Temporaries bounded by twice bf16's (its GEMMs' float32 outputs and workspace).
    assert auto.temp_bytes <= 2 * bf16.temp_bytes


@pytest.mark.parametrize("n", [256, 576])
def test_h100_auto_fwd_bwd_moves_no_fp8_codes_outside_its_kernels(n):
    # Every FP8 array of the program is a kernel's output, as it wrote it (a
    # bitcast at most): the weight's codes reach the Fprop K-major from the
    # quantizer that wrote both layouts, the Wgrad's from the kernels that
    # write them token-major; no XLA transpose or copy of codes.
    t = _cuda_or_skip()
    fn = predicted.gemm_program(fp8jax.recipes.deepseek_v3())
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((288, 512), (512, n))]
    text = compilers.compile_for(fn, args, t).text
    made = {m.group(1) for m in re.finditer(r"= f8e\w+\[[^\]]*\]\S* ([\w-]+)\(", text)}
    assert made == {"bitcast"}, made


def test_h100_grouped_fprop_reads_the_experts_codes_as_their_quantizer_wrote_them():
    # The experts' weights (2, 256, 384): the grouped Fprop kernel reads them
    # K-major, (2, 384, 256), as the block quantizer wrote them beside the
    # Dgrad's; no XLA transpose of the codes makes that array.
    t = _cuda_or_skip()
    fn = predicted.grouped_program(fp8jax.recipes.deepseek_v3(), 2)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((512, 256), (2, 256, 384))]
    text = compilers.compile_for(fn, args, t).text
    assert "fp8_quantize_block_both" in text
    made = re.findall(r"= f8e4m3fn\[2,384,256\]\S* ([\w-]+)\(", text)
    assert made == ["bitcast"], made


@pytest.mark.slow  # two deviceless compiles of a train step: about 100 s on 2 cores
def test_h100_microbatched_step_quantizes_its_weights_before_the_loop():
    # XLA leaves loop-invariant work in the microbatch loop: the step makes
    # the weights' codes before it (fp8jax.train.weight_codes), and the loop
    # then repeats none of the weights' quantizer kernels (at least one each).
    t = _cuda_or_skip()
    from flax import nnx

    from fp8jax.models import ModelConfig, MoETransformer, loss_fn
    from fp8jax.parallel.fsdp import kernel_layouts
    from fp8jax.train.optimizer import make_optimizer
    from fp8jax.train.state import create_train_state
    from fp8jax.train.step import make_train_step

    cfg = ModelConfig.tiny(vocab_size=256, max_seq_len=16)
    model = MoETransformer(cfg, fp8jax.recipes.deepseek_v3(), rngs=nnx.Rngs(0))
    n_block = sum(lay.spec.granularity == "block" for lay in kernel_layouts(model).values())
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=10, warmup_steps=0)
    graphdef, state = create_train_state(model, tx)
    tokens = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    in_loops = {}
    for once in (True, False):
        step = make_train_step(graphdef, tx, loss_fn, microbatches=2, weights_once=once)
        c = compilers.predict(step, (state, tokens), t)
        in_loops[once] = sum(loop["quantizers"] for loop in c.loops)
    assert n_block > 0 and in_loops[False] - in_loops[True] >= n_block, (n_block, in_loops)


def test_h100_quantizer_keeps_no_mask_in_memory():
    # On CUDA the quantizer divides plainly (IEEE: +-Inf / scale stays +-Inf).
    # With the division's own isinf guard XLA wrote that mask out, a pred
    # array of the operand's size, beside the transposing passes; at this
    # size it now writes no mask at all.
    t = _cuda_or_skip()
    recipe = fp8jax.recipes.deepseek_v3()
    c = compilers.compile_for(
        predicted.gemm_program(recipe),
        [
            jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        ],
        t,
    )
    comps, entry = compilers._parse(c.text)
    masks = [i.name for i in comps[entry] if "pred[" in i.type_text and "256" in i.type_text]
    assert not masks, masks


def test_h100_chunked_runs_gemms_in_a_k_run_loop():
    t = _cuda_or_skip()
    recipe = fp8jax.recipes.deepseek_v3()
    chunked = _census(
        predicted.gemm_program(dataclasses.replace(recipe, impl="chunked")),
        [(256, 512), (512, 256)],
        t,
    )
    assert chunked.gemm_in_loop
    assert {loop["trips"] for loop in chunked.loops if loop["gemms"]} <= {2, 4}


def test_gemm_case_reports_ratios_to_bf16():
    t = _cuda_or_skip()
    recs = predicted.gemm_case(Shape("s", "custom", 256, 256, 256), ["deepseek_v3"], ["auto"], t)
    assert [r["recipe"] for r in recs] == ["bf16", "deepseek_v3"]
    assert recs[0]["ratio"] == 1.0
    assert recs[1]["paths"]["dense/fprop"].startswith("pallas")
    assert "non_gemm_vs_bf16_gemms" in recs[1]
    assert recs[0]["compile_ratio"] == 1.0 and recs[1]["compile_ratio"] > 0
    text = predicted.table(recs)
    assert "deepseek_v3" in text and "Mosaic GPU" in text
    # The compile ratio closes each record's line (the header first, bf16 next).
    lines = text.splitlines()
    assert lines[1].split()[-1] == "1.00"
    assert float(lines[2].split()[-1]) == pytest.approx(recs[1]["compile_ratio"], abs=0.01)


def test_tpu7x_estimates_a_plain_bf16_gemm():
    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    c = _census(predicted.gemm_program(None), [(256, 512), (512, 256)], t)
    assert c.total_us is not None and c.total_us > 0
    assert sum(c.gemm_kernels.values()) == 3
    assert c.gemm_flops == pytest.approx(3 * 2 * 256 * 512 * 256)


def test_h100_grouped_fwd_bwd_runs_kernels_only():
    # fp8jax.ragged_dot over 4 experts: the grouped Fprop, Dgrad and Wgrad
    # are kernels, none in a loop; lax.ragged_dot is the baseline.
    t = _cuda_or_skip()
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
    fp8 = compilers.predict(predicted.grouped_program(fp8jax.recipes.deepseek_v3(), 4), [x, w], t)
    assert fp8.gemm_kernels == {"Mosaic GPU": 3}, fp8
    assert not fp8.gemm_in_loop
    # The Wgrad sums each expert's token tiles in the kernel: no loop adding
    # them, and less temporary memory than the float32 products of the 8
    # tiles ((512 / 128 + 4) x 256 x 384 x 4 bytes) a per-tile GEMM writes.
    assert not fp8.loops
    assert fp8.temp_bytes < 8 * 256 * 384 * 4


def test_tpu7x_compiles_the_moe_train_step():
    # Every float32 dot of the model (router, attention core, head, combine)
    # names each platform's algorithm: libtpu refuses the F32_F32_F32 preset.
    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    from fp8jax.bench.moe_step import model_config, train_step_program

    step, args = train_step_program(model_config("tiny"), fp8jax.recipes.bf16(), 1)
    c = compilers.census(compilers.compile_for(step, args, t))
    assert c.gemm_kernels and not c.gemm_in_loop


@pytest.mark.slow
def test_cpu_compile_ratio_reports_its_phases():
    # The tiny step compiled on this CPU for bf16 and deepseek_v3: each whole
    # is its three phases, and the FP8 step has more kernels.
    out = predicted.cpu_compile_ratio("tiny", 2, "deepseek_v3")
    for name in ("bf16", "deepseek_v3"):
        phases = sum(out[f"{name} {p}"] for p in ("trace", "lower", "compile"))
        assert phases == pytest.approx(out[name])
    assert out["deepseek_v3 fusions"] > out["bf16 fusions"] > 0
    assert out["ratio"] == pytest.approx(out["deepseek_v3"] / out["bf16"])
    # What XLA built: distinct kernels, the FP8 step's quantizers among them.
    for name in ("bf16", "deepseek_v3"):
        assert 0 < out[f"{name} distinct kernels"] <= out[f"{name} fusions"]
    assert out["bf16 quantizer kernels"] == 0
    assert 0 < out["deepseek_v3 quantizer kernels"] < out["deepseek_v3 distinct kernels"]


def test_summarize_rounds_gives_medians_and_the_ratio_range():
    rounds = [
        {"bf16": 4.0, "deepseek_v3": 10.0, "deepseek_v3 fusions": 900, "ratio": 2.5},
        {"bf16": 5.0, "deepseek_v3": 10.5, "deepseek_v3 fusions": 900, "ratio": 2.1},
        {"bf16": 4.5, "deepseek_v3": 9.0, "deepseek_v3 fusions": 900, "ratio": 2.0},
    ]
    out = predicted.summarize_rounds(rounds)
    # The median of the rounds' ratios, not the ratio of the medians (2.22).
    assert out["ratio"] == 2.1
    assert (out["ratio min"], out["ratio max"]) == (2.0, 2.5)
    assert (out["bf16"], out["deepseek_v3"], out["deepseek_v3 fusions"]) == (4.5, 10.0, 900)
    assert out["rounds"] == rounds
    with pytest.raises(ValueError, match="no rounds"):
        predicted.summarize_rounds([])


def test_cpu_compile_rounds_refuses_what_it_cannot_measure(monkeypatch):
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        predicted.cpu_compile_rounds("tiny", 2, "deepseek_v3", 0)
    quiet = {"log": lambda s: None}
    # A round that fails says which, in one line, with the child's own error.
    with pytest.raises(RuntimeError, match=r"round 1 of 1 failed: .*no_such_preset"):
        predicted.cpu_compile_rounds("no_such_preset", 2, "deepseek_v3", 1, **quiet)
    # A round whose process prints no result: which round, and what it printed.
    monkeypatch.setattr(predicted, "_ROUND", "print('compiled, I think')")
    with pytest.raises(RuntimeError, match=r"round 1 of 2 printed no result: 'compiled, I think'"):
        predicted.cpu_compile_rounds("tiny", 2, "deepseek_v3", 2, **quiet)


@pytest.mark.slow
def test_cpu_compile_rounds_measures_each_round_in_a_fresh_process():
    out = predicted.cpu_compile_rounds("tiny", 2, "deepseek_v3", 2, log=lambda s: None)
    assert len(out["rounds"]) == 2
    for r in out["rounds"]:
        assert r["ratio"] == pytest.approx(r["deepseek_v3"] / r["bf16"])
    assert out["ratio min"] <= out["ratio"] <= out["ratio max"]
    assert out["deepseek_v3 fusions"] > out["bf16 fusions"] > 0


def test_fp8_operand_gemms_are_the_three_gemms_of_the_fwd_bwd():
    # On this CPU, against float64 products of the same E4M3 values: y = x w,
    # dx = dy w^T, dw = x^T dy, each rounded once to bfloat16.
    rng = np.random.default_rng(0)
    e4m3 = jnp.float8_e4m3fn
    x, w, dy = (rng.normal(size=s).astype(e4m3) for s in ((16, 64), (64, 32), (16, 32)))
    want = [a.astype(np.float64) @ b.astype(np.float64) for a, b in ((x, w), (dy, w.T), (x.T, dy))]
    for fn in (predicted.fp8_operand_gemms, jax.jit(predicted.fp8_operand_gemms)):
        got = fn(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy))
        for g, ref in zip(got, want, strict=True):
            assert g.dtype == jnp.bfloat16 and g.shape == ref.shape
            np.testing.assert_allclose(np.asarray(g, np.float64), ref, rtol=2**-8, atol=1e-6)


def test_tpu7x_gemm_case_prices_the_compilers_own_fp8_gemms():
    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    recs = predicted.gemm_case(Shape("s", "custom", 256, 512, 256), [], ["auto"], t, reference=True)
    assert [r["recipe"] for r in recs] == ["bf16", predicted.FP8_OPERANDS]
    ref = recs[1]
    assert sum(ref["gemm_kernels"].values()) == 3
    assert ref["gemm_flops"] == pytest.approx(3 * 2 * 256 * 512 * 256)
    assert "bytes_ratio" in ref and predicted.FP8_OPERANDS in predicted.table(recs)
