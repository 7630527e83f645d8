"""A server that answers but lacks the database its URL names skips its tests (CI fails the
run) with a message that says so: no test errors on its first query."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SERVER_URLS, require_server

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "tests/contract/test_store_contract.py::TestEveryStoreConforms"
CASE = "test_first_claim_acquires_and_a_repeat_is_in_progress"
MISSING = "idem_no_such_database"
PYTEST = [
    sys.executable,
    "-m",
    "pytest",
    "-n",
    "0",
    "-p",
    "no:cacheprovider",
    "-q",
    "-rsf",
    "--no-header",
]


def run_on_a_missing_database(server: str, *, required: bool) -> subprocess.CompletedProcess[str]:
    """One contract test of ``server``, in a pytest of its own whose URL names no database."""
    url = SERVER_URLS[server].rsplit("/", 1)[0] + f"/{MISSING}"
    variable = f"IDEMPOTENCY_TEST_{server.upper()}_URL"
    env = {**os.environ, variable: url, "IDEMPOTENCY_REQUIRE_SERVERS": "1" if required else ""}
    return subprocess.run(
        [*PYTEST, f"{CONTRACT}::{CASE}[{server}-url]"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("server", ["postgresql", "mariadb"])
@pytest.mark.parametrize("required", [False, True], ids=["locally", "in-ci"])
def test_a_server_without_the_named_database_skips_or_fails_with_a_message(
    server: str, required: bool
) -> None:
    require_server(SERVER_URLS[server].rsplit("/", 1)[0] + "/")
    run = run_on_a_missing_database(server, required=required)
    output = run.stdout + run.stderr
    assert "could not make the run's database" in output, output
    assert MISSING in output, output
    assert "ERROR " not in output, output
    if required:
        # CI stops the run before any test, with the reason.
        assert run.returncode == 1, output
        assert "IDEMPOTENCY_REQUIRE_SERVERS=1" in output, output
    else:
        assert run.returncode == 0, output
        assert "1 skipped" in output.strip().splitlines()[-1], output
