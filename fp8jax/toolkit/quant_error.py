"""Quantization error of one tensor under each recipe (what ``fp8jax quant-error`` prints).

For a tensor ``t`` (from a .npy file or a named tensor of a .safetensors
file) this measures, against ``t`` itself in float64:

1. **operands**: for each preset recipe (``fp8jax.recipes.PRESETS``), the
   forward activation and weight specs (and the gradient spec where it
   differs) applied to ``t`` with ``fp8jax.quantize`` along the contraction
   axis ``axis`` (the last axis for activations and for checkpoint weights,
   which are stored (out, in)).  Delayed per-tensor scaling is shown twice:
   with a fresh state (scale 1, what the first step sees) and in steady state
   (history amax == this tensor's amax, i.e. current per-tensor scaling);
2. **grid**: every granularity (tensor, row, 1x128 tile, 128x128 block) in
   E4M3 and E5M2 with online scaling;
3. **GEMM** (2-D tensors): ``y = x t^T`` through ``fp8jax.dot_general`` with
   each recipe, ``x`` a seeded Gaussian activation, against the float64
   product.

Reported per row: norm-wise relative error, SQNR in dB, the fraction of
elements saturated (clipped to +-max) and the fraction of non-zero elements
flushed to zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8jax.formats import BLOCK_FORMATS
from fp8jax.host_memory import available_memory
from fp8jax.layout import Layout
from fp8jax.numerics.metrics import relative_error, saturated_fraction, sqnr_db
from fp8jax.recipes import QuantSpec
from fp8jax.telemetry import flushed_fraction
from fp8jax.toolkit.convert.blockwise import (
    all_finite,
    check_scale,
    dequant_rows,
    describe_nonfinite,
)
from fp8jax.toolkit.convert.safetensors_io import FP8_DTYPES, SafetensorsFile, file_kind

_F32_MAX = float(np.finfo(np.float32).max)
# Bytes the GEMM section holds per element of the activation x (tokens, K)
# and of the output y (tokens, N): x in float64, float32 and FP8 with its
# dequantized float32 copy (8 + 4 + 1 + 4 + 4 for slack), the float64
# reference y and one recipe's float32 output with its float64 copy (8 + 4 + 8).
_GEMM_BYTES_PER_X = 21
_GEMM_BYTES_PER_Y = 20


@dataclass(frozen=True)
class ErrorRow:
    section: str
    label: str
    fmt: str
    granularity: str
    rel_error: float
    sqnr_db: float
    saturated: float
    flushed: float


def load_tensor(path: str | Path, name: str | None = None) -> tuple[np.ndarray, str]:
    """Load a tensor as float64: a .npy file, or ``name`` from a .safetensors file.

    An FP8 safetensors tensor with a ``<name>_scale_inv`` next to it (the
    DeepSeek layout) is dequantized blockwise first: the exact product of
    each FP8 value and its block's scale, rounded to float32.  The scale must
    have one value per 128x128 block, finite and > 0.  ValueError (one line)
    for a missing or corrupt file, a non-float or empty tensor, NaN or Inf.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"no such file: {p}")
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        # A FIFO would block the read, a device never end.
        raise ValueError(f"{p} is {file_kind(mode)}, not a regular file")
    if p.suffix == ".npy":
        if name:
            raise ValueError("--tensor is for .safetensors files; a .npy file holds one array")
        try:
            a = np.load(p, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"unreadable .npy file {p}: {e}") from None
        desc = f"{p.name}"
    elif p.suffix == ".safetensors":
        with SafetensorsFile(p) as f:
            names = f.names()
            if name is None:
                if len(names) != 1:
                    raise ValueError(
                        f"{p.name} holds {len(names)} tensors; pick one with --tensor: {names[:20]}"
                    )
                name = names[0]
            if name not in f:
                raise ValueError(f"{p.name} has no tensor {name!r}; it has: {names[:20]}")
            info = f.info(name)
            sname = name + "_scale_inv"
            if info.dtype in FP8_DTYPES and sname in f:
                w, s = f.get(name), f.get(sname)
                check_scale(name, info.shape, sname, s)
                _check_finite(w, f"{p.name}:{name}")
                a = dequant_rows(w, s, np.float32, rounding="exact")
                desc = f"{p.name}:{name} ({info.dtype} x {sname}, dequantized)"
            else:
                a = np.array(f.get(name))
                desc = f"{p.name}:{name} ({info.dtype})"
    else:
        raise ValueError(f"{p.name}: expected a .npy or .safetensors file")
    if not (
        np.issubdtype(a.dtype, np.floating)
        or a.dtype.name in ("bfloat16",)
        or "float8" in a.dtype.name
    ):
        raise ValueError(f"tensor dtype {a.dtype} is not floating point")
    if a.ndim == 0 or a.size == 0:
        raise ValueError(
            f"need a non-empty tensor of at least 1 dimension, got shape {list(a.shape)}"
        )
    _check_finite(a, desc)
    a64 = a.astype(np.float64)
    amax = float(np.max(np.abs(a64)))
    if amax > _F32_MAX:
        # Every quantizer computes in float32: such values become Inf there,
        # and every error in the table NaN.
        raise ValueError(
            f"{desc} holds values up to {amax:.3g}, beyond float32's range ({_F32_MAX:.3g}), "
            "where the quantizers compute; scale the tensor down first"
        )
    return a64, f"{desc} shape {list(a64.shape)}"


def _check_finite(a: np.ndarray, what: str) -> None:
    if not all_finite(a):
        raise ValueError(
            f"{what} holds {describe_nonfinite(a)}; error metrics would be meaningless"
        )


def check_axis(axis: int, ndim: int) -> int:
    """``axis`` normalised to 0..ndim-1; ValueError (one line) when out of range."""
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"--axis {axis} is out of range for a {ndim}-D tensor (use {-ndim}..{ndim - 1})"
        )
    return axis % ndim


# All layouts in one jitted function: one XLA compilation instead of one per
# layout (or one per op in eager mode), which is what dominates on CPU.
# A layout is (QuantSpec, fresh): fresh quantizes a delayed spec with a
# fresh state's scale, 1.
@functools.partial(jax.jit, static_argnames=("layouts", "axis"))
def _qdq_all(x, layouts, axis):
    import fp8jax

    out = []
    for spec, fresh in layouts:
        scale = jnp.ones((), jnp.float32) if fresh else None
        q = fp8jax.schemes.quantize(x, spec, axis, scale=scale)
        out.append((q.data, fp8jax.dequantize(q, jnp.float32)))
    return out


@dataclass(frozen=True)
class _Request:
    section: str
    label: str
    fmt: str
    gran_label: str
    layout: tuple | None  # (QuantSpec, fresh); None: a plain cast to ``fmt`` (bf16/fp32)


def _evaluate(x64: np.ndarray, axis: int, reqs: list[_Request]) -> list[ErrorRow]:
    axis = check_axis(axis, x64.ndim)
    x = jnp.asarray(x64, jnp.float32)
    layouts = tuple(dict.fromkeys(r.layout for r in reqs if r.layout is not None))
    results = dict(zip(layouts, _qdq_all(x, layouts, axis))) if layouts else {}
    rows = []
    for r in reqs:
        if r.layout is None:
            rows.append(_cast_row(r.section, r.label, x64, r.fmt))
        else:
            data, deq = results[r.layout]
            rows.append(_fp8_row(r.section, r.label, x64, data, deq, r.fmt, r.gran_label))
    return rows


def _fp8_row(
    section: str, label: str, x64: np.ndarray, data, deq, fmt_name: str, gran: str
) -> ErrorRow:
    import fp8jax

    deq = np.asarray(deq).astype(np.float64)
    fmt = np.dtype(fp8jax.formats.as_format(fmt_name))
    return ErrorRow(
        section,
        label,
        fmt_name,
        gran,
        relative_error(deq, x64),
        sqnr_db(deq, x64),
        saturated_fraction(x64, deq, np.asarray(data), fmt),
        float(flushed_fraction(x64, deq)),
    )


def _cast_row(section: str, label: str, x64: np.ndarray, dtype: str) -> ErrorRow:
    y = x64.astype(np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    y64 = y.astype(np.float64)
    with np.errstate(invalid="ignore"):
        sat = float(np.mean(np.isinf(y64)))
    return ErrorRow(
        section,
        label,
        dtype,
        "-",
        relative_error(y64, x64),
        sqnr_db(y64, x64),
        sat,
        float(flushed_fraction(x64, y64)),
    )


def _granularity_label(spec) -> str:
    g = spec.granularity
    if g == "tile":
        g = f"tile 1x{spec.tile}"
    elif g == "block":
        g = f"block {spec.tile}x{spec.tile}"
    if spec.scaling == "delayed":
        g += " delayed"
    if spec.pow2:
        g += " pow2"
    return g


def _operand_requests(ndim: int) -> list[_Request]:
    import fp8jax

    reqs: list[_Request] = []
    for rname, make in fp8jax.recipes.PRESETS.items():
        r = make()
        specs = r.specs()
        roles = [
            ("activation", specs["fprop_x"]),
            ("weight", specs["fprop_w"]),
            ("gradient", specs["dgrad_dy"]),
        ]
        # Block formats (MXFP8, NVFP4) have their own quantizers: their GEMM rows
        # below show them; the operand rows are the FP8 quantizer's.
        roles = [(role, spec) for role, spec in roles if spec.fmt not in BLOCK_FORMATS]
        # Roles with the same spec share a row.
        groups: dict[tuple, list[str]] = {}
        for role, spec in roles:
            key = (spec.fmt, spec.granularity, spec.tile, spec.scaling, spec.pow2, spec.amax_floor)
            groups.setdefault(key, []).append(role)
        for rl in groups.values():
            spec = dict(roles)[rl[0]]
            label = f"{rname}: {'/'.join(rl)}"
            if not spec.quantized:
                reqs.append(_Request("operands", label, r.compute_dtype, "-", None))
                continue
            if Layout.of(spec).blocked and ndim < 2:
                continue
            glabel = _granularity_label(spec)
            if spec.scaling == "delayed":
                # A fresh state quantizes with scale 1 (values past max clip); in
                # steady state the history amax is this tensor's amax.
                lay = (spec, True)
                reqs.append(_Request("operands", label + " (fresh state)", spec.fmt, glabel, lay))
                lay = (dataclasses.replace(spec, scaling="current"), False)
                reqs.append(_Request("operands", label + " (steady state)", spec.fmt, glabel, lay))
            else:
                lay = (spec, False)
                reqs.append(_Request("operands", label, spec.fmt, glabel, lay))
    return reqs


def _grid_requests(ndim: int, tile: int = 128) -> list[_Request]:
    reqs = []
    for fmt in ("e4m3", "e5m2"):
        for gran in ("tensor", "row", "tile", "block"):
            if gran == "block" and ndim < 2:
                continue
            label = {"tile": f"tile 1x{tile}", "block": f"block {tile}x{tile}"}.get(gran, gran)
            lay = (QuantSpec(fmt, gran, tile), False)
            reqs.append(_Request("grid", label, fmt, label, lay))
    return reqs


def operand_rows(x64: np.ndarray, axis: int = -1) -> list[ErrorRow]:
    """Section 1: each preset recipe's activation / weight / gradient quantization of the tensor."""
    return _evaluate(x64, axis, _operand_requests(x64.ndim))


_DIMS = (((1,), (1,)), ((), ()))  # y = x w^T: contract x's axis 1 with w's axis 1


@functools.partial(jax.jit, static_argnames="recipe")
def _gemm(x, w, state, recipe):
    import fp8jax

    return fp8jax.dot_general(
        x, w, _DIMS, recipe=recipe, state=state, preferred_element_type=jnp.float32
    )


@functools.partial(jax.jit, static_argnames="recipe")
def _next_state(x, w, state, recipe):
    # Overwrite-with-gradient: the state's gradient is the updated state.
    return jax.grad(lambda st: jnp.sum(_gemm(x, w, st, recipe)))(state)


def gemm_bytes(shape: tuple[int, ...], tokens: int) -> int:
    """About the bytes the GEMM section allocates for a (N, K) weight and ``tokens`` rows."""
    n, k = shape
    return tokens * (k * _GEMM_BYTES_PER_X + n * _GEMM_BYTES_PER_Y)


def check_gemm_fits(shape: tuple[int, ...], tokens: int, available: int | None = None) -> None:
    """Refuse (ValueError, one line) a GEMM section that cannot fit in memory, before allocating."""
    need = gemm_bytes(shape, tokens)
    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise ValueError(
            f"the GEMM section with --tokens {tokens} needs about {need / 1e9:.3g} GB, more than "
            f"the {have / 1e9:.3g} GB available; use fewer tokens or --no-gemm"
        )


def gemm_rows(
    w64: np.ndarray, tokens: int = 128, seed: int = 0, recipes: tuple[str, ...] | None = None
) -> list[ErrorRow]:
    """Section 3: y = x w^T through fp8jax.dot_general per recipe (w: (out, in)).

    ``recipes``: preset names to run (default: all of fp8jax.recipes.PRESETS).
    """
    import fp8jax
    from fp8jax.scaling import init_delayed_gemm_state

    if w64.ndim != 2:
        return []
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    check_gemm_fits(w64.shape, tokens)
    rng = np.random.default_rng(seed)
    x64 = rng.standard_normal((tokens, w64.shape[1])).astype(np.float32).astype(np.float64)
    y_ref = x64 @ w64.T
    x = jnp.asarray(x64, jnp.float32)
    w = jnp.asarray(w64, jnp.float32)
    rows = []
    for rname, make in fp8jax.recipes.PRESETS.items():
        if recipes is not None and rname not in recipes:
            continue
        r = make()
        variants = [("", None)]
        if fp8jax.recipes.needs_state(r):
            st0 = init_delayed_gemm_state(r)
            st1 = _next_state(x, w, st0, r)
            variants = [(" (fresh state)", st0), (" (after 1 step)", st1)]
        for suffix, st in variants:
            y = np.asarray(_gemm(x, w, st, r)).astype(np.float64)
            rows.append(
                ErrorRow(
                    "gemm",
                    rname + suffix,
                    r.fprop.lhs.fmt or r.compute_dtype,
                    f"x {r.fprop.lhs.granularity} / w {r.fprop.rhs.granularity}"
                    if r.is_fp8
                    else "-",
                    relative_error(y, y_ref),
                    sqnr_db(y, y_ref),
                    math.nan,
                    math.nan,
                )
            )
    return rows


def quant_error_report(
    x64: np.ndarray,
    axis: int = -1,
    gemm: bool = True,
    tokens: int = 128,
    gemm_recipes: tuple[str, ...] | None = None,
) -> list[ErrorRow]:
    """All three sections (the GEMM one for 2-D tensors only).

    ValueError for an ``axis`` outside -ndim..ndim-1 or ``tokens`` < 1.
    """
    check_axis(axis, x64.ndim)
    if gemm and tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if gemm and x64.ndim == 2:
        # Before the other sections: a refusal costs nothing.
        check_gemm_fits(x64.shape, tokens)
    reqs = _operand_requests(x64.ndim) + _grid_requests(x64.ndim)
    rows = _evaluate(x64, axis, reqs)
    if gemm and x64.ndim == 2:
        rows += gemm_rows(x64, tokens, recipes=gemm_recipes)
    return rows


def _pct(v: float) -> str:
    if math.isnan(v):
        return "-"
    return f"{100 * v:.3g}%" if v else "0"


def format_report(rows: list[ErrorRow], title: str) -> str:
    heads = {
        "operands": "Per recipe: its quantization of this tensor as each operand role",
        "grid": "Every granularity x format (online scaling)",
        "gemm": "y = x W^T through fp8jax.dot_general (x: Gaussian activations), vs float64",
    }
    out = [title, ""]
    for sec in ("operands", "grid", "gemm"):
        part = [r for r in rows if r.section == sec]
        if not part:
            continue
        out.append(heads[sec])
        cols = ["", "format", "granularity", "rel.err", "SQNR dB", "saturated", "flushed"]
        body = [
            [
                r.label,
                r.fmt,
                r.granularity,
                f"{r.rel_error:.3e}",
                f"{r.sqnr_db:.1f}",
                _pct(r.saturated),
                _pct(r.flushed),
            ]
            for r in part
        ]
        widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
        out.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def rows_as_dicts(rows: list[ErrorRow]) -> list[dict]:
    return [asdict(r) for r in rows]
