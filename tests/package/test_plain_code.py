"""No module of the package spins the event loop, drives a coroutine by hand, reads or writes
a private attribute of FastAPI's or Starlette's objects, or rewrites what FastAPI calls as an
endpoint (read from the source, as a linter would)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import idempotency_mw

PACKAGE = Path(idempotency_mw.__file__).parent
#: The underscored names of ``collections.namedtuple``'s public API.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def is_zero_sleep(node: ast.AST) -> bool:
    """``await something.sleep(0)`` or ``await checkpoint()``: a turn of the loop, no wait."""
    if not (isinstance(node, ast.Await) and isinstance(node.value, ast.Call)):
        return False
    call = node.value
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    zero = [a for a in call.args if isinstance(a, ast.Constant) and a.value in (0, 0.0)]
    return (name == "sleep" and bool(zero)) or name in ("checkpoint", "cancel_shielded_checkpoint")


def spins(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.While | ast.For | ast.AsyncFor):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Await) and is_zero_sleep(inner):
                    yield f"line {inner.lineno}: a loop around a zero sleep"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if (
                    isinstance(inner, ast.Call)
                    and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr in ("call_soon", "call_soon_threadsafe")
                    and inner.args
                    and ast.unparse(inner.args[0]) in ("self", node.name, f"self.{node.name}")
                ):
                    yield f"line {inner.lineno}: a callback that schedules itself again"


def drives_coroutines(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, args = node.func.attr, node.args
            if method == "__await__":
                yield f"line {node.lineno}: __await__() called"
            elif method == "throw":
                yield f"line {node.lineno}: .throw() into a coroutine or generator"
            elif method == "send" and len(args) == 1 and ast.unparse(args[0]) == "None":
                yield f"line {node.lineno}: .send(None) starts a coroutine by hand"
        if isinstance(node, ast.Attribute) and node.attr in ("cr_await", "cr_frame", "gi_frame"):
            yield f"line {node.lineno}: a coroutine's frame read"


def imports_a_framework(tree: ast.AST) -> bool:
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    return bool(imported & {"fastapi", "starlette"})


def own_private_names() -> frozenset[str]:
    """The underscored names the package defines itself (methods, attributes set on ``self``,
    class attributes): its own objects', which its modules may share."""
    names: set[str] = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return frozenset(name for name in names if private(name))


OWN_PRIVATE_NAMES = own_private_names()


#: The calls that name an attribute to read or write, and where the name is among their
#: arguments (``setattr(x, name, v)``, ``object.__setattr__(x, name, v)``, ``attrgetter(name)``).
BY_NAME = {"getattr": 1, "hasattr": 1, "setattr": 1, "delattr": 1, "attrgetter": 0}
BY_NAME |= {"__getattribute__": 1, "__setattr__": 1, "__delattr__": 1}
WRITES_BY_NAME = {"setattr", "__setattr__"}


def named_attributes(node: ast.AST) -> Iterator[tuple[str, str]]:
    """The attribute names ``node`` reaches by name rather than by dot, each with how: a call
    of :data:`BY_NAME` given a constant name, or ``vars(x)[name]``, ``x.__dict__[name]``."""
    if isinstance(node, ast.Call):
        func = node.func
        how = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        at = BY_NAME.get(how)
        if at is not None and len(node.args) > at:
            given = node.args[at]
            if isinstance(given, ast.Constant) and isinstance(given.value, str):
                yield how, given.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        mapping = node.value
        through_dict = isinstance(mapping, ast.Attribute) and mapping.attr == "__dict__"
        through_vars = isinstance(mapping, ast.Call) and getattr(mapping.func, "id", "") == "vars"
        if (through_dict or through_vars) and isinstance(node.slice.value, str):
            yield "__dict__", node.slice.value


def not_its_own(value: ast.expr) -> bool:
    return not (isinstance(value, ast.Name) and value.id in ("self", "cls"))


def touches_framework_privates(tree: ast.AST) -> Iterator[str]:
    """A read or write of an underscored attribute of anything but the module's own object
    (``self``, ``cls``), by dot or by name. In a module that imports FastAPI or Starlette, any
    such name; elsewhere (objects reached by duck typing), one the package does not define
    itself."""
    strict = imports_a_framework(tree)

    def foreign(name: str) -> bool:
        return private(name) and (strict or name not in OWN_PRIVATE_NAMES)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and foreign(node.attr) and not_its_own(node.value):
            yield f"line {node.lineno}: {ast.unparse(node)}"
        if any(foreign(name) for _, name in named_attributes(node)):
            yield f"line {getattr(node, 'lineno', 0)}: {ast.unparse(node)}"


def rewrites_a_dependants_call(tree: ast.AST) -> Iterator[str]:
    """An assignment to the ``call`` of another object (``route.dependant.call = ...``: FastAPI
    calls it as the endpoint), by dot or by name."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        by_dot = any(
            isinstance(t, ast.Attribute) and t.attr == "call" and not_its_own(t.value)
            for t in targets
        )
        by_name = any(
            how in WRITES_BY_NAME and name == "call" for how, name in named_attributes(node)
        )
        if by_dot or by_name:
            yield f"line {getattr(node, 'lineno', 0)}: {ast.unparse(node)}"


CHECKS = [spins, drives_coroutines, touches_framework_privates, rewrites_a_dependants_call]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_no_module_of_the_package(check: object) -> None:
    assert callable(check)
    found = [
        f"{path.relative_to(PACKAGE)} {finding}"
        for path in modules()
        for finding in check(ast.parse(path.read_text()))
    ]
    assert found == []


SAMPLES = {
    spins: [
        "async def f():\n    while not done:\n        await asyncio.sleep(0)\n",
        "class K:\n    def __call__(self):\n        loop.call_soon(self)\n",
    ],
    drives_coroutines: [
        "def f(c):\n    steps = c.__await__()\n    steps.send(None)\n",
        "def f(steps, e):\n    steps.throw(e)\n",
    ],
    touches_framework_privates: [
        "from fastapi import FastAPI\ndef f(r):\n    return r._effective_routes\n",
        "import starlette\ndef f(r):\n    return getattr(r, '_lock', None)\n",
        "from starlette.routing import Mount\ndef f(m, app):\n    m._base_app = app\n",
        "def f(router):\n    return router._low_priority_routes\n",
        "def f(route, app):\n    object.__setattr__(route, '_route_context', app)\n",
        "def f(route):\n    return vars(route)['_embed_body_fields']\n",
        "def f(route):\n    return route.__dict__['_embed_body_fields']\n",
    ],
    rewrites_a_dependants_call: [
        "def f(route, door):\n    route.dependant.call = door(route.dependant.call)\n",
        "def f(dependant, door):\n    setattr(dependant, 'call', door)\n",
    ],
}


@pytest.mark.parametrize(
    ("check", "source"),
    [(check, source) for check, sources in SAMPLES.items() for source in sources],
)
def test_each_check_finds_what_it_looks_for(check: object, source: str) -> None:
    assert callable(check)
    assert list(check(ast.parse(source)))
