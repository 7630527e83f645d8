"""Every ```python block of the README runs as written, each in a namespace of its own.

Each block is a snippet a reader copies alone, so each runs alone (its own imports), in a
fresh folder; top-level ``await`` and ``async with`` run on an event loop. A block that cannot
run alone says so in a marker and is skipped here by name, with the test that runs it instead.
"""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tests.readme import Block, blocks

#: Markers of python blocks that do not run here, and why: each must still mark a block.
NOT_RUN_HERE = {
    "file alembic/env.py (run by Alembic in tests/test_alembic_project.py)": (
        "an Alembic env.py: tests/test_alembic_project.py runs it inside Alembic"
    ),
    "not run alone (it calls a ticket service at tickets.example)": (
        "it needs a service on the network"
    ),
}
PYTHON_BLOCKS = [block for block in blocks() if block.language == "python"]
RUFF = Path(sys.executable).parent / "ruff"


def _id(block: Block) -> str:
    return f"README.md:{block.line}"


def test_every_skip_marks_a_python_block() -> None:
    markers = {block.marker for block in PYTHON_BLOCKS}
    assert set(NOT_RUN_HERE) <= markers
    assert len(PYTHON_BLOCKS) >= 6


def run(block: Block) -> None:
    """Run a block in a namespace of its own; with top-level await, on an event loop."""
    code = compile(
        block.text, _id(block), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    result = eval(code, {"__name__": "__readme__"})
    if asyncio.iscoroutine(result):
        asyncio.run(result)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_id)
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.marker in NOT_RUN_HERE:
        pytest.skip(NOT_RUN_HERE[block.marker])
    monkeypatch.chdir(tmp_path)  # files a block makes (./idempotency.db) land here
    run(block)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_id)
def test_python_block_is_in_ruff_format(block: Block) -> None:
    result = subprocess.run(
        [str(RUFF), "format", "--diff", "--stdin-filename", "readme_block.py", "-"],
        input=block.text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_block_that_does_not_run_fails() -> None:
    """The runner really runs a block, top-level await included: a broken one raises."""
    with pytest.raises(ImportError):
        run(Block("python", "from idempotency_mw import NoSuchThing\n", 1, None))
    awaiting = "import asyncio\n\nawait asyncio.sleep(0)\nraise RuntimeError('ran')\n"
    with pytest.raises(RuntimeError, match="ran"):
        run(Block("python", awaiting, 1, None))
