"""This venv's console scripts (``alembic``, ``idempotency-mw``) run as commands, each in a fresh
fork of a process that imported their libraries once.

The migration tests run about a hundred such commands; a new interpreter spends most of each
one importing Alembic and SQLAlchemy before the command's own work. Here each command is a
fork of a warm process (multiprocessing's forkserver, with those libraries preloaded), in
which the console script's entry point runs as the script would run it: its own working
folder, environment, ``sys.argv`` and ``sys.path`` (the script's folder first, then
``PYTHONPATH``, then the venv's), its output on its own file descriptors, its exit code from
``sys.exit``. ``idempotency_mw`` itself is not preloaded: each command imports it from
wherever its ``PYTHONPATH`` says (the checkout, or an unpacked wheel).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

#: What every command of these scripts imports before it does anything of its own.
PRELOADED = [
    "alembic.autogenerate",
    "alembic.command",
    "alembic.config",
    "alembic.runtime.environment",
    "aiosqlite",
    "asyncmy",
    "asyncpg",
    "mako.template",
    "sqlalchemy",
    "sqlalchemy.dialects.mysql",
    "sqlalchemy.dialects.postgresql",
    "sqlalchemy.dialects.sqlite",
    "sqlalchemy.ext.asyncio",
]
_OPERATORS = set("();<>|&")
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOADED)


@cache
def _entry_points() -> dict[str, str]:
    """This venv's console scripts that the warm process can run: name -> ``module:function``."""
    wanted = {"alembic", "idempotency-mw"}
    return {
        entry.name: entry.value
        for entry in importlib.metadata.entry_points(group="console_scripts")
        if entry.name in wanted
    }


@cache
def _base_path() -> tuple[str, ...]:
    """``sys.path`` of a script of this venv, after its own folder, without ``PYTHONPATH``."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    printed = subprocess.run(
        [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(json.loads(printed.stdout))


def is_warm(command: str) -> bool:
    """Whether ``command`` (a name, or a path in this venv's bin folder) runs warm."""
    path = Path(command)
    in_this_venv = path.parent == Path(sys.executable).parent or path.parent == Path()
    return in_this_venv and path.name in _entry_points()


def shell(
    line: str, *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``line`` as typed into a shell (``subprocess.run(line, shell=True, ...)``): a console
    script's command runs warm, its words as the shell splits and expands them; any other
    command, or a line with the shell's operators, runs in the shell."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if words and is_warm(words[0]) and not any(set(word) <= _OPERATORS for word in words):
        split = subprocess.run(
            ["/bin/sh", "-c", f"printf '%s\\0' {line}"],
            cwd=cwd,
            env=env,
            capture_output=True,
            check=True,
        )
        argv = split.stdout.decode().split("\0")[:-1]
        return run(argv, cwd=cwd, env=env, timeout=timeout)
    shell = ["/bin/sh", "-c", line]
    return subprocess.run(shell, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run(
    args: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``args`` (a console script of this venv and its arguments), as ``subprocess.run`` with
    ``capture_output=True, text=True`` would run it."""
    name = Path(args[0]).name
    module, _, function = _entry_points()[name].partition(":")
    script_folder = str(Path(sys.executable).parent)
    extra = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = [script_folder, *extra, *_base_path()]
    with tempfile.TemporaryDirectory(prefix="warm-") as folder:
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        argv = [f"{script_folder}/{name}", *args[1:]]
        process = _CONTEXT.Process(
            target=_run_script,
            args=(module, function, argv, str(cwd), env, path, stdout, stderr),
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(
            args, process.exitcode, stdout.read_text(), stderr.read_text()
        )


def _run_script(
    module: str,
    function: str,
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    path: list[str],
    stdout: Path,
    stderr: Path,
) -> None:
    """In the fork: what the console script does, in the command's own setting."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = argv
    sys.path[:] = path
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    for descriptor, target in ((1, stdout), (2, stderr)):
        opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, descriptor)
        os.close(opened)
    try:
        sys.exit(getattr(importlib.import_module(module), function)())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
