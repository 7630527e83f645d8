"""Commands run in forks of a warm interpreter that imported their libraries once.

The migration tests run about a hundred commands of this venv's console scripts (``alembic``,
``idempotency-mw``), and the docs' tests run each page's blocks in a python of the wheel's
venv; a new interpreter spends most of each run importing Alembic, SQLAlchemy or FastAPI before
the command's own work. Here each run is a fork of a warm process, in which the command runs
as its interpreter would run it: its own working folder, environment, ``sys.argv`` and
``sys.path``, its output on its own file descriptors, its exit code.

:func:`run` and :func:`shell`: console scripts, in multiprocessing's forkserver with Alembic
and SQLAlchemy preloaded (the script's folder first on ``sys.path``, then ``PYTHONPATH``,
then the venv's). ``idempotency_mw`` itself is not preloaded: each command imports it from
wherever its ``PYTHONPATH`` says (the checkout, or an unpacked wheel).
:class:`WarmPython`: ``python -I -c program`` of another venv.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import selectors
import shlex
import shutil
import signal
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
    """Whether ``command`` (a path) is one of this venv's console scripts that run warm."""
    path = Path(command)
    return path.parent == Path(sys.executable).parent and path.name in _entry_points()


def shell(
    line: str, *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``line`` as typed into a shell (``subprocess.run(line, shell=True, ...)``): a console
    script's command runs warm, its words as the shell splits and expands them; any other
    command, or a line with the shell's operators, runs in the shell."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    found = shutil.which(words[0], path=env.get("PATH")) if words else None  # as the shell would
    if found and is_warm(found) and not any(set(word) <= _OPERATORS for word in words):
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


#: Run by another venv's ``python -I -c``: imports ``sys.argv[1:]`` once, then for each request
#: (a JSON line on stdin: program, its stdin, cwd, environment, output files) forks a child
#: that runs the program as ``python -I -c program`` would, and answers its exit code.
_SERVER = """
import io, json, os, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
for line in sys.stdin:
    request = json.loads(line)
    child = os.fork()
    if child == 0:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for descriptor, target in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(opened, descriptor)
            os.close(opened)
        sys.stdin = io.StringIO(request["stdin"])
        code = 0
        try:
            exec(compile(request["program"], "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
            if not isinstance(exit.code, int | None):
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(child, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class WarmPython:
    """Another venv's ``python``, kept warm: :meth:`run` is ``python -I -c program`` (with
    ``stdin``, in ``cwd``, with ``env``), run in a fork of one isolated interpreter of that
    venv that imported ``preloaded`` once."""

    def __init__(self, python: Path, preloaded: list[str]) -> None:
        self._server = subprocess.Popen(
            [str(python), "-I", "-c", _SERVER, *preloaded],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its children too end with it
        )

    def run(
        self, program: str, *, stdin: str, cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        assert self._server.stdin is not None
        assert self._server.stdout is not None
        with tempfile.TemporaryDirectory(prefix="warm-") as folder:
            stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {
                "program": program,
                "stdin": stdin,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(stdout),
                "stderr": str(stderr),
            }
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            with selectors.DefaultSelector() as selector:
                selector.register(self._server.stdout, selectors.EVENT_READ)
                if not selector.select(timeout):
                    self.close()
                    raise subprocess.TimeoutExpired(program, timeout)
            answer = self._server.stdout.readline()
            assert answer, f"the warm python ended: {stderr.read_text()}"
            args = ["python", "-I", "-c", program]
            return subprocess.CompletedProcess(
                args, int(answer), stdout.read_text(), stderr.read_text()
            )

    def close(self) -> None:
        """End the warm python, and a program it still runs."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._server.pid, signal.SIGKILL)
        self._server.wait()
        for pipe in (self._server.stdin, self._server.stdout):
            if pipe is not None:
                pipe.close()
