"""No module of the package spins the event loop, drives a coroutine by hand, or reads a
private attribute of FastAPI's or Starlette's objects (read from the source, as a linter
would)."""

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


def reads_framework_privates(tree: ast.AST) -> Iterator[str]:
    """In a module that imports FastAPI or Starlette: an underscored attribute of anything but
    its own object (``self``, ``cls``), or one named in a ``getattr``/``setattr``/``hasattr``."""
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
    if not imported & {"fastapi", "starlette"}:
        return
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and private(node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            yield f"line {node.lineno}: {ast.unparse(node)}"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            yield f"line {node.lineno}: {ast.unparse(node)}"


CHECKS = [spins, drives_coroutines, reads_framework_privates]


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
    reads_framework_privates: [
        "from fastapi import FastAPI\ndef f(r):\n    return r._effective_routes\n",
        "import starlette\ndef f(r):\n    return getattr(r, '_lock', None)\n",
    ],
}


@pytest.mark.parametrize(
    ("check", "source"),
    [(check, source) for check, sources in SAMPLES.items() for source in sources],
)
def test_each_check_finds_what_it_looks_for(check: object, source: str) -> None:
    assert callable(check)
    assert list(check(ast.parse(source)))
