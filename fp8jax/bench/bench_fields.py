"""The settings each benchmark of ``experiments/bench.py`` accepts, checked before it runs.

``FIELDS[benchmark]`` maps every field of configs/bench/<benchmark>.py to its
check (:mod:`fp8jax.train.fields`); ``FOOTPRINTS[benchmark]``, where sizes are
settings, gives a lower bound of the bytes the benchmark's arrays take from the
checked values, compared with the memory available before anything is allocated.
GEMM sizes of the core benchmark are whole 128-blocks (the tiles it times).
"""

from __future__ import annotations

from collections.abc import Callable

from fp8jax.train.fields import (
    Check,
    ConfigError,
    boolean,
    choice,
    integer,
    integers,
    items,
    names,
    number,
    recipe_names,
    shapes,
    text,
)


def _step_preset(field: str, value: object) -> str:
    """A model preset of the MoE train step (fp8jax.bench.moe_step.PRESETS)."""
    from fp8jax.bench.moe_step import PRESETS

    return choice(*PRESETS)(field, value)


def _step_rows(field: str, value: object) -> list[str]:
    """Rows ``recipe[:dequant_dtype][@notel]`` of the model-step benchmark, at least one."""
    from fp8jax.bench.moe_step import parse_spec

    rows = items(text(field, value))
    if not rows:
        raise ConfigError(f"config.{field} is empty: give one or more rows")
    for spec in rows:
        try:
            parse_spec(spec)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"config.{field}: {e}") from None
    return rows


def _mesh(field: str, value: object) -> tuple[int, ...]:
    sizes = integers(1)(field, value)
    if len(sizes) != 3:
        raise ConfigError(f"config.{field} = {value!r}: give three sizes data,fsdp,expert")
    return tuple(sizes)


def _impls() -> tuple[str, ...]:
    from fp8jax.bench.gemm_cases import SWEEP_IMPLS

    return SWEEP_IMPLS


_POSITIVE = integer(1)
_WIDTH = integer(4, multiple=4)  # d_model of bench_model: 4 heads of d_model / 4


def _targets() -> tuple[str, ...]:
    from fp8jax.bench.compilers import TARGETS

    return tuple(TARGETS)


def _recipe_impls() -> tuple[str, ...]:
    """Every GEMM-core implementation a recipe may name ("auto" included)."""
    from fp8jax.recipes import IMPLS

    return tuple(dict.fromkeys(["auto", *(i for impls in IMPLS.values() for i in impls)]))


def _grouped(field: str, value: object) -> list[tuple[int, ...]]:
    """Grouped expert GEMMs EXPERTSxROWSxKxN, positive integers ("" for none)."""
    out = []
    for spec in items(text(field, value)):
        parts = spec.lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(
                f"config.{field}: {spec!r} is not EXPERTSxROWSxKxN of positive integers"
            )
        out.append(tuple(int(p) for p in parts))
    return out


def _optional_preset(field: str, value: object) -> str:
    """A MoE train-step preset, or "" for none."""
    return "" if value == "" else _step_preset(field, value)


def _optional_recipe(field: str, value: object) -> str:
    """One recipe name, or "" for none."""
    if value == "":
        return ""
    got = recipe_names()(field, value)
    if len(got) != 1:
        raise ConfigError(f'config.{field}: give one recipe name or "", got {value!r}')
    return got[0]


FIELDS: dict[str, dict[str, Check]] = {
    "checkpoint": {
        "config": text,  # a training config file (checked to exist by the benchmark)
        "repeats": integer(1, 100),
    },
    "compilers": {
        "targets": names(_targets),
        "recipes": recipe_names(),
        "impls": names(_recipe_impls),
        "shapes": shapes(empty=True),
        "grouped": _grouped,
        "moe_step": _optional_preset,
        "batch": _POSITIVE,
        "cpu_compile_recipe": _optional_recipe,
        "cpu_compile_preset": _step_preset,
        "cpu_compile_rounds": integer(1, 20),
        "fp8_reference": boolean,
    },
    "core": {
        "size": integer(128, multiple=128),
        "quant_rows": integer(128, multiple=128),
        "iters": _POSITIVE,
    },
    "kernels": {
        "size": choice("auto", "small", "full"),
        "iters": _POSITIVE,
        "sweep": boolean,
        "grouped": boolean,
    },
    "memory": {
        "seq": _POSITIVE,
        "layers": _POSITIVE,
        "batch": _POSITIVE,
        "d_model": _WIDTH,
        "recipes": recipe_names(),
        "top": _POSITIVE,
        "compile": boolean,
    },
    "model_step": {
        "preset": _step_preset,
        "attention": choice("mha", "mla"),
        "batch": _POSITIVE,
        "seq": integer(0),
        "steps": _POSITIVE,
        "recipes": _step_rows,
    },
    "parallel": {
        "mesh": _mesh,
        "batch": _POSITIVE,
        "seq": _POSITIVE,
        "layers": _POSITIVE,
        "d_model": _WIDTH,
        "experts": _POSITIVE,
        "iters": _POSITIVE,
    },
    "sweep": {
        "groups": names(("square", "dsv3", "moe"), empty=True),
        "shapes": shapes(empty=True),
        "square_sizes": integers(1, empty=True),
        "m_tokens": _POSITIVE,
        "dsv3_n": integers(1, empty=True),
        "expert_m": integer(0),
        "recipes": recipe_names(empty=True),
        "impls": names(_impls, empty=True),
        "dequant_dtypes": names(("float32", "bfloat16")),
        "passes": names(("fwd", "fwd_bwd")),
        "dtype": choice("bfloat16", "float32"),
        "warmup": integer(0),
        "iters": _POSITIVE,
        "time_budget_s": number(0),
        "moe_step": boolean,
        "moe_preset": _step_preset,
        "moe_batch": _POSITIVE,
        "moe_seq": integer(0),
        "moe_iters": _POSITIVE,
        "dump_hlo": boolean,
        "plots": boolean,
    },
}


def _core(v: dict) -> int:
    # float32 x, w, dy of the GEMM; float32 input, bfloat16 copy and E4M3 codes of the quantize.
    return max(12 * v["size"] ** 2, 7 * v["quant_rows"] ** 2)


def _activations(v: dict) -> int:
    # One float32 (batch, seq, d_model) activation kept per block.
    return 4 * v["batch"] * v["seq"] * v["d_model"] * v["layers"]


def _sweep(v: dict) -> int:
    # float32 x, w, dy of the largest explicit or square GEMM.
    sizes = [4 * (m * k + k * n + m * n) for m, k, n in v["shapes"]]
    return max([12 * s * s for s in v["square_sizes"]] + sizes + [0])


FOOTPRINTS: dict[str, Callable[[dict], int]] = {
    "core": _core,
    "memory": _activations,
    "parallel": _activations,
    "sweep": _sweep,
}
