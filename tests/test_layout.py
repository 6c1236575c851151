"""The package's import graph follows its layers: the algorithm packages (dispatch/, vocab/, sco/,
optimizer/, tile/) and the runtime helpers they share (runtime/) never import the planner (planner/, which imports
the algorithms for their size rules), and the algorithms never import Megatron (integration/ does). Checked
on the source with ast, every import statement at any depth (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_peakflat.components import COMPONENTS

ROOT = Path(__file__).resolve().parents[1] / "megatron_peakflat"
ALGORITHMS = tuple(dict.fromkeys(c.package for c in COMPONENTS))
"""Each component's algorithm package (``components.COMPONENTS``): dispatch, vocab, sco, optimizer, tile."""


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
    where = ROOT / package
    for path in sorted(where.rglob("*.py") if where.is_dir() else [where.with_suffix(".py")]):
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


SHIMS = ("check", "demo", "plan", "pretrain")
"""The short spellings of the command lines (``python -m megatron_peakflat.<name>``): each runs ``cli/<name>.py``."""
ENTRY_POINTS = ("cli", *SHIMS, "auto", "startup")
"""The modules that run the package (the command lines in cli/ and their short spellings, start-up and its
``--peakflat auto``): nothing below them imports them."""
PURE = ("config", "config_base", "components")
"""The config modules: importable without Megatron, the planner or integration/ (whose compat they do not ask)."""


def all_imports() -> dict[str, set[str]]:
    """``{module: the package's modules it imports}`` for the whole package (a package counts as its __init__)."""
    graph = package_imports(".")
    return {m: {i for i in imps if i in graph and i != m} for m, imps in graph.items()}


def test_the_package_import_graph_has_no_cycle():
    graph = all_imports()
    assert "megatron_peakflat.config" in graph and "megatron_peakflat.integration.registry" in graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path[path.index(n):] + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_graph_holds_lazy_and_type_checking_imports():
    """The cycle check is not vacuous: it sees the imports made inside functions and under TYPE_CHECKING (the
    registry -> state -> config path, which config -> registry closed into a cycle before compat.py)."""
    graph = all_imports()
    assert "megatron_peakflat.integration.peaks" in graph["megatron_peakflat.startup"]  # inside _apply
    assert "megatron_peakflat.integration.state" in graph["megatron_peakflat.integration.registry"]
    assert "megatron_peakflat.config" in graph["megatron_peakflat.integration.state"]  # under TYPE_CHECKING


@pytest.mark.parametrize("package", [*PURE, *ALGORITHMS, "runtime"])
def test_config_runtime_and_algorithms_import_no_integration_planner_or_entry_point(package):
    graph = {m: i for m, i in all_imports().items()
             if _under(m, f"megatron_peakflat.{package}")}
    assert graph, package
    banned = ["megatron_peakflat.integration", "megatron_peakflat.planner",
              *(f"megatron_peakflat.{e}" for e in ENTRY_POINTS)]
    bad = {m: sorted(i for i in imps if any(_under(i, b) for b in banned)) for m, imps in graph.items()}
    assert not any(bad.values()), {m: b for m, b in bad.items() if b}


def test_the_command_lines_are_the_top_layer():
    """Nothing imports cli/ or a short spelling but cli/ itself, the short spellings (each its own command line and
    nothing else of the package) and testing/, which drives the pretrain entry in tests. The libraries the command
    lines use (the planner's build and report, start-up, auto) import no command line."""
    graph = all_imports()
    top = ["megatron_peakflat.cli", *(f"megatron_peakflat.{s}" for s in SHIMS)]
    assert "megatron_peakflat.cli.plan" in graph and "megatron_peakflat.planner.build" in graph
    allowed = ("megatron_peakflat.cli", "megatron_peakflat.testing", *top)
    bad = {m: sorted(i for i in imps if any(_under(i, t) for t in top))
           for m, imps in graph.items() if not any(_under(m, a) for a in allowed)}
    assert not any(bad.values()), {m: b for m, b in bad.items() if b}
    for name in SHIMS:
        assert graph[f"megatron_peakflat.{name}"] == {f"megatron_peakflat.cli.{name}"}, name
    assert graph["megatron_peakflat.auto"] & {"megatron_peakflat.planner.build"}  # the rule above is not vacuous
    assert not (ROOT / "planner" / "cli.py").exists() and not (ROOT / "planner" / "plan.py").exists()
