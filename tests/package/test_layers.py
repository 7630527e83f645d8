"""The package's modules import one way (read from the source, lazy imports and those for type
checkers included): the entries over the engine over the stores over the values and the wire
vocabulary; the caller's half beside them, on the wire vocabulary and the values only; the
operator's module a leaf that no store (nor anything of the request's way) imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import idempotency_mw

PACKAGE = Path(idempotency_mw.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, lazily and for type checkers included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # A relative import starts from the module's package, up ``level - 1``.
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module or ""] if node.level else [node.module or ""])
            module = module.rstrip(".")
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
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


def part(name: str) -> str:
    """The part of the package a module belongs to: its folder, or the top-level module."""
    return name.split(".")[1] if "." in name else name


#: The floors, from the bottom up: a module imports nothing of a floor above its own. The
#: private helpers at the top level are values too.
FLOORS = {
    **dict.fromkeys(["values", "wire", "_backoff", "_redis_client", "_sqltypes", "_urls"], 0),
    "_version": 0,
    "stores": 1,
    "engine": 2,
    **dict.fromkeys(["http", "functions", "mcp"], 3),
}
#: What stands beside the floors and may import them: the caller's half, the operator's tools,
#: the test helpers, the migrations, the public API.
BESIDE = {"client", "operator", "testing", "alembic", "migrations", "idempotency_mw"}


def arrows(source: set[str], banned: set[str]) -> list[str]:
    """Each import of a module of the parts ``source`` of a module of the parts ``banned``."""
    return sorted(
        f"{name} -> {other}"
        for name, imported in import_graph().items()
        if part(name) in source
        for other in imported
        if part(other) in banned
    )


def test_every_part_is_on_a_floor_or_beside() -> None:
    assert {part(name) for name in import_graph()} <= FLOORS.keys() | BESIDE


def test_the_callers_half_imports_no_module_of_the_server() -> None:
    server = {"http", "functions", "mcp", "engine", "operator", "stores", "testing", "alembic"}
    assert arrows({"client"}, server | {"migrations", "idempotency_mw"}) == []


def test_the_stores_import_nothing_of_the_entries_engine_or_operators_tools() -> None:
    banned = {"http", "functions", "mcp", "engine", "operator", "client", "testing", "alembic"}
    assert arrows({"stores"}, banned | {"migrations", "idempotency_mw"}) == []


def test_the_floors_import_only_down() -> None:
    up = [
        f"{name} -> {other}"
        for name, imported in import_graph().items()
        if part(name) in FLOORS
        for other in imported
        if FLOORS.get(part(other), len(FLOORS)) > FLOORS[part(name)]
    ]
    assert up == []


def test_importing_the_callers_half_loads_no_module_of_the_server() -> None:
    # What a caller's process loads, the package's __init__ included.
    script = (
        "import sys, idempotency_mw.client, idempotency_mw.client.mcp\n"
        "print(*sorted(m for m in sys.modules if m.startswith('idempotency_mw.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "idempotency_mw.client.mcp" in loaded
    server = {"http", "functions", "mcp", "engine", "operator", "stores", "testing", "alembic"}
    assert [name for name in loaded if part(name) in server] == []
