"""The package's modules import one way: the stores' values live with the records, and the
operator's module is a leaf that no store (nor anything of the request's way) imports."""

from __future__ import annotations

import ast
from pathlib import Path

import idempotency_mw

PACKAGE = Path(idempotency_mw.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, lazily and for type checkers included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {
        name: {
            other
            for other in imports_of(path, modules)
            # Importing a module imports its packages first: not an edge of the graph.
            if other != name and not name.startswith(other + ".")
        }
        for name, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_but_the_operators_tools_imports_the_operators_module() -> None:
    importers = {
        name
        for name, imported in import_graph().items()
        if "idempotency_mw.operator.admin" in imported
    }
    assert all(name.startswith("idempotency_mw.operator.") for name in importers), importers


def test_the_records_depend_on_nothing_of_the_package_but_its_exceptions() -> None:
    assert import_graph()["idempotency_mw.values.records"] <= {"idempotency_mw.values.exceptions"}


def store_package(name: str) -> str:
    """The store package a module belongs to (``idempotency_mw.stores.sql``), or itself."""
    parts = name.split(".")
    return ".".join(parts[:3]) if parts[1:2] == ["stores"] and len(parts) > 3 else name


def test_no_import_circle_but_inside_one_store_package() -> None:
    # A store's own modules (the store, its scripts, its inspection) may refer to each other.
    across = [c for c in cycles(import_graph()) if len({store_package(n) for n in c}) > 1]
    assert across == []
