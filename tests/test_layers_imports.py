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


def _import_statements(path: Path, module: str | None = None) -> list[tuple[str, str | None]]:
    """(module, name) of every import in ``path``: name None for ``import module``."""
    tree = ast.parse(path.read_text(), str(path))
    package = (module or _module_name(path)).split(".")
    if path.name != "__init__.py":
        package.pop()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found += [(base, alias.name) for alias in node.names]
    return found


def _imports(path: Path, module: str | None = None) -> set[str]:
    """Every module name ``path`` (module ``module``) imports, relative ones made absolute."""
    names = set()
    for base, name in _import_statements(path, module):
        names.add(base)
        if name is not None:
            # ``from fp8jax import lab`` names a package in the alias.
            names.add(f"{base}.{name}")
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


def _library_graph() -> dict[str, set[str]]:
    """Library module -> the library modules it imports (type-checking imports included).

    ``from fp8jax.kernels import availability`` is an edge to the submodule, not
    to the package's ``__init__``; ``from fp8jax.quant import QTensor`` one to
    fp8jax.quant.
    """
    files = {_module_name(p): p for p in _library_files()}
    graph = {}
    for module, path in files.items():
        edges = set()
        for base, name in _import_statements(path):
            target = f"{base}.{name}" if f"{base}.{name}" in files else base
            if target in files and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_circle_finder_finds_circles():
    assert _a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = _library_graph()
    assert "fp8jax.formats" in graph["fp8jax.quant"]
    assert "fp8jax.kernels.availability" in graph["fp8jax.gemm"]


def test_library_modules_import_no_circle():
    assert _a_circle(_library_graph()) is None
