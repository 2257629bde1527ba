"""Every experiment script, notebook source and config uses only names that exist in
fp8jax: its imports, and the attributes it reads from an imported fp8jax module (checked
from the source, without running it: a renamed function fails here, not an hour into a
long run)."""

import ast
import importlib
import importlib.util
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
