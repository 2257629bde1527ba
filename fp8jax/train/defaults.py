"""The training config schema with its defaults (configs/*.py start from these).

``base_config()`` lists every field :func:`fp8jax.train.loop.train` reads, each
default written once here (the model's own defaults live in
``fp8jax.models.ModelConfig``); its defaults are the tiny run
(``tiny_config()``, configs/tiny.py).  The other runs are config files that
list the fields they set (configs/small.py, configs/gpu.py, ...); a comparison
builds on one with :func:`config_file`.  An optional ``inject`` block
(:mod:`fp8jax.train.injection`) holds an experiment's injected stress.

:func:`validate` checks a config before anything is created and raises
:class:`ConfigError` (one line, naming the field and the fix) for every user
mistake.  ``RESUMABLE_FIELDS`` are the fields a resumed run may change.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
from pathlib import Path

import ml_collections

from fp8jax import registry
from fp8jax.models import ModelConfig
from fp8jax.recipes import Recipe
from fp8jax.train import injection
from fp8jax.train.fields import ConfigError
from fp8jax.train.fields import finite as _finite
from fp8jax.train.fields import require as _require
from fp8jax.train.optimizer import MOMENT_DTYPE

# Fields a run may change when it resumes from its workdir: they decide how
# long it trains and what it logs, not what a step computes.  ``steps`` may
# only grow (the cosine schedule is then stretched from the resumed step on).
# "mesh" (every mesh.* field): a checkpoint restores onto another mesh or
# process count; a step then computes the same sums in another float32 order.
RESUMABLE_FIELDS = (
    "steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "final_window",
    "mesh",
)


def is_resumable(field: str) -> bool:
    """True for a (dotted) config field a resumed run may change (``RESUMABLE_FIELDS``)."""
    return any(field == f or field.startswith(f + ".") for f in RESUMABLE_FIELDS)


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Model: a fp8jax.models.ModelConfig preset, plus dataclasses.replace overrides.
    c.model = "tiny"
    c.model_overrides = ml_collections.ConfigDict()
    # Recipe: a preset of fp8jax.recipes or a variant of fp8jax.variants.
    c.recipe = "deepseek_v3"

    # Data: "stdlib" (the interpreter's standard library sources/docs, no
    # download), "text" (data.path: a file or a folder; bytes, vocabulary 256),
    # "synthetic", or "tokens" (data.path: a token directory with tokens.json,
    # e.g. from `fp8jax data prepare`; its split and vocabulary are its own).
    # The model's vocabulary is the data's (model_overrides.vocab_size may
    # only make it larger).
    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.path = ""
    c.data.val_fraction = 0.05  # byte sources
    c.data.max_bytes = 0  # byte sources; 0: the whole corpus
    c.data.seed = 0  # synthetic source only

    c.seq_len = 64  # tokens per row fed to the model (<= max_seq_len; <= 0: max_seq_len)
    c.batch_size = 8
    c.microbatches = 1  # gradient accumulation: batch_size must divide by this
    # With microbatches > 1: FP8-block weights quantized once per step, their codes shared by
    # every microbatch (the same bits); false: quantized again in every microbatch.
    c.weights_once = True
    c.steps = 60
    c.seed = 0  # model init
    c.data_seed = -1  # batch order; -1: same as seed

    # AdamW (DeepSeek-V3 betas), warm-up + cosine decay to min_lr_ratio * lr.
    c.lr = 3e-3
    c.warmup_steps = 10
    c.min_lr_ratio = 0.1
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.weight_decay = 0.1
    c.clip_norm = 1.0  # global norm of the Param gradients (FP8 state is never clipped)
    c.moment_dtype = MOMENT_DTYPE  # AdamW mu and nu storage (DeepSeek-V3: BF16)

    c.eval_every = 20
    c.eval_batches = 2
    c.eval_batch_size = 8
    c.log_every = 10
    c.final_window = 3  # final train loss = mean over the last this-many *logged* steps
    c.checkpoint_every = 0  # 0: only at the end
    c.keep_checkpoints = 2
    c.tensorboard = True

    # Device mesh (fp8jax.parallel): axis sizes, one may be -1 ("the rest");
    # the default is data parallelism over every device.  batch_size and
    # eval_batch_size must divide by the device count.  num_processes > 1
    # (or JAX_COORDINATOR_ADDRESS in the environment) runs
    # jax.distributed.initialize first; coordinator_address "" and
    # process_id -1 leave them to the environment / cluster detection.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.expert = 1
    c.mesh.num_processes = 1
    c.mesh.coordinator_address = ""
    c.mesh.process_id = -1
    return c


def tiny_config() -> ml_collections.ConfigDict:
    """The schema's defaults: ModelConfig.tiny, 60 steps of 8 x 64 bytes (configs/tiny.py's run)."""
    return base_config()


def config_file(path: str | Path, *args: str) -> ml_collections.ConfigDict:
    """``get_config(*args)`` of the config file at ``path`` (e.g. a comparison building on
    configs/small.py: ``config_file(Path(__file__).parents[1] / "small.py")``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*args)


# Comparisons judge gaps of a fraction of a percent: their validation loss is
# measured on at least this many held-out predicted tokens.
COMPARISON_VAL_TOKENS = 65_536


def set_comparison_eval(c: ml_collections.ConfigDict, batch_size: int = 32) -> None:
    """Size ``c``'s validation set to at least ``COMPARISON_VAL_TOKENS`` predicted tokens.

    A row of ``seq_len`` bytes gives ``seq_len - 1`` predictions; the rows are
    evenly spaced windows of the held-out stream (``fp8jax.data.val_batches``).
    """
    n = seq_len(c, model_config(c))
    c.eval_batch_size = batch_size
    c.eval_batches = math.ceil(COMPARISON_VAL_TOKENS / (batch_size * (n - 1)))


def parse_seeds(spec: str) -> tuple[int, ...]:
    """Seeds from a config-file argument: "a-b" (inclusive), "a-b:step" or "s1,s2,...".

    Lets two processes share one comparison workdir, each training its own
    seeds (``--config=FILE:0-15:2`` and ``--config=FILE:1-15:2``); the whole
    range then re-reads every finished run and tabulates them all.
    """
    try:
        if "," in spec or "-" not in spec:
            return tuple(int(s) for s in spec.split(","))
        span, _, step = spec.partition(":")
        lo, hi = (int(s) for s in span.split("-"))
        seeds = tuple(range(lo, hi + 1, int(step or 1)))
    except ValueError:
        raise ConfigError(f"seeds {spec!r}: give 'a-b', 'a-b:step' or 's1,s2,...'") from None
    if not seeds:
        raise ConfigError(f"seeds {spec!r} selects no seed")
    return seeds


def comparison_block(
    name: str,
    runs: dict,
    notes: str,
    *,
    seeds=(0, 1),
    baseline: str = "bf16",
    contrasts: tuple[str, ...] = (),
) -> ml_collections.ConfigDict:
    """The ``compare`` block of a comparison config (fields: fp8jax.lab.compare).

    ``runs`` maps a label to the fields it overrides, at least ``recipe``
    (several labels may share a recipe: a label names a run, not a recipe).
    ``contrasts``: "a:b" pairs of labels also compared with each other.
    """
    return ml_collections.ConfigDict(
        dict(
            name=name,
            contrasts=list(contrasts),
            labels=list(runs),
            baseline=baseline,
            seeds=list(seeds),
            notes=notes,
            # Moving-average window (logged steps) of the train-loss curves in the plots.
            smooth=10,
            runs=ml_collections.ConfigDict(runs),
        )
    )


def tiny_comparison_config(
    name: str, runs: dict, notes: str, *, seeds=(0, 1), contrasts: tuple[str, ...] = ()
) -> ml_collections.ConfigDict:
    """The tiny model's 120-step comparison setup shared by formats/scaling/granularity.

    ``runs`` maps a label to {"recipe": ...}; "bf16" must be one of them (the
    baseline).  Runs live under the comparison's own workdir.
    """
    c = tiny_config()
    c.steps = 120
    c.warmup_steps = 12
    c.eval_every = 30
    c.log_every = 3
    c.final_window = 10
    set_comparison_eval(c)
    c.compare = comparison_block(name, runs, notes, seeds=seeds, contrasts=contrasts)
    return c


# Validation: everything train() reads, checked before a workdir, a corpus or a
# model exists, so a mistake costs one line and leaves nothing behind.

_DATA_SOURCES = ("stdlib", "text", "synthetic", "tokens")
_MOMENT_DTYPES = ("float32", "bfloat16")


def _fields(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
    """Dotted field name -> value (nested ConfigDicts flattened, model_overrides kept whole)."""
    out: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict) and key != "model_overrides":
            out.update(_fields(value, name + "."))
        else:
            out[name] = value
    return out


def fields_help(config: ml_collections.ConfigDict | None = None) -> str:
    """Every config field with its default, one per line (``--config.<field>=<value>``).

    Defaults are those of ``config`` (default: :func:`base_config`); each
    field's meaning is written next to it in this module.
    """
    fields = _fields(base_config() if config is None else config)
    width = max(len(name) for name in fields)
    lines = [
        f"  --config.{name:<{width}} default "
        + repr(value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value)
        for name, value in fields.items()
    ]
    return "\n".join(lines)


# Optional top-level blocks of a training config: name -> the function that
# builds the block with every field (defaults, then keyword overrides).
# "inject": fp8jax.train.injection, an experiment's injected stress.
OPTIONAL_BLOCKS = {"inject": injection.inject_block}


# Names other trainers use for a field of this schema: an unknown field that is one of
# these gets the schema's name as its suggestion (difflib finds typos, not synonyms).
FIELD_ALIASES = {
    "learning_rate": "lr",
    "peak_lr": "lr",
    "num_steps": "steps",
    "train_steps": "steps",
    "total_steps": "steps",
    "max_steps": "steps",
    "warmup": "warmup_steps",
    "lr_warmup_steps": "warmup_steps",
    "num_warmup_steps": "warmup_steps",
    "global_batch_size": "batch_size",
    "per_device_batch_size": "batch_size",
    "seq_length": "seq_len",
    "sequence_length": "seq_len",
    "max_seq_len": "seq_len",
    "beta1": "b1",
    "beta2": "b2",
    "adam_beta1": "b1",
    "adam_beta2": "b2",
    "epsilon": "eps",
    "adam_eps": "eps",
    "adam_epsilon": "eps",
    "wd": "weight_decay",
    "grad_clip": "clip_norm",
    "max_grad_norm": "clip_norm",
    "grad_clip_norm": "clip_norm",
    "save_every": "checkpoint_every",
    "checkpoint_steps": "checkpoint_every",
    "log_steps": "log_every",
    "eval_steps": "eval_every",
}


def suggest_field(name: str) -> str | None:
    """The schema field an unknown config field ``name`` most likely means, or None.

    A known synonym (``learning_rate`` -> ``lr``, :data:`FIELD_ALIASES`), in a
    block or not, else the closest name (difflib: typos).
    """
    schema = list(_fields(base_config()))
    head, _, last = name.rpartition(".")
    alias = FIELD_ALIASES.get(last)
    if alias is not None:
        for candidate in (f"{head}.{alias}" if head else alias, alias):
            if candidate in schema:
                return candidate
    close = difflib.get_close_matches(name, schema, n=1)
    return close[0] if close else None


def _check_known_fields(config: ml_collections.ConfigDict, extra: tuple[str, ...]) -> None:
    if "compare" in config and "compare" not in extra:
        raise ConfigError(
            "this is a comparison config (it has a 'compare' block): run it with "
            "python experiments/compare_recipes.py --config=FILE --workdir=DIR"
        )
    schema = _fields(base_config())
    have = _fields(config)
    for name in have:
        if name in schema or name.split(".")[0] in (*extra, *OPTIONAL_BLOCKS):
            continue
        close = suggest_field(name)
        hint = f"; did you mean --config.{close}?" if close else ""
        raise ConfigError(f"unknown config field --config.{name}{hint}")
    missing = [name for name in schema if name not in have]
    if missing:
        raise ConfigError(
            f"config has no field {missing[0]!r}: build it from "
            "fp8jax.train.defaults.base_config() (the schema; configs/*.py start from it)"
        )


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The ModelConfig preset named by ``config.model`` with ``config.model_overrides`` applied."""
    preset = getattr(ModelConfig, str(config.model), None)
    presets = ("tiny", "small", "gpu_1b")
    _require(
        callable(preset) and str(config.model) in presets,
        f"unknown model preset {config.model!r} (--config.model); known: {', '.join(presets)}",
    )
    overrides = dict(config.model_overrides)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in overrides:
        close = difflib.get_close_matches(key, sorted(names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        _require(key in names, f"model_overrides.{key} is not a ModelConfig field{hint}")
    try:
        return preset(**overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model_overrides: {e}") from None


def seq_len(config: ml_collections.ConfigDict, mcfg: ModelConfig) -> int:
    """Tokens per row: ``config.seq_len``, or the model's ``max_seq_len`` when it is <= 0."""
    return int(config.seq_len) if int(config.seq_len) > 0 else mcfg.max_seq_len


def validate(config: ml_collections.ConfigDict, *, extra: tuple[str, ...] = ()) -> Recipe:
    """The recipe ``config.recipe`` names, once every field of ``config`` is checked.

    Raises :class:`ConfigError` (one line with the fix) for any bad field.  This
    is the one place a config's recipe name is resolved (:func:`fp8jax.registry.
    get`): the loop trains the Recipe returned here.

    ``extra``: top-level blocks besides the training fields (e.g. ``"compare"``).
    Checks names (a typo gets a "did you mean"), the recipe and model preset,
    ranges (batch_size >= 1, seq_len >= 2, finite positive lr, ...) and the
    data source and path; the corpus itself is checked once it is loaded
    (:func:`fp8jax.data.corpus.check_corpus`).
    """
    _check_known_fields(config, extra)
    try:
        recipe = registry.get(str(config.recipe))
    except ValueError as e:
        raise ConfigError(f"{e} (--config.recipe)") from None
    mcfg = model_config(config)
    n = seq_len(config, mcfg)
    _require(
        n >= 2,
        f"seq_len {n} is too short: a row of n bytes gives n - 1 predictions; use "
        f"--config.seq_len >= 2 (or <= 0 for the model's max_seq_len {mcfg.max_seq_len})",
    )
    _require(
        n <= mcfg.max_seq_len,
        f"seq_len {n} exceeds the model's max_seq_len {mcfg.max_seq_len}; use "
        f"--config.seq_len <= {mcfg.max_seq_len}",
    )
    for name in ("batch_size", "microbatches", "steps", "log_every", "eval_batch_size"):
        _require(int(config[name]) >= 1, f"{name} must be >= 1, got {config[name]}")
    for name in ("keep_checkpoints", "final_window"):
        _require(int(config[name]) >= 1, f"{name} must be >= 1, got {config[name]}")
    for name in ("eval_every", "eval_batches", "checkpoint_every", "warmup_steps"):
        _require(int(config[name]) >= 0, f"{name} must be >= 0, got {config[name]}")
    _require(
        int(config.batch_size) % int(config.microbatches) == 0,
        f"batch_size {config.batch_size} is not divisible by microbatches {config.microbatches}",
    )
    if "inject" in config:
        try:
            injection.validate_block(config.inject)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _require(_finite(config.lr) and config.lr > 0, f"lr must be finite and > 0, got {config.lr}")
    _require(
        _finite(config.min_lr_ratio) and 0.0 <= config.min_lr_ratio <= 1.0,
        f"min_lr_ratio must be in [0, 1], got {config.min_lr_ratio}",
    )
    for name in ("b1", "b2"):
        _require(
            _finite(config[name]) and 0.0 <= config[name] < 1.0,
            f"{name} must be in [0, 1), got {config[name]}",
        )
    _require(_finite(config.eps) and config.eps > 0, f"eps must be > 0, got {config.eps}")
    for name in ("weight_decay", "clip_norm"):
        _require(
            _finite(config[name]) and config[name] >= 0,
            f"{name} must be finite and >= 0 (clip_norm 0 = no clipping), got {config[name]}",
        )
    _require(
        str(config.moment_dtype) in _MOMENT_DTYPES,
        f"moment_dtype must be one of {_MOMENT_DTYPES}, got {config.moment_dtype!r}",
    )
    d = config.data
    _require(
        str(d.source) in _DATA_SOURCES,
        f"unknown data source {d.source!r} (--config.data.source); use one of {_DATA_SOURCES}",
    )
    _require(
        _finite(d.val_fraction) and 0.0 < d.val_fraction < 1.0,
        f"data.val_fraction must be in (0, 1), got {d.val_fraction}",
    )
    _require(int(d.max_bytes) >= 0, f"data.max_bytes must be >= 0 (0 = all), got {d.max_bytes}")
    if str(d.source) in ("text", "tokens"):
        what = "a file or folder" if str(d.source) == "text" else "a token directory"
        _require(
            bool(str(d.path)),
            f"data source {str(d.source)!r} needs {what}: --config.data.path=PATH",
        )
    _require(
        not (str(d.source) == "tokens" and int(d.max_bytes)),
        "data.max_bytes applies to byte sources; a token directory is used whole "
        "(make a smaller one with `fp8jax data prepare`)",
    )
    # A missing token directory is reported when the data loads, with the
    # command that makes one; a config naming one still validates.
    if str(d.source) == "text":
        path = Path(str(d.path)).expanduser()
        _require(
            path.exists(),
            f"data path {str(d.path)!r} does not exist: give an existing file or folder "
            "with --config.data.path",
        )
    return recipe


def check_workdir(workdir: str | Path) -> Path:
    """The workdir as a Path; ConfigError if it exists and is not a directory."""
    p = Path(workdir).expanduser()
    _require(bool(str(workdir)), "--workdir is empty: give a directory for the run")
    _require(
        not p.exists() or p.is_dir(),
        f"workdir {str(workdir)!r} exists and is not a directory: choose another --workdir",
    )
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    _require(
        parent.is_dir(),
        f"workdir {str(workdir)!r} lies under {str(parent)!r}, which is a file: choose "
        "another --workdir",
    )
    return p
