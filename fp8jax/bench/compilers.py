"""The accelerators' compilers asked, from a CPU machine, what a program costs.

No GPU or TPU is needed: XLA's GPU compiler compiles for a GPU described by a
``GpuTargetConfig`` (the jax CUDA plugin at jax's version, no driver), and
libtpu compiles for a TPU topology.  :func:`compile_for` returns the real
executable (optimized HLO, kernels, temporaries); :func:`census` reads it:

* GEMM kernels by kind (cuBLAS, cuBLASLt FP8, cuDNN, XLA Triton GEMM fusion,
  Pallas Triton, Mosaic GPU, Mosaic TPU, XLA dot), with their FLOPs;
* the other kernels (fusions, copies) and their estimated time;
* loops (``while``) with their trip counts, whether a GEMM runs inside, and
  how many quantizer kernels each repeats;
* temporaries (the executable's temp allocation) and HBM bytes.

Time estimates and their limits:

* GPU: ``xla_gpu_collect_cost_model_stats`` makes XLA write its GPU
  performance model's estimate into every fusion ("reification_cost",
  ``exec_time_us``).  Nothing is autotuned without a device, so a GEMM's own
  estimate is not trusted: every GEMM kernel (XLA's, a library call or a
  custom kernel, which XLA does not model at all) is priced as a roofline,
  max(FLOPs / the card's dense peak for its input type, bytes / HBM
  bandwidth).  A kernel without an estimate (a copy, a custom call that is
  no GEMM) is priced at bytes / bandwidth.
* TPU: libtpu's ``cost_analysis()``: "optimal_seconds" (negative where it
  cannot estimate, e.g. a program with loops) and "bytes accessed".  A
  Pallas kernel counts the bytes its ``pl.CostEstimate`` declares (1e9
  declared on a (256, 256) float32 copy: 1e9 + 1 MB), so the kernels'
  estimates must be the traffic they cause.  Where it does price a
  counted loop, it prices at most 5 trips (a fori_loop of sin over 1 MB:
  2.1 MB for 1 trip, 10.5 MB for 10 and for 100): a TPU program's loops
  (``Census.loops``) are priced low.
* XLA's estimate of a non-GEMM kernel is believed up to :data:`DISTRUST`
  times its bytes at HBM speed; beyond, the kernel is priced at bytes /
  bandwidth and listed (``Census.distrusted``): without a device XLA prices
  some block-level Triton fusions at milliseconds for kilobytes.
* A conditional's branches are all compiled; the census prices the dearer
  one.  A loop's body is priced once per trip.

These are predictions, not measurements: say so wherever they are quoted.
Target configs and where their numbers come from: :data:`TARGETS`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import jax
import numpy as np

from fp8jax import platforms
from fp8jax.bench.hlo import (
    _CALLS_RE,
    _DEF_RE,
    _OP_NAME_RE,
    _TARGET_RE,
    _operand_text,
    _shape_bytes,
)
from fp8jax.kernels.mgpu_block_gemm import K_GROUPED_NAME
from fp8jax.toolkit import hardware


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile-only accelerator: where its description comes from and its peaks.

    ``platform``: "cuda" or "tpu".  ``topology``: the GPU target config file
    (packaged under ``fp8jax/bench/gpu_targets``) or the TPU topology name.
    ``accelerator``: the key of the card in :mod:`fp8jax.toolkit.hardware`
    (dense peak TFLOP/s for the GEMM rooflines), None for a TPU (libtpu
    prices its own programs).
    """

    name: str
    platform: str
    topology: str
    capability: str | None
    accelerator: str | None
    source: str


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "h100",
            "cuda",
            "h100_sxm.txtpb",
            "9.0",
            "h100",
            "XLA GpuTargetConfig of an H100 SXM 80 GB (132 SMs, 3.35 TB/s, cc 9.0, CUDA 13.0, "
            "cuDNN 9.10); peaks from the accelerator table (NVIDIA datasheet, dense)",
        ),
        Target(
            "h200",
            "cuda",
            "h200_sxm.txtpb",
            "9.0",
            "h200",
            "the H100 SXM config with H200's memory (4.8 TB/s, 141 GB nominal); peaks from the "
            "accelerator table (NVIDIA datasheet, dense)",
        ),
        Target("v5e", "tpu", "v5e:2x2", None, None, "libtpu's own v5e description"),
        Target("v6e", "tpu", "v6e:2x2", None, None, "libtpu's own v6e (Trillium) description"),
        Target("tpu7x", "tpu", "tpu7x:2x2x1", None, None, "libtpu's own tpu7x (Ironwood)"),
    )
}

#: How many of the dearest non-GEMM kernels a census lists.
TOP_KERNELS = 8

#: An XLA estimate above this many times a non-GEMM kernel's bytes / HBM bandwidth
#: (and 1 us) is not believed (see :class:`Census`).
DISTRUST = 20.0

#: Kernels that are GEMMs, by how they show in compiled HLO (custom-call targets).
_GEMM_TARGETS = (
    ("__cublas$lt$matmul$f8", "cuBLASLt FP8"),
    ("__cublas$lt$matmul", "cuBLASLt"),
    ("__cublas$gemm", "cuBLAS"),
    ("__cudnn$", "cuDNN"),
    ("__gpu$xla.gpu.triton", "Pallas Triton"),
    ("mosaic_gpu", "Mosaic GPU"),
    ("tpu_custom_call", "Mosaic TPU"),
)
#: Pallas kernels that are no GEMM, by the kernel names fp8jax gives them (the
#: quantizers', the TPU telemetry's, SwiGLU's backward, the expert tiles' both ways):
#: their custom calls share the GEMM kernels' targets.
_NOT_GEMM_KERNELS = (
    "fp8_quantize_",
    "fp8_requantize_",
    "fp8_operand_telemetry",
    "fp8_swiglu_grad",
    "fp8_window_tiles",
    "fp8_window_rows",
)
#: A Mosaic GPU kernel is a GEMM where its module holds a tensor-core instruction
#: (a kernel's name is lost where it is batched by vmap: "batched_body").
_MOSAIC_GPU_MMA = ("wgmma", "tcgen05.mma", "tcgen05_mma")
_FREE_OPS = {
    "parameter",
    "constant",
    "bitcast",
    "get-tuple-element",
    "tuple",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
_DOT_OPS = ("dot", "ragged-dot", "convolution", "scaled-dot")
_COMP_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_BODY_RE = re.compile(r"body=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
_TO_APPLY_RE = re.compile(r"to_apply=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_EXEC_US_RE = re.compile(r'"exec_time_us"\s*:\s*([0-9.eE+\-]+)')
_DIMS_RE = re.compile(r"\[([\d,]*)\]")
_CONTRACT_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS_RE = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONDITION_RE = re.compile(r"condition=%?([\w.\-]+)")
_S32_CONST_RE = re.compile(r"s32\[\][^=]*constant\((\d+)\)")


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


def target(name: str) -> Target:
    """The :class:`Target` called ``name`` (one of :data:`TARGETS`), or one line why not."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown compile target {name!r}; known: {sorted(TARGETS)}") from None


def gpu_target_config(t: Target) -> str:
    """The text of ``t``'s GpuTargetConfig (packaged with fp8jax)."""
    return resources.files("fp8jax.bench").joinpath("gpu_targets", t.topology).read_text()


def unavailable(t: Target) -> str | None:
    """Why ``t`` cannot be compiled for on this machine (one line), or None."""
    try:
        _devices(t.name)
    except Exception as e:  # noqa: BLE001 -- any failure to describe the target is the answer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        need = (
            "the jax CUDA plugin at jax's version (pip install jax-cuda13-plugin=="
            f"{jax.__version__} jax-cuda13-pjrt=={jax.__version__}), and without a GPU "
            "JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1"
            if t.platform == "cuda"
            else "libtpu (pip install 'jax[tpu]')"
        )
        return f"cannot compile for {t.name}: {first[:200]} (needs {need})"
    return None


@functools.cache
def _devices(name: str):
    t = target(name)
    from jax.experimental import topologies

    if t.platform == "cuda":
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(t), topology="1x1x1"
        )
    else:
        # Several processes may compile for TPUs at once (pytest workers, a
        # benchmark beside a test run): libtpu otherwise locks itself to one.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topo = topologies.get_topology_desc(t.topology, "tpu")
    return topo.devices


def spec(shape: Sequence[int], dtype: Any, t: Target) -> jax.ShapeDtypeStruct:
    """An input of ``shape`` and ``dtype`` on one device of ``t`` (for :func:`compile_for`)."""
    mesh = jax.sharding.Mesh(np.array(_devices(t.name)[:1]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def specs(tree: Any, t: Target) -> Any:
    """Every array (or ShapeDtypeStruct) leaf of ``tree`` as a :func:`spec` on ``t``."""
    return jax.tree.map(lambda a: spec(a.shape, a.dtype, t), tree)


@dataclasses.dataclass
class Compiled:
    """A program compiled for a target: the executable and how long compiling took."""

    target: Target
    executable: Any
    compile_seconds: float
    text: str


def compile_for(fn: Callable, args: Sequence[Any], t: Target | str) -> Compiled:
    """``jax.jit(fn)`` traced, lowered and compiled for ``t`` from this machine.

    ``args``: arrays or ShapeDtypeStructs (placed on ``t`` by :func:`specs`).
    The CUDA branches are traced for the target's compute capability
    (:func:`fp8jax.platforms.lowering_for_cuda`), and XLA's GPU cost model
    writes its estimate into every fusion.  ``compile_seconds`` covers
    tracing, lowering and compiling.
    """
    t = target(t) if isinstance(t, str) else t
    why = unavailable(t)
    if why:
        raise RuntimeError(why)
    args = specs(tuple(args), t)
    start = time.perf_counter()
    if t.platform == "cuda":
        with platforms.lowering_for_cuda(t.capability):
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        options = {"xla_gpu_collect_cost_model_stats": True}
    else:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
        options = {}
    executable = lowered.compile(compiler_options=options)
    seconds = time.perf_counter() - start
    return Compiled(t, executable, seconds, executable.as_text())


# --------------------------------------------------------------------------
# Reading the compiled module
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Inst:
    name: str
    type_text: str
    opcode: str
    line: str


def _parse(text: str) -> tuple[dict[str, list[_Inst]], str]:
    """{computation: instructions} of an HLO module's text, and the entry's name."""
    comps: dict[str, list[_Inst]] = {}
    entry = ""
    cur: list[_Inst] | None = None
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m and "=" not in line.split("(")[0]:
            cur = comps.setdefault(m.group(2), [])
            if m.group(1):
                entry = m.group(2)
            continue
        d = _DEF_RE.match(line)
        if d and cur is not None:
            cur.append(_Inst(d.group(1), d.group(2), d.group(3), line))
    return comps, entry


def _dims(type_text: str) -> list[int]:
    m = _DIMS_RE.search(type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _operands(line: str, opcode: str) -> list[str]:
    """Names of an instruction's operands."""
    return re.findall(r"%([\w.\-]+)", _operand_text(line, opcode))


def _gemm_flops(inst: _Inst, types: dict[str, str]) -> float:
    """2 x output elements x contraction length of a dot or a GEMM kernel (for the
    grouped Wgrad kernel, whose groups split the contraction: one group's output)."""
    out = _dims(inst.type_text.split(")")[0] if inst.type_text.startswith("(") else inst.type_text)
    if K_GROUPED_NAME in f"{inst.name} {_op_name(inst.line)}" and out:
        # (E, M, N): each K run belongs to one expert, E products of M x N in all.
        out = out[1:]
    ops = [_dims(types.get(o, "")) for o in _operands(inst.line, inst.opcode)]
    out_n = math.prod(out) if out else 0
    labels = _DIM_LABELS_RE.search(inst.line)
    if inst.opcode == "convolution" and labels and ops:
        # A dot written as a convolution (TPU): the lhs's "f" axes are contracted.
        lhs = labels.group(1)
        length = math.prod(ops[0][i] for i, ch in enumerate(lhs) if ch == "f" and i < len(ops[0]))
        return 2.0 * out_n * length
    if inst.opcode in _DOT_OPS and ops:
        m = _CONTRACT_RE.search(inst.line)
        idx = [int(i) for i in m.group(1).split(",") if i] if m else []
        length = math.prod(ops[0][i] for i in idx if i < len(ops[0])) if idx else 1
        return 2.0 * out_n * length
    # A kernel: the two largest operands are the data (scales are smaller).
    data = sorted((o for o in ops if o), key=math.prod, reverse=True)[:2]
    if len(data) < 2 or not out_n:
        return 0.0
    a, b = data
    rest = list(a)
    for d in out:
        if d in rest:
            rest.remove(d)
    if rest and math.prod(rest) < math.prod(a):
        length = math.prod(rest)
    else:
        # Every axis of a is also an output axis (a square GEMM).
        length = math.sqrt(math.prod(a) * math.prod(b) / out_n)
    return 2.0 * out_n * length


def _inst_bytes(inst: _Inst, types: dict[str, str]) -> int:
    """Bytes an instruction reads and writes (operands + result), as HBM traffic.

    An in-place update (a dynamic-update-slice, alone or as a fusion's root)
    writes into its largest operand, which it neither reads nor copies: it moves
    the other operands, read and written once.
    """
    operands = [sum(_shape_bytes(types.get(o, ""))) for o in _operands(inst.line, inst.opcode)]
    if "dynamic-update-slice" in inst.opcode or "dynamic_update_slice" in inst.name:
        return 2 * (sum(operands) - max(operands, default=0))
    return sum(_shape_bytes(inst.type_text)) + sum(operands)


def _gemm_kind(inst: _Inst, comps: dict[str, list[_Inst]]) -> str | None:
    """The GEMM kind of a kernel, or None where it is no GEMM."""
    if inst.opcode == "custom-call":
        m = _TARGET_RE.search(inst.line)
        tgt = m.group(1) if m else ""
        # The kernel's own name (its instruction's, or the JAX operation that
        # made it), not the line: a GEMM's operand may be another kernel's result.
        own = f"{inst.name} {_op_name(inst.line)}"
        if any(name in own for name in _NOT_GEMM_KERNELS):
            return None
        for prefix, kind in _GEMM_TARGETS:
            if tgt.startswith(prefix):
                if prefix == "mosaic_gpu" and not any(mma in inst.line for mma in _MOSAIC_GPU_MMA):
                    return None
                return kind
        return None
    if inst.opcode in _DOT_OPS:
        return "XLA dot"
    if inst.opcode == "fusion":
        m = _CALLS_RE.search(inst.line)
        if m and _contains_dot(m.group(1), comps):
            if "__triton" in inst.line:
                return "XLA Triton GEMM"
            if "__cublas" in inst.line or "__cudnn" in inst.line:
                return "cuBLAS"
            return "XLA dot"
    return None


def _contains_dot(comp: str, comps: dict[str, list[_Inst]], seen: frozenset = frozenset()) -> bool:
    for i in comps.get(comp, []):
        if i.opcode in _DOT_OPS:
            return True
        m = _CALLS_RE.search(i.line)
        if m and m.group(1) not in seen and _contains_dot(m.group(1), comps, seen | {comp}):
            return True
    return False


def _dot_in_fusion(inst: _Inst, comps: dict[str, list[_Inst]]) -> _Inst | None:
    m = _CALLS_RE.search(inst.line)
    if not m:
        return None
    for i in comps.get(m.group(1), []):
        if i.opcode in _DOT_OPS:
            return i
        if i.opcode == "fusion":
            inner = _dot_in_fusion(i, comps)
            if inner is not None:
                return inner
    return None


@dataclasses.dataclass
class Census:
    """What a compiled program runs, and what the compiler predicts it costs.

    Times in microseconds; ``gemm_us`` is the roofline of every GEMM kernel,
    ``other_us`` XLA's estimate of everything else (GPU), ``total_us`` their
    sum (GPU) or libtpu's estimate (TPU; None where it gives none).
    ``gemm_flops``: the FLOPs of the GEMM kernels (a loop's counted per trip).
    ``top_other``: the dearest kernels that are no GEMM (name, the JAX operation
    that made it, predicted us), where the non-GEMM time goes.
    ``distrusted``: kernels whose XLA estimate exceeded :data:`DISTRUST` times
    their bytes at HBM speed (and 1 us): priced at bytes / bandwidth instead.
    """

    target: str
    gemm_kernels: dict[str, int]
    gemm_flops: float
    fusions: int
    other_kernels: int
    loops: list[dict[str, Any]]
    top_other: list[dict[str, Any]]
    distrusted: list[dict[str, Any]]
    temp_bytes: int
    hbm_bytes: float
    gemm_us: float | None
    other_us: float | None
    total_us: float | None
    compile_seconds: float
    estimate: str

    @property
    def gemm_in_loop(self) -> bool:
        """Whether some GEMM kernel runs inside a loop (K-runs through HBM, for one)."""
        return any(loop["gemms"] for loop in self.loops)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gemm_in_loop"] = self.gemm_in_loop
        return out


def census(c: Compiled) -> Census:
    """The :class:`Census` of a compiled program (see the module docstring)."""
    mem = c.executable.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
    costs = _cost_analysis(c.executable) if c.target.platform == "tpu" else {}
    return census_of_text(c.text, c.target, temp, costs, c.compile_seconds)


def census_of_text(
    text: str,
    t: Target,
    temp: int = 0,
    costs: dict[str, float] | None = None,
    compile_seconds: float = 0.0,
) -> Census:
    """The :class:`Census` of an optimized HLO module's text compiled for ``t``.

    ``temp``: the executable's temporary bytes; ``costs``: libtpu's
    ``cost_analysis()`` (TPU targets); ``compile_seconds``: as measured.
    """
    costs = costs or {}
    comps, entry = _parse(text)
    types = {i.name: i.type_text for insts in comps.values() for i in insts}
    acc = None if t.accelerator is None else hardware.get(t.accelerator)
    bandwidth = _bandwidth(t, acc)
    tally = {
        "gemm_kernels": {},
        "gemm_flops": 0.0,
        "fusions": 0,
        "other": 0,
        "loops": [],
        "distrusted": [],
    }

    def peak(inst: _Inst) -> float | None:
        if acc is None:
            return None
        fp8 = any(
            types.get(o, "").startswith("f8") for o in _operands(inst.line, inst.opcode)
        ) or "f8e" in (_dot_operand_types(inst, comps, types))
        key = "fp8" if fp8 else "bf16"
        v = acc.tflops.get(key) or acc.tflops.get("bf16")
        return None if v is None else v * 1e12

    def cost(comp: str, weight: int, in_loop: list[dict] | None) -> tuple[float, float, float]:
        """(GEMM us, other us, bytes) of running ``comp`` once, ``weight`` times counted."""
        gemm_us = other_us = nbytes = 0.0
        for inst in comps.get(comp, []):
            op = inst.opcode
            if op in _FREE_OPS:
                continue
            if op == "while":
                trips = _trips(inst.line, comps)
                body = _BODY_RE.search(inst.line).group(1)
                loop = {"name": inst.name, "trips": trips, "gemms": 0, "quantizers": 0}
                tally["loops"].append(loop)
                g, o, b = cost(body, weight * (trips or 1), loop)
                gemm_us += g * (trips or 1)
                other_us += o * (trips or 1)
                nbytes += b * (trips or 1)
                continue
            if op == "conditional":
                branches = _branches(inst.line)
                priced = [cost(b, 0, None) for b in branches]
                if priced:
                    worst = max(range(len(priced)), key=lambda i: sum(priced[i][:2]))
                    # Census the dearest branch once (counted with weight).
                    g, o, b = cost(branches[worst], weight, in_loop)
                    gemm_us, other_us, nbytes = gemm_us + g, other_us + o, nbytes + b
                continue
            if op == "call":
                m = _TO_APPLY_RE.search(inst.line) or _CALLS_RE.search(inst.line)
                if m:
                    g, o, b = cost(m.group(1), weight, in_loop)
                    gemm_us, other_us, nbytes = gemm_us + g, other_us + o, nbytes + b
                continue
            kind = _gemm_kind(inst, comps)
            b = _inst_bytes(inst, types)
            nbytes += b
            if kind is not None:
                target_inst = _dot_in_fusion(inst, comps) if op == "fusion" else inst
                flops = _gemm_flops(target_inst or inst, types)
                pk = peak(inst)
                us = max(flops / pk if pk else 0.0, b / bandwidth if bandwidth else 0.0) * 1e6
                gemm_us += us
                if weight:
                    tally["gemm_kernels"][kind] = tally["gemm_kernels"].get(kind, 0) + 1
                    tally["gemm_flops"] += flops * weight
                    if in_loop is not None:
                        in_loop["gemms"] += 1
                continue
            if weight:
                if op == "fusion":
                    tally["fusions"] += 1
                else:
                    tally["other"] += 1
                if in_loop is not None and QUANTIZER_JIT in _op_name(inst.line):
                    # Work a loop repeats that may not need repeating (a
                    # loop-invariant weight's quantization, say).
                    in_loop["quantizers"] += 1
            m = _EXEC_US_RE.search(inst.line)
            floor_us = b / bandwidth * 1e6 if bandwidth else 0.0
            us = float(m.group(1)) if m else floor_us
            if m and us > DISTRUST * max(floor_us, 1.0):
                # XLA prices some block-level (Triton) fusions absurdly without a
                # device (18 ms for a 0.5 MB product): take its bytes at HBM speed.
                if weight:
                    tally["distrusted"].append(
                        {"name": inst.name, "xla_us": round(us, 3), "used_us": round(floor_us, 3)}
                    )
                us = floor_us
            other_us += us
            if weight:
                top.append((us * weight, inst.name, _op_name(inst.line)))
        return gemm_us, other_us, nbytes

    top: list[tuple[float, str, str]] = []
    gemm_us, other_us, nbytes = cost(entry, 1, None)
    top = [
        {"us": round(us, 3), "name": name, "op": op}
        for us, name, op in sorted(top, reverse=True)[:TOP_KERNELS]
    ]
    if t.platform == "tpu":
        # libtpu prices the whole program itself (or not at all).
        seconds = costs.get("optimal_seconds")
        total = seconds * 1e6 if seconds is not None and seconds >= 0 else None
        nbytes = float(costs.get("bytes accessed", nbytes))
        gemm_us = other_us = None
        estimate = "libtpu cost_analysis optimal_seconds" + (
            " (none: libtpu gives no estimate)" if total is None else ""
        )
    else:
        total = gemm_us + other_us
        estimate = (
            "GEMMs: roofline max(FLOPs / dense peak, bytes / HBM bandwidth), not autotuned; "
            "other kernels: XLA's GPU cost model (bytes / bandwidth where it gives none)"
        )
    return Census(
        t.name,
        tally["gemm_kernels"],
        tally["gemm_flops"],
        tally["fusions"],
        tally["other"],
        tally["loops"],
        top,
        tally["distrusted"],
        temp,
        nbytes,
        gemm_us,
        other_us,
        total,
        compile_seconds,
        estimate,
    )


def _dot_operand_types(inst: _Inst, comps, types) -> str:
    """The operand types of the dot inside a GEMM fusion (its parameters'), as text."""
    if inst.opcode != "fusion":
        return ""
    dot = _dot_in_fusion(inst, comps)
    if dot is None:
        return ""
    return " ".join(types.get(o, "") for o in _operands(dot.line, dot.opcode))


def _op_name(line: str) -> str:
    m = _OP_NAME_RE.search(line)
    return m.group(1) if m else ""


def _trips(line: str, comps: dict[str, list[_Inst]]) -> int | None:
    """A loop's trip count: XLA's known_trip_count, else the one integer bound of its
    condition (a counter compared with a constant), else None (unknown)."""
    m = _TRIP_RE.search(line)
    if m:
        return int(m.group(1))
    cond = _CONDITION_RE.search(line)
    bounds = {
        int(c.group(1))
        for i in comps.get(cond.group(1) if cond else "", [])
        if (c := _S32_CONST_RE.search(i.line))
    }
    return bounds.pop() if len(bounds) == 1 else None


def _branches(line: str) -> list[str]:
    out = []
    for group, single in _BRANCHES_RE.findall(line):
        if group:
            out += [b.strip().lstrip("%") for b in group.split(",") if b.strip()]
        elif single:
            out.append(single)
    return out


def _bandwidth(t: Target, acc) -> float | None:
    """HBM bytes per second: the GPU target config's, else the accelerator table's."""
    if t.platform == "cuda":
        m = re.search(r"memory_bandwidth:\s*(\d+)", gpu_target_config(t))
        if m:
            return float(m.group(1))
    return None if acc is None else acc.bandwidth_bytes_per_s


def _cost_analysis(executable) -> dict[str, float]:
    ca = executable.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


def predict(fn: Callable, args: Sequence[Any], t: Target | str) -> Census:
    """:func:`census` of ``fn(*args)`` compiled for ``t``."""
    return census(compile_for(fn, args, t))


# What differs between copies of one kernel: instruction names and metadata.
_INST_NAME_RE = re.compile(r"%[\w.\-]+")
_METADATA_RE = re.compile(r",? metadata=\{[^}]*\}")

#: In the op_name of every kernel made from fp8jax's online quantizer
#: (:func:`fp8jax.quant.quantize` and the operands quantized through it).
QUANTIZER_JIT = "jit(_quantize_online)"


def kernel_census(text: str) -> dict[str, int]:
    """The fusions of an optimized HLO module, and the distinct kernels they make.

    Copies of one fused computation (the same instructions but for their
    names and metadata) are one kernel: XLA's CPU compiler compiles a
    program's repeated kernels far faster than new ones (docs/benchmarks.md:
    16 ms a repeated quantization against 51-62 ms a new one), so what a
    compile costs follows the distinct kernels and their instructions more
    than the fusion count.
    ``"quantizer kernels"`` / ``"quantizer instructions"``: the distinct
    kernels some fusion made from fp8jax's online quantizer calls
    (:data:`QUANTIZER_JIT` in its op_name), and their instructions.
    """
    comps, _ = _parse(text)
    kernels: dict[str, tuple[int, bool]] = {}
    fusions = 0
    for insts in comps.values():
        for inst in insts:
            if inst.opcode != "fusion":
                continue
            fusions += 1
            called = _CALLS_RE.search(inst.line)
            body = comps.get(called.group(1), []) if called else []
            key = "\n".join(
                _INST_NAME_RE.sub("%", _METADATA_RE.sub("", i.line)).strip() for i in body
            )
            seen = kernels.get(key, (len(body), False))
            kernels[key] = (len(body), seen[1] or QUANTIZER_JIT in _op_name(inst.line))
    quantizer = [n for n, q in kernels.values() if q]
    return {
        "fusions": fusions,
        "distinct kernels": len(kernels),
        "distinct instructions": sum(n for n, _ in kernels.values()),
        "quantizer kernels": len(quantizer),
        "quantizer instructions": sum(quantizer),
    }


def bf16_gemm_us(flops: float, t: Target | str) -> float | None:
    """Microseconds of ``flops`` at the card's dense BF16 peak (None: no peak known)."""
    t = target(t) if isinstance(t, str) else t
    if t.accelerator is None:
        return None
    peak = hardware.get(t.accelerator).tflops.get("bf16")
    return None if not peak else flops / (peak * 1e12) * 1e6


def to_json(obj: Any) -> str:
    """A census (or a list of records holding them) as JSON text."""
    return json.dumps(
        obj, default=lambda o: o.as_dict() if isinstance(o, Census) else str(o), indent=1
    )
