"""The package's import graph: no import circles, and the layering rules of docs/architecture.md.

The graph is read from the source (every ``import`` and ``from ... import`` of a kvtier module, those inside
functions and ``TYPE_CHECKING`` blocks too), module to module: ``from kvtier.a import b`` is an edge to
``kvtier.a.b`` when that is a module, else to ``kvtier.a``. A package's ``__init__`` that Python runs before
any of its modules is not an edge of its own (every module would then import ``kvtier/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (importer prefix, imported prefix): modules under the first may not import modules under the second
FORBIDDEN = [
    ("kvtier.tiers", "kvtier.table"),  # storage verbs only: the mover edits the table
    ("kvtier.tiers", "kvtier.kernels"),  # ... and launches the page-copy kernel
    ("kvtier.tiers", "kvtier.mover"),
    ("kvtier.policies", "kvtier.engine"),  # policies read statistics from kvtier.stats, not the engine's
    ("kvtier.scopes", "kvtier.engine"),  # ... and so do scopes and kernels
    ("kvtier.kernels", "kvtier.engine"),
    ("kvtier.mover", "kvtier.engine"),  # the mover is handed the table and the ledger
    ("kvtier.serve", "kvtier.table"),  # serving reads pages through Engine.pages (engine/pages.py)
    ("kvtier.stats", "kvtier"),  # the statistics import no kvtier module: every layer may import them
]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module under ``kvtier/`` (a package by its ``__init__.py``)."""
    out = {}
    for path in (root / "kvtier").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the kvtier modules it imports (itself left out)."""
    graph = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".") \
                    if node.level else node.module or ""
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(modules())


def test_the_cycle_finder_finds_a_planted_circle_and_nothing_else():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(g) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "kvtier"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import one\n")
    (pkg / "sub" / "one.py").write_text("def f():\n    from kvtier.sub.two import g\n")
    (pkg / "sub" / "two.py").write_text("from .one import f\nimport kvtier.three\n")
    (pkg / "three.py").write_text("")
    g = import_graph(modules(tmp_path))
    assert g == {"kvtier": set(), "kvtier.sub": {"kvtier.sub.one"}, "kvtier.sub.one": {"kvtier.sub.two"},
                 "kvtier.sub.two": {"kvtier.sub.one", "kvtier.three"}, "kvtier.three": set()}
    assert find_cycles(g) == [["kvtier.sub.one", "kvtier.sub.two"]]


def test_no_import_circles(graph):
    assert find_cycles(graph) == []


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_layering(graph, importer, imported):
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if under(m, importer)
                 for d in deps if under(d, imported) and not under(d, importer))
    assert not bad, f"{importer} may not import {imported}: {bad}"


def test_serving_reads_no_block_table():
    """serve/ reaches the engine's pages through Engine.pages, never an ``engine.table`` attribute."""
    reads = [f"{path.name}:{node.lineno}" for path in sorted((ROOT / "kvtier" / "serve").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "table"]
    assert not reads, reads
