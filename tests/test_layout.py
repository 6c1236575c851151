"""The package's import graph follows its layers: the algorithm packages (dispatch/, vocab/, recompute/,
optimizer/, tiling/) and the runtime helpers they share (runtime/) never import the planner (planner/, which imports
the algorithms for their size rules), and the algorithms never import Megatron (integration/ does). Checked
on the source with ast, every import statement at any depth (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megatron_peakflat"
ALGORITHMS = ("dispatch", "vocab", "recompute", "optimizer", "tiling")


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Absolute names of every module ``source`` (the text of ``module``) imports, relative imports resolved.
    ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def package_imports(package: str) -> dict[str, set[str]]:
    """``{module: imported module names}`` for every module under ``megatron_peakflat/<package>/``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        is_package = path.name == "__init__.py"
        if is_package:
            name = name.rpartition(".")[0]
        out[name] = imported_modules(path.read_text(), name, is_package)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_resolver_sees_relative_absolute_and_lazy_imports():
    src = ("from ..planner.model import plan\n"
           "from .. import planner\n"
           "import megatron.core\n"
           "def f():\n    from ...x import y\n")
    got = imported_modules(src, "megatron_peakflat.dispatch.api")
    assert "megatron_peakflat.planner.model" in got
    assert "megatron_peakflat.planner" in got
    assert "megatron.core" in got
    assert "x.y" not in got and "megatron_peakflat.x.y" not in got
    assert "megatron_peakflat.x" not in got  # level 3 from dispatch.api is above the package
    assert imported_modules("from . import meter\n", "megatron_peakflat.runtime", is_package=True) == {
        "megatron_peakflat.runtime", "megatron_peakflat.runtime.meter"}


@pytest.mark.parametrize("package", [*ALGORITHMS, "runtime"])
def test_algorithms_and_runtime_do_not_import_the_planner(package):
    graph = package_imports(package)
    assert graph, f"no modules found under {package}/"
    bad = {m: sorted(i for i in imps if _under(i, "megatron_peakflat.planner") or _under(i, "megatron_peakflat.memory")
                     or i == "megatron_peakflat.plan")
           for m, imps in graph.items()}
    assert not any(bad.values()), {m: b for m, b in bad.items() if b}


@pytest.mark.parametrize("package", [*ALGORITHMS, "runtime"])
def test_algorithms_and_runtime_do_not_import_megatron(package):
    graph = package_imports(package)
    bad = {m: sorted(i for i in imps if _under(i, "megatron") or _under(i, "megatron_peakflat.integration"))
           for m, imps in graph.items()}
    assert not any(bad.values()), {m: b for m, b in bad.items() if b}


def test_the_algorithms_reach_the_runtime_helpers():
    """The rule above is not vacuous: the components do import the runtime helpers, resolved to ``runtime``."""
    imports = set().union(*(set().union(*package_imports(p).values()) for p in ALGORITHMS))
    assert "megatron_peakflat.runtime.meter" in imports
    assert "megatron_peakflat.runtime.host" in imports
    assert not (ROOT / "memory").exists()
