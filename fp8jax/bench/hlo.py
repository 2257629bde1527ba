"""Which GEMM kernel ran: inspection of a compiled XLA executable's HLO text.

``summarize_hlo(text)`` lists every GEMM in an optimized HLO module -- plain
``dot`` instructions (wherever they sit: in a fusion, a Triton GEMM fusion, a
oneDNN/YNN custom fusion) and GEMM custom calls (cuBLAS, cuBLASLt, cuDNN,
Pallas/Triton kernels) -- with the element types of their operands and result.
``kernel_path(summary, backend)`` turns that into one human-readable line, and
``hlo_report(text, backend)`` gives the fields a benchmark record carries.

Every GEMM also names its dot algorithm, as the compiled module states it:
``algorithm=dot_f32_f32_f32`` (a ``jax.lax.DotAlgorithmPreset``),
``operand_precision={highest,highest}`` (a ``jax.lax.Precision``), the
``"algorithm"`` of a cuBLAS call's precision config, or ``default`` when the
dot states neither (then the backend picks: TF32 passes on Ampere/Hopper GPUs
and bfloat16 passes on TPU for float32 operands, exact float32 on CPU).

Why the HLO and not the Python code: on GPU, XLA's GEMM rewriter decides
after tracing whether a dequantize-then-dot pattern
``dot(convert(a_f8) * scale_a, convert(b_f8) * scale_b)`` becomes a cuBLASLt
FP8 GEMM (custom call ``__cublas$lt$matmul$f8``, FP8 tensor cores) or stays a
BF16/F32 GEMM on dequantized operands.  Only the compiled module tells.
"""

from __future__ import annotations

import re
from typing import Any

#: Custom-call target of XLA's cuBLASLt FP8 GEMM (per-tensor scaled FP8 dot on Hopper+).
CUBLASLT_FP8_TARGET = "__cublas$lt$matmul$f8"

_FP8_TYPE_RE = re.compile(r"^f8e")
# "%name = f32[...]" or "ROOT %name = (f32[...], s8[...])"  -> name, type text
_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_CALLS_RE = re.compile(r"calls=%?([\w.\-]+)")
_FUSION_KIND_RE = re.compile(r"kind=(k\w+)")
_BACKEND_KIND_RE = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_ELEM_RE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[")
_ALGORITHM_RE = re.compile(r"\balgorithm=([\w]+)")
_PRECISION_RE = re.compile(r"\boperand_precision=\{([^}]*)\}")
_CONFIG_ALGORITHM_RE = re.compile(r'"algorithm"\s*:\s*"([^"]+)"')
_CONFIG_PRECISION_RE = re.compile(r'"operand_precision"\s*:\s*\[([^\]]*)\]')


def _elem_types(type_text: str) -> list[str]:
    """Element types in an HLO shape text: 'f32[2,3]{1,0}' -> ['f32']; tuples give several."""
    return _ELEM_RE.findall(type_text)


def dot_algorithm(line: str) -> str:
    """The dot algorithm an HLO instruction line states (see the module docstring)."""
    m = _ALGORITHM_RE.search(line)
    if m:
        return m.group(1)
    m = _CONFIG_ALGORITHM_RE.search(line)
    if m and m.group(1) != "ALG_UNSET":
        return m.group(1)
    m = _PRECISION_RE.search(line) or _CONFIG_PRECISION_RE.search(line)
    if m:
        prec = [p.strip().strip('"').lower() for p in m.group(1).split(",") if p.strip()]
        if prec and any(p != "default" for p in prec):
            return "precision=" + ",".join(prec)
    return "default"


def _operand_text(line: str, opcode: str) -> str:
    """The text between ``opcode(`` and its matching ``)``."""
    start = line.index(opcode + "(") + len(opcode) + 1
    depth = 1
    i = start
    while i < len(line) and depth:
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
        i += 1
    return line[start : i - 1]


def _operand_types(operands: str, types: dict[str, str]) -> list[str]:
    """Element types of the operands: inline ('f32[2] %a') or looked up by name ('%a')."""
    out = []
    depth = 0
    cur = ""
    parts = []
    for ch in operands:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    for p in parts:
        p = p.strip()
        inline = _elem_types(p.split("%")[0]) if "%" in p else _elem_types(p)
        if inline:
            out.append(inline[0])
            continue
        name = p.lstrip("%").split()[-1] if p else ""
        out.append(types.get(name.lstrip("%"), "?"))
    return out


def summarize_hlo(text: str) -> dict[str, Any]:
    """Every GEMM (dot or GEMM-like custom call) of an optimized HLO module.

    Returns a dict with
      ``gemms``: list of {"op": "dot" | "custom-call", "target" (custom calls),
        "operand_types", "result_type", "computation", "fusion_kind",
        "algorithm"} -- for a
        dot inside a fused computation, ``fusion_kind`` is the calling fusion's
        kind (e.g. "kOutput", "__triton_gemm", "__ynn_fusion");
      ``custom_call_targets``: sorted set of all custom-call targets;
      ``fp8_gemm``: True when some GEMM takes FP8 operands (an FP8 dot or an
        FP8 cuBLASLt call);
      ``cublaslt_fp8``: True when ``__cublas$lt$matmul$f8`` is called;
      ``fp8_values``: True when any instruction produces FP8 values (a
        quantize), whether or not a GEMM consumes them directly;
      ``dot_algorithms``: the distinct dot algorithms of the GEMMs, in order.
    """
    types: dict[str, str] = {}
    gemms: list[dict[str, Any]] = []
    targets: set[str] = set()
    callers: dict[str, str] = {}
    comp = ""
    lines = text.splitlines()
    for line in lines:
        m = _COMP_RE.match(line)
        if m and "=" not in line.split("(")[0]:
            comp = m.group(1)
            continue
        d = _DEF_RE.match(line)
        if not d:
            continue
        name, type_text, opcode = d.group(1), d.group(2), d.group(3)
        et = _elem_types(type_text)
        types[name] = et[0] if et else "?"
        if opcode == "fusion":
            c = _CALLS_RE.search(line)
            if c:
                kind = _BACKEND_KIND_RE.search(line) or _FUSION_KIND_RE.search(line)
                callers[c.group(1)] = kind.group(1) if kind else "fusion"
        if opcode == "custom-call":
            t = _TARGET_RE.search(line)
            target = t.group(1) if t else "?"
            targets.add(target)
            if _is_gemm_target(target):
                gemms.append(
                    {
                        "op": "custom-call",
                        "target": target,
                        "operand_types": _operand_types(_operand_text(line, opcode), types),
                        "result_type": types[name],
                        "computation": comp,
                        "algorithm": dot_algorithm(line),
                    }
                )
        elif opcode in ("dot", "convolution", "ragged-dot"):
            gemms.append(
                {
                    "op": opcode,
                    "target": "",
                    "operand_types": _operand_types(_operand_text(line, opcode), types),
                    "result_type": types[name],
                    "computation": comp,
                    "algorithm": dot_algorithm(line),
                }
            )
    for g in gemms:
        g["fusion_kind"] = callers.get(g["computation"], "")
    fp8 = any(any(_FP8_TYPE_RE.match(t) for t in g["operand_types"]) for g in gemms)
    return {
        "gemms": gemms,
        "fp8_values": any(_FP8_TYPE_RE.match(t) for t in types.values()),
        "custom_call_targets": sorted(targets),
        "fp8_gemm": bool(fp8),
        "cublaslt_fp8": CUBLASLT_FP8_TARGET in targets,
        "dot_algorithms": list(dict.fromkeys(g["algorithm"] for g in gemms)),
    }


def _is_gemm_target(target: str) -> bool:
    t = target.lower()
    return (
        t.startswith("__cublas")
        or t.startswith("__cudnn$")
        or "matmul" in t
        or "gemm" in t
        or "triton" in t
        or "mosaic" in t
        or t.startswith("__onednn")
    )


def _describe(g: dict[str, Any]) -> str:
    ops = "x".join(g["operand_types"][:2]) or "?"
    where = g["target"] if g["op"] == "custom-call" else g["op"]
    if g.get("fusion_kind"):
        where += f"@{g['fusion_kind']}"
    return f"{where}({ops}->{g['result_type']})"


def kernel_path(summary: dict[str, Any], backend: str) -> str:
    """One line naming the GEMM path(s) that ran, most important first.

    GPU: "cuBLASLt FP8 GEMM" when ``__cublas$lt$matmul$f8`` is called, else
    "cuBLAS(Lt) <types> GEMM on dequantized operands", a Triton GEMM fusion or a
    Pallas/Triton kernel; CPU: "XLA CPU dot <types>" (FP8 operands are always
    dequantized before the dot on CPU).  Each GEMM ends with its dot
    algorithm in brackets.
    """
    gemms = summary["gemms"]
    if not gemms:
        return "no GEMM found in HLO"
    # FP8 values exist but no GEMM reads them: they were dequantized first.
    prefix = (
        "FP8 dequantized, then " if summary.get("fp8_values") and not summary["fp8_gemm"] else ""
    )
    kinds: list[str] = []
    for g in gemms:
        tgt = g["target"]
        ops = "x".join(g["operand_types"][:2])
        if tgt == CUBLASLT_FP8_TARGET:
            k = f"cuBLASLt FP8 GEMM ({ops})"
        elif tgt.startswith("__cublas"):
            k = f"cuBLAS GEMM {tgt} ({ops})"
        elif tgt.startswith("__cudnn"):
            k = f"cuDNN {tgt} ({ops})"
        elif "triton" in tgt.lower() or "mosaic" in tgt.lower():
            k = f"Pallas/Triton kernel {tgt} ({ops})"
        elif g.get("fusion_kind", "").startswith("__triton"):
            k = f"XLA Triton GEMM fusion ({ops}->{g['result_type']})"
        elif backend == "cpu":
            fk = g.get("fusion_kind", "")
            k = f"XLA CPU {g['op']} ({ops}->{g['result_type']}{', ' + fk if fk else ''})"
        else:
            k = f"XLA {backend} {_describe(g)}"
        k += f" [{g['algorithm']}]"
        if k not in kinds:
            kinds.append(k)
    return prefix + "; ".join(kinds)


def hlo_report(text: str, backend: str) -> dict[str, Any]:
    """The HLO fields of a benchmark record, from a compiled module's text.

    ``kernel_path`` (one line), ``fp8_gemm``, ``cublaslt_fp8`` ("found" /
    "not found" on GPU, "n/a" elsewhere), ``dot_algorithms`` (joined with
    "; "), ``n_gemms``, ``gemms`` and ``custom_call_targets``.
    """
    summary = summarize_hlo(text)
    if backend != "gpu":
        cublaslt = "n/a"
    else:
        cublaslt = "found" if summary["cublaslt_fp8"] else "not found"
    return {
        "kernel_path": kernel_path(summary, backend),
        "fp8_gemm": summary["fp8_gemm"],
        "cublaslt_fp8": cublaslt,
        "dot_algorithms": "; ".join(summary["dot_algorithms"]),
        "n_gemms": len(summary["gemms"]),
        "gemms": summary["gemms"],
        "custom_call_targets": summary["custom_call_targets"],
    }


# --------------------------------------------------------------------------
# Collectives: how many bytes each kind moves
# --------------------------------------------------------------------------

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_SHAPE_RE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_ELEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
_ELEM_BYTES.update({"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8})


def _shape_bytes(type_text: str) -> list[int]:
    """Bytes of every array shape in an HLO type text ('(f32[2,3], u8[4])' -> [24, 4])."""
    out = []
    for elem, dims in _SHAPE_RE.findall(type_text):
        # Every FP8 type (f8e4m3fn, f8e5m2, f8e8m0fnu, ...) is one byte.
        size = 1 if elem.startswith("f8") else _ELEM_BYTES.get(elem)
        if size is None:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * size)
    return out


_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def collective_bytes(text: str, scopes: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Bytes each collective kind produces per device in an optimized (SPMD) HLO module.

    ``{kind: {"bytes": total result bytes, "count": instructions,
    "by_type": {element type: bytes}, "by_scope": {scope: bytes}}}`` for the
    kinds in ``COLLECTIVES``.  ``scopes``: ``jax.named_scope`` names; a
    collective counts toward the first one its ``op_name`` metadata contains
    ("" when none).  The result of an all-to-all is what one device sends
    (and receives); of an all-gather, the gathered array.  Asynchronous
    pairs count once (the ``-start`` op's last tuple element, its result).
    A collective inside a loop body counts once, whatever the trip count.
    """
    out = {k: {"bytes": 0, "count": 0, "by_type": {}, "by_scope": {}} for k in COLLECTIVES}
    for line in text.splitlines():
        d = _DEF_RE.match(line)
        if not d:
            continue
        opcode = d.group(3)
        kind = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
        if kind not in out:
            continue
        shapes = _SHAPE_RE.findall(d.group(2))
        sizes = _shape_bytes(d.group(2))
        if opcode.endswith("-start"):
            shapes, sizes = shapes[-1:], sizes[-1:]
        m = _OP_NAME_RE.search(line)
        op_name = m.group(1) if m else ""
        parts = re.split(r"[/()]", op_name)
        scope = next((s for s in scopes if s in parts), "")
        rec = out[kind]
        rec["count"] += 1
        for (elem, _), b in zip(shapes, sizes):
            rec["bytes"] += b
            rec["by_type"][elem] = rec["by_type"].get(elem, 0) + b
            rec["by_scope"][scope] = rec["by_scope"].get(scope, 0) + b
    return out


_MLIR_START_RE = re.compile(
    r'"stablehlo\.(all_to_all|all_gather|reduce_scatter|all_reduce|collective_permute)"'
)
# The op's result types and location: on its own line, or after its
# reduction region ("}) : (...) -> ... loc(#locN)").
_MLIR_RESULT_RE = re.compile(r"->\s*(.*?)\s+loc\((#loc\d+)\)\s*$")
_MLIR_LOC_RE = re.compile(r'^(#loc\d+) = loc\("([^"]*)"')
_MLIR_TENSOR_RE = re.compile(r"tensor<([^>]*)>")
_MLIR_ELEM_BYTES = {"i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "bf16": 2, "f16": 2}
_MLIR_ELEM_BYTES.update({"i32": 4, "ui32": 4, "f32": 4, "i64": 8, "ui64": 8, "f64": 8})


def lowered_collective_bytes(text: str, scopes: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """:func:`collective_bytes` of the collectives a program writes, from its lowered module.

    ``text`` is ``jax.jit(f).lower(...).as_text(debug_info=True)`` (StableHLO
    with locations).  These are the collectives of ``shard_map`` regions and
    their transposes, in the element types the program asks for; a backend
    may widen them when it compiles (XLA on CPU moves BF16 collectives as
    float32 and FP8 ones as float16; uint8 stays uint8), and the SPMD
    partitioner adds its own (see :func:`collective_bytes` on the compiled
    module for those).  Kinds use the HLO spelling ("all-to-all", ...).
    """
    locs = {}
    for line in text.splitlines():
        m = _MLIR_LOC_RE.match(line)
        if m:
            locs[m.group(1)] = m.group(2)
    out = {k: {"bytes": 0, "count": 0, "by_type": {}, "by_scope": {}} for k in COLLECTIVES}
    pending = None
    for line in text.splitlines():
        start = _MLIR_START_RE.search(line)
        if start:
            pending = start.group(1).replace("_", "-")
        if pending is None:
            continue
        m = _MLIR_RESULT_RE.search(line)
        if not m or (not start and not line.lstrip().startswith("})")):
            continue
        kind, pending = pending, None
        parts = re.split(r"[/()]", locs.get(m.group(2), ""))
        scope = next((s for s in scopes if s in parts), "")
        rec = out[kind]
        rec["count"] += 1
        for t in _MLIR_TENSOR_RE.findall(m.group(1)):
            *dims, elem = t.split("x")
            # Every FP8 type (f8E4M3FN, f8E5M2, ...) is one byte.
            size = 1 if elem.startswith("f8") else _MLIR_ELEM_BYTES.get(elem)
            if size is None:
                continue
            n = 1
            for d in dims:
                n *= int(d)
            rec["bytes"] += n * size
            rec["by_type"][elem] = rec["by_type"].get(elem, 0) + n * size
            rec["by_scope"][scope] = rec["by_scope"].get(scope, 0) + n * size
    return out
