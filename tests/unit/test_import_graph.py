"""No two modules of hf_zero import each other, directly or through others.

Imports flow one way (DESIGN.md: cli -> integration -> engine -> offload, precision, optim ->
config, distributed). The graph is read from the source with ``ast``: module-level imports,
imports inside functions (a lazy import is still a dependency) and ``if TYPE_CHECKING:`` imports
(a type checker follows them). ``from a.b import c`` is an edge to ``a.b.c`` when that is a
module, else to ``a.b``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_zero"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of the first such import}}`` over the package at ``root``."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in files and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # a shortest way from the group's first module back to itself
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in {w for v in frontier for w in graph[v]}:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in group and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        found.append(paths[last] + [start])
    return found


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return " ; ".join(steps)


def test_no_two_modules_import_each_other():
    graph = import_graph(PACKAGE)
    found = cycles(graph)
    assert not found, "import cycles (make the dependency flow one way: move what both need into a module " \
                      "that imports neither):\n" + "\n".join(_describe(c, graph) for c in found)


def test_the_scan_finds_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")  # function-level, to a submodule
    (pkg / "sub" / "b.py").write_text("from . import c\n")  # relative
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import f\nimport os\n")  # into the cycle, not part of it
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b": 2} and graph["pkg.sub.b"] == {"pkg.sub.c": 1}
    assert graph["pkg.d"] == {"pkg.a": 1}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
    assert _describe(cycles(graph)[0], graph).startswith("pkg.a (line 2) -> pkg.sub.b")
    (pkg / "sub" / "c.py").write_text("import os\n")
    assert cycles(import_graph(pkg)) == []
