"""Every ```python block of the README and the docs runs as written, from an installed wheel.

The package is built into a wheel once per session and installed, with the extras the blocks
use, into a fresh virtual environment; the checkout is never on its path. Each page's blocks
then run in order in one process there (a block may build on the blocks before it on its page),
in an empty folder, so a block that imports ``example_app`` or forgets to make its table fails.
They run as they would copied into a file: a top-level ``await`` is a syntax error. A block
marked ``not run (why)`` is left out, and so is one marked ``file PATH`` (a file another block
or test runs, such as an Alembic env.py or an MCP server over stdio), which is written to PATH
in the page's folder first. A block marked ``run PATH`` is written there too and run in its
turn as ``python PATH``, in a process of its own: it sees only what it imports, as the file
the page names it. The site builds strictly.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import MARIADB_URL, POSTGRESQL_URL, REDIS_URL
from tests.support.faults import free_port
from tests.support.readme import README, ROOT, Block, blocks, commands, marked, pages
from tests.support.warm import WarmPython

#: The extras the blocks need, and the framework and server the package leaves to its user.
EXTRAS = "postgresql,mysql,redis,client,prometheus,otel,mcp,example,panel"
#: What pages use beside the package: the SDKs whose calls they show a key for, and the
#: webhook senders' libraries that verify their signatures.
PAGE_PACKAGES = ("openai", "anthropic", "standardwebhooks", "stripe")
#: What most pages import, imported once by the python the pages run in.
PRELOADED = ["idempotency_mw", "fastapi", "httpx", "sqlalchemy.ext.asyncio"]
RUFF = Path(sys.executable).parent / "ruff"
MKDOCS = Path(sys.executable).parent / "mkdocs"

#: Runs the page's blocks (JSON on stdin) in one namespace; the first that fails ends it.
RUNNER = """
import json, subprocess, sys, traceback
namespace = {"__name__": "__docs__"}
for block in json.load(sys.stdin):
    try:
        if "run" in block:
            subprocess.run([sys.executable, block["run"]], check=True, timeout=240)
        else:
            exec(compile(block["text"], block["where"], "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"the block at {block['where']} failed")
"""


def _skipped(block: Block) -> bool:
    return block.marker is not None and block.marker.startswith(("not run", "file "))


def _file_path(block: Block) -> str | None:
    """Where a block marked ``file PATH (why)`` or ``run PATH (why)`` goes, relative to the
    page's folder."""
    if block.marker is None or not block.marker.startswith(("file ", "run ")):
        return None
    return block.marker.split()[1]


def _run_path(block: Block) -> str | None:
    """The file a block marked ``run PATH (why)`` is run as."""
    return _file_path(block) if block.marker and block.marker.startswith("run ") else None


def _where(page: Path, block: Block) -> str:
    return f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name}:{block.line}"


#: The pages whose blocks run (the README's run twice in its own test).
PAGES = [
    page for page in pages() if page != README and any(b.language == "python" for b in blocks(page))
]
PYTHON_BLOCKS = [
    (page, block) for page in PAGES for block in blocks(page) if block.language == "python"
]


def _run(
    args: list[str],
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; its output as text (the caller checks its exit code)."""
    return subprocess.run(
        args,
        input=stdin,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _environment(**extra: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH (which would put the checkout first)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **extra}


#: The README's check that its install lines alone give the package and the framework.
README_CHECK = (
    "import fastapi, uvicorn, sqlalchemy; from idempotency_mw import SQLStore; print(SQLStore)"
)


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The python of a fresh venv holding the package from a wheel built of this checkout:
    made once per run by the README's own wheel lines, then given the extras the pages use;
    the workers of ``pytest -n`` share it (the first makes it while the others wait)."""
    run_folder = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        run_folder = run_folder.parent  # the folder the workers of this run share
    where = run_folder / "wheel"
    with (run_folder / "wheel.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = where / "venv" / "bin" / "python"
        if not (where / "installed").exists():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            _install_the_wheel(where)
            (where / "installed").touch()
    return python


def _install_the_wheel(where: Path) -> None:
    """In ``where``: a fresh venv, the README's wheel lines typed into it one after the other
    (the checkout's path for /path/to/idempotency-mw) and its check that they are enough, each
    outcome kept in readme-install.json for the README's test; then the pages' extras."""
    venv.create(where / "venv", with_pip=True)
    bin_dir = where / "venv" / "bin"
    env = _environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lines = commands(marked("commands install"))
    outcomes: list[dict[str, object]] = []
    for line in (line for line in lines if " -e " not in line):  # the editable line is CI's
        command = line.split("  #")[0].replace("/path/to/idempotency-mw", str(ROOT))
        result = _run(["bash", "-c", command], cwd=where, env=env, timeout=600)
        outcomes.append(
            {"command": command, "code": result.returncode, "output": result.stdout + result.stderr}
        )
        if result.returncode != 0:
            break
    else:
        result = _run([str(bin_dir / "python"), "-I", "-c", README_CHECK], cwd=where, env=env)
        outcomes.append(
            {
                "command": README_CHECK,
                "code": result.returncode,
                "output": result.stdout + result.stderr,
            }
        )
    (where / "readme-install.json").write_text(json.dumps(outcomes))
    failed = [outcome for outcome in outcomes if outcome["code"] != 0]
    assert not failed, f"the README's install lines failed here: {failed}"
    (wheel,) = (where / "dist").glob("idempotency_mw-*.whl")
    pip = [
        str(bin_dir / "python"),
        "-m",
        "pip",
        "install",
        "--quiet",
        f"{wheel}[{EXTRAS}]",
        *PAGE_PACKAGES,
    ]
    installing = _run(pip, env=_environment(), timeout=600)
    assert installing.returncode == 0, installing.stdout + installing.stderr


@pytest.fixture(scope="session")
def page_python(installed: Path) -> Iterator[WarmPython]:
    """The venv's python, warm, with what most pages import already imported."""
    python = WarmPython(installed, PRELOADED)
    yield python
    python.close()


def run_page(python: WarmPython, page: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """Write a page's file blocks into ``folder``, then run its blocks in order there with the
    venv's python (isolated: no PYTHONPATH, no cwd)."""
    for block in blocks(page):
        path = _file_path(block)
        if path is not None:
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(block.text)
    runnable: list[dict[str, str]] = []
    for block in blocks(page):
        where, path = _where(page, block), _run_path(block)
        if path is not None:
            runnable.append({"where": where, "run": path})
        elif block.language == "python" and not _skipped(block):
            runnable.append({"where": where, "text": block.text})
    # Blocks that need a server read these: the run's own databases, never a shared one.
    env = _environment(POSTGRESQL_URL=POSTGRESQL_URL, MARIADB_URL=MARIADB_URL, REDIS_URL=REDIS_URL)
    return python.run(RUNNER, stdin=json.dumps(runnable), cwd=folder, env=env, timeout=300)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_the_python_blocks_of_a_page_run_from_the_wheel(
    page_python: WarmPython, page: Path, tmp_path: Path
) -> None:
    result = run_page(page_python, page, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_runs_twice_in_the_same_folder(page_python: WarmPython, tmp_path: Path) -> None:
    """A newcomer runs its examples, then runs them again: what the first run left (a
    database, a journal) must not break the second."""
    for run in ("first", "second"):
        result = run_page(page_python, README, tmp_path)
        assert result.returncode == 0, f"the {run} run\n{result.stdout}{result.stderr}"
        # Nothing logs at INFO unless the reader's own logging says so (the mcp SDK would).
        assert "INFO" not in result.stderr, result.stderr


def test_the_package_comes_from_the_wheel_not_the_checkout(
    installed: Path, page_python: WarmPython, tmp_path: Path
) -> None:
    """A block that imports the checkout's example_app fails; the package is the venv's."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport idempotency_mw\n\nprint(idempotency_mw.__file__)\n```\n\n"
        "```python\nimport example_app\n```\n"
    )
    result = run_page(page_python, page, tmp_path)
    assert result.returncode != 0
    assert "ModuleNotFoundError: No module named 'example_app'" in result.stderr
    assert "page.md:8 failed" in result.stderr
    assert str(installed.parent.parent) in result.stdout
    assert str(ROOT) not in result.stdout


def _wait_for(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while server.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"uvicorn did not listen on {port} (exit code {server.poll()})")


def test_the_readme_quick_start_runs_as_written(installed: Path, tmp_path: Path) -> None:
    """app.py and the commands of the README's quick start, typed one after the other: the
    second request is the first one's replay. Only the port differs (8000 may be taken)."""
    (tmp_path / "app.py").write_text(marked("quick start app.py").text)
    script = marked("commands quick start").text.replace("\\\n", " ")
    lines = [line.strip() for line in script.splitlines() if line.strip()]
    port = free_port()
    env = _environment(PATH=f"{installed.parent}{os.pathsep}{os.environ['PATH']}")
    server: subprocess.Popen[bytes] | None = None
    answers: list[str] = []
    try:
        for line in lines:
            if line == "uvicorn app:app &":
                server = subprocess.Popen(
                    [str(installed.parent / "uvicorn"), "app:app", "--port", str(port)],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                _wait_for(port, server)
                continue
            command = shlex.split(line.replace("localhost:8000", f"127.0.0.1:{port}"))
            result = _run(command, cwd=tmp_path, env=env, timeout=120)
            assert result.returncode == 0, f"{line}\n{result.stdout}{result.stderr}"
            answers.append(result.stdout)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    first, again = answers[-2:]
    assert first.startswith("HTTP/1.1 201")
    assert "idempotent-replayed: true" not in first.lower()
    assert again.startswith("HTTP/1.1 201")
    assert "idempotent-replayed: true" in again.lower()
    assert first.split("\n\n")[1] == again.split("\n\n")[1]  # the same body


def test_the_readme_install_from_a_wheel_works_as_written(installed: Path) -> None:
    """The README's wheel lines, typed into a fresh venv (the one the pages run in, before
    their extras came), each succeeded, and then the package and the framework imported."""
    outcomes = json.loads((installed.parents[2] / "readme-install.json").read_text())
    assert [outcome["command"] for outcome in outcomes][-1] == README_CHECK, outcomes
    assert len(outcomes) == 4, outcomes  # three wheel lines and the check
    for outcome in outcomes:
        assert outcome["code"] == 0, f"{outcome['command']}\n{outcome['output']}"
    assert "SQLStore'>" in outcomes[-1]["output"]  # the package's own class was printed


@pytest.mark.parametrize(
    ("page", "block"), PYTHON_BLOCKS, ids=[_where(page, block) for page, block in PYTHON_BLOCKS]
)
def test_a_python_block_is_in_ruff_format(page: Path, block: Block) -> None:
    ruff = [str(RUFF), "format", "--diff", "--stdin-filename", "docs_block.py", "-"]
    result = _run(ruff, stdin=block.text, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = _run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")])
    assert result.returncode == 0, result.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert reference.count("SQLStore") > 1
    assert ":class:" not in reference  # the docstrings' Sphinx roles are shown as code
