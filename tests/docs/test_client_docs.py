"""The client's documentation pages run as written (their Python blocks, in order, in one
fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.readme import blocks

PAGES = sorted((Path(__file__).resolve().parents[2] / "docs" / "client").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_client_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    code = "\n".join(block.text for block in blocks(page) if block.language == "python")
    assert code.strip(), f"{page.name} has no Python block"
    script = tmp_path / "page.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
