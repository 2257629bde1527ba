"""The training library sits below its studies and tools, read from the source (ast).

Every ``import`` and ``from ... import`` of every module of the library (formats
through train, kernels, nn, models, parallel, data, interop), at the top of a
file or inside a function, is checked: none reaches the studies and tools
(fp8jax.lab, fp8jax.bench, fp8jax.numerics, fp8jax.toolkit), and none draws a
figure.  The recipe registry lists presets and variants from above both.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8jax"
# Above the library: they may import it, never the other way round.
STUDIES_AND_TOOLS = ("lab", "bench", "numerics", "toolkit")
LIBRARY_PACKAGES = ("train", "kernels", "nn", "models", "parallel", "data", "interop")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every module name ``path`` (module ``module``) imports, relative ones made absolute."""
    tree = ast.parse(path.read_text(), str(path))
    package = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        package.pop()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            # ``from fp8jax import lab`` names a package in the alias.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _library_files() -> list[Path]:
    files = list(PACKAGE.glob("*.py"))
    for pkg in LIBRARY_PACKAGES:
        files += sorted((PACKAGE / pkg).rglob("*.py"))
    return sorted(files)


def _above(name: str) -> bool:
    return any(name == f"fp8jax.{s}" or name.startswith(f"fp8jax.{s}.") for s in STUDIES_AND_TOOLS)


def test_every_package_is_either_library_or_above_it():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(STUDIES_AND_TOOLS) | set(LIBRARY_PACKAGES)


@pytest.mark.parametrize("path", _library_files(), ids=_module_name)
def test_library_imports_no_study_or_tool(path):
    imports = _imports(path)
    assert not {n for n in imports if _above(n)}, f"{_module_name(path)} imports a study or tool"
    # Figures are what studies make: the library draws none.
    assert not {n for n in imports if n.split(".")[0] == "matplotlib"}


def test_the_check_reads_lazy_and_relative_imports(tmp_path):
    assert "fp8jax.train.defaults" in _imports(PACKAGE / "train" / "loop.py")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from fp8jax.lab.stats import verdict\n    import fp8jax.bench\n"
        "from ..numerics import metrics\nfrom . import defaults\n"
    )
    found = _imports(probe, "fp8jax.train.probe")
    assert {"fp8jax.lab.stats", "fp8jax.bench", "fp8jax.numerics.metrics"} <= found
    assert "fp8jax.train.defaults" in found
    assert [n for n in sorted(found) if _above(n)] == [
        "fp8jax.bench",
        "fp8jax.lab.stats",
        "fp8jax.lab.stats.verdict",
        "fp8jax.numerics",
        "fp8jax.numerics.metrics",
    ]
    assert not _above("fp8jax.labels") and not _above("fp8jax.train.stress")


def test_studies_stand_on_the_library():
    # The comparisons train with the library's loop and read its logs.
    compare = _imports(PACKAGE / "lab" / "compare.py")
    assert "fp8jax.train.loop" in compare and "fp8jax.lab.stats" in compare
    # One statistics module serves every comparison.
    for study in ("compare", "compare_sweep", "qwix_comparison"):
        assert "fp8jax.lab.stats" in _imports(PACKAGE / "lab" / f"{study}.py"), study


def test_recipe_registry_lists_presets_and_variants_without_a_circle():
    assert not {n for n in _imports(PACKAGE / "recipes.py") if n.startswith("fp8jax.variants")}
    assert not {n for n in _imports(PACKAGE / "recipes.py") if n.startswith("fp8jax.registry")}
    assert not {n for n in _imports(PACKAGE / "variants.py") if n.startswith("fp8jax.registry")}
    registry = _imports(PACKAGE / "registry.py")
    assert {"fp8jax.recipes", "fp8jax.variants"} <= registry
