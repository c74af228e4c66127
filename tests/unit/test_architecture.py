"""No import cycles between epp's packages.

Each first-level package (``epp.state``, ``epp.sources``, ...) and each top-level module
(``epp.config``, ``epp.router``, ...) is one unit. An import anywhere in a unit's files (module
level, inside a function, or under ``TYPE_CHECKING``: all are design dependencies) is an edge.
A cycle means neither side can be understood, tested or replaced without the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

EPP = Path(__file__).resolve().parents[2] / "epp"
# Generated gRPC code: it imports only itself and protobuf.
IGNORED = {"_proto"}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path) -> Iterator[str]:
    """Every absolute module name ``path`` imports (``from a import b`` yields a and a.b)."""
    module = _module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def package_graph(root: Path) -> dict[str, set[str]]:
    """Unit -> the other units it imports, for the package at ``root``."""
    units = {
        p.stem if p.is_file() else p.name
        for p in root.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    } - IGNORED

    def unit(module: str) -> str | None:
        parts = module.split(".")
        if len(parts) < 2 or parts[0] != root.name or parts[1] not in units:
            return None
        return f"{root.name}.{parts[1]}"

    graph: dict[str, set[str]] = {f"{root.name}.{u}": set() for u in units}
    for path in root.rglob("*.py"):
        source = unit(_module_name(root, path))
        if source is None:
            continue
        for imported in _imports(root, path):
            target = unit(imported)
            if target is not None and target != source:
                graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_epp_packages_import_each_other_without_cycles() -> None:
    graph = package_graph(EPP)
    # The walk must see the packages whose layering matters, or it proves nothing.
    assert {"epp.state", "epp.sources", "epp.prefix", "epp.extproc", "epp.scheduling"} <= set(graph)
    assert "epp.state" in graph["epp.sources"]
    assert cycles(graph) == []


def test_a_cycle_through_relative_and_lazy_imports_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    for package in ("low", "high"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "high" / "use.py").write_text("from ..low import base\n")
    (root / "low" / "base.py").write_text("def f() -> None:\n    from pkg.high import use\n")
    (root / "top.py").write_text("import pkg.low\n")
    graph = package_graph(root)
    assert graph == {"pkg.high": {"pkg.low"}, "pkg.low": {"pkg.high"}, "pkg.top": {"pkg.low"}}
    assert cycles(graph) == [["pkg.high", "pkg.low"]]
