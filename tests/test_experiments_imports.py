"""Every experiment script, notebook source and config uses only names that exist in
fp8jax: its imports, and the attributes it reads from an imported fp8jax module (checked
from the source, without running it: a renamed function fails here, not an hour into a
long run)."""

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(
    [*ROOT.glob("experiments/*.py"), *ROOT.glob("notebooks/*.py"), *ROOT.glob("configs/**/*.py")]
)


def _submodule(mod: types.ModuleType, name: str) -> bool:
    return (
        hasattr(mod, "__path__") and importlib.util.find_spec(f"{mod.__name__}.{name}") is not None
    )


def _fp8jax_modules(tree: ast.AST, where: str) -> dict[str, types.ModuleType]:
    """Local name -> fp8jax module, for every fp8jax import (failing on a missing name)."""
    mods = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fp8jax"):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(mod, alias.name) and _submodule(mod, alias.name):
                    value = importlib.import_module(f"{node.module}.{alias.name}")
                else:
                    assert hasattr(mod, alias.name), f"{where}: {node.module} has no {alias.name}"
                    value = getattr(mod, alias.name)
                if isinstance(value, types.ModuleType):
                    mods[alias.asname or alias.name] = value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fp8jax"):
                    mod = importlib.import_module(alias.name)
                    if alias.asname:
                        mods[alias.asname] = mod
                    else:
                        mods["fp8jax"] = importlib.import_module("fp8jax")
    return mods


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fp8jax_names_resolve(path):
    where = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), filename=where)
    mods = _fp8jax_modules(tree, where)
    for node in ast.walk(tree):
        # mod.name (one level: what the module itself must provide).
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in mods
            and isinstance(node.ctx, ast.Load)
        ):
            mod = mods[node.value.id]
            assert hasattr(mod, node.attr) or _submodule(mod, node.attr), (
                f"{where}:{node.lineno}: {mod.__name__} has no {node.attr}"
            )


# --- experiments as configs ------------------------------------------------------------

CONFIGS = sorted((ROOT / "configs").rglob("*.py"))
# Flags an entry point may define: the config and what a config cannot hold (paths).
PATH_FLAGS = {"config", "workdir", "out_dir", "run", "jax_cache_dir"}
# Flags beyond paths, per script, that remain: the tools on one trained run's
# checkpoint (which step, which text, which prompt: per call, not an experiment)
# and the comparison's permission to run from a modified tree (a property of the
# call, not of the experiment: a config that allowed it would make every rerun a
# scratch comparison).
OTHER_FLAGS = {
    "evaluate.py": {"file", "step", "batch_size", "max_windows"},
    "sample.py": {"prompt", "length", "temperature", "top_k", "seed", "step"},
    "compare_recipes.py": {"allow_mixed_code"},
}
_COMMAND = re.compile(r"python experiments/(\w+\.py)((?:\s+(?:\\\n\s*)?--[\w.]+(?:=\S+)?)*)")


def _defined_flags(path: Path) -> list[str]:
    """Names of the absl flags a script defines (flags.DEFINE_* / config_flags.DEFINE_*)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("DEFINE_")
        ):
            names.append(node.args[0].value)
    return names


def _passes(check, config) -> bool:
    from fp8jax.train.fields import ConfigError

    try:
        check(config)
    except ConfigError:
        return False
    return True


def _accepts(script: str, config) -> bool:
    """Whether the entry point ``script`` runs ``config`` (what each one checks first: a
    study or benchmark config passes every check of its fields)."""
    from fp8jax.bench.experiments import checked_benchmark
    from fp8jax.numerics.studies import checked_runner

    has = set(config.keys())
    kinds = {
        "train.py": not has & {"compare", "benchmark", "study", "labels", "sweep"},
        # A comparison, a sweep of comparisons, or a comparison through fp8jax.interop.
        "compare_recipes.py": "compare" in has
        or "sweep" in has
        or ({"labels", "seeds", "model"} <= has),
        "bench.py": "benchmark" in has and _passes(checked_benchmark, config),
        "study.py": "study" in has and _passes(checked_runner, config),
    }
    return kinds.get(script, False)


def test_experiment_scripts_define_only_path_flags():
    total = 0
    for path in sorted(ROOT.glob("experiments/*.py")):
        names = _defined_flags(path)
        total += len(names)
        extra = set(names) - PATH_FLAGS - OTHER_FLAGS.get(path.name, set())
        assert not extra, f"{path.name} defines {sorted(extra)}: put them in its config"
    # The entry points' flags all together (105 before experiments became configs).
    assert total <= 30, total


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_config_loads_and_its_docstring_gives_a_command_that_runs_it(path):
    from fp8jax.train.defaults import config_file

    rel = str(path.relative_to(ROOT))
    config = config_file(path)
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    commands = _COMMAND.findall(doc)
    for script, _ in commands:
        assert (ROOT / "experiments" / script).is_file(), f"{rel} names experiments/{script}"
    own = [s for s, args in commands if re.search(rf"--config={re.escape(rel)}(?::\S+)?\b", args)]
    assert own, f"{rel}: its docstring has no command with --config={rel}"
    for script in own:
        assert _accepts(script, config), f"{rel}: experiments/{script} does not run this config"
    assert "print" in doc or "writes" in doc.lower(), f"{rel}: say what the command prints"


def test_every_study_resolves_to_a_run_function():
    from fp8jax.numerics.studies import STUDIES, StudyConfigError, runner

    for name in STUDIES:
        assert callable(runner(name)), name
    with pytest.raises(StudyConfigError, match="give one of"):
        runner("nope")


def _entry(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"experiments/{script}", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"},
    )


def test_study_entry_point_runs_a_config_and_writes_its_table(tmp_path):
    p = _entry(
        "study.py",
        "--config=configs/study/gemm_error.py",
        "--config.m=128",
        "--config.k=128",
        "--config.n=128",
        "--config.recipes=bf16,deepseek_v3,current_tensor",
        f"--out_dir={tmp_path}",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "per-token median y error: current_tensor / deepseek_v3" in p.stdout
    table = (tmp_path / "table.md").read_text()
    assert "| massive | deepseek_v3 |" in table


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("study.py", ["--config=configs/bench/core.py"], "config.study = None: give one of"),
        ("bench.py", ["--config=configs/study/gemm_error.py"], "config.benchmark = None"),
        ("study.py", ["--config=configs/study/block_rules.py"], "block_rules reads one trained"),
        ("bench.py", ["--config=configs/bench/sweep.py:cpu"], "give --out_dir=DIR"),
        (
            "compare_recipes.py",
            ["--config=configs/sweep/outliers.py", "--config.sweep.labels=nope", "--workdir=/x"],
            "config.sweep.labels: ['nope'] not in",
        ),
    ],
)
def test_entry_point_mistakes_print_one_line_and_exit_2(script, args, message):
    p = _entry(script, *args)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{script}: error:") and message in line, line
