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
