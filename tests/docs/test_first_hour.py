"""The first hour of a new user: each trap found by a newcomer's walk through the docs is gone.

The missing table's start-up error names both Alembic recipes; a broken quoted key is told so;
the migrations' env.py keeps Alembic's logging; Prometheus under ``uvicorn --workers N`` gives
one scrape with every worker's counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest
from asgi_lifespan import LifespanManager
from prometheus_client.parser import text_string_to_metric_families

from idempotency_mw import SchemaError, SQLStore
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for, make_app
from tests.support.faults import ROOT, ServerProcess
from tests.support.readme import marked

pytestmark = pytest.mark.anyio


async def test_the_missing_table_error_names_the_cli_and_both_alembic_recipes(
    tmp_path: Path,
) -> None:
    app = make_app(SQLStore(f"sqlite:///{tmp_path / 'empty.db'}"))
    with pytest.raises(SchemaError) as failure:
        async with LifespanManager(app):
            pass
    message = str(failure.value)
    assert "idempotency-mw migrate --store" in message
    assert "recipe A" in message
    assert "idempotency_mw.alembic.metadata" in message
    assert "alembic revision --autogenerate" in message
    assert "recipe B" in message
    assert "alembic upgrade heads" in message


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ('"abc', "opens a quoted string that is broken"),
        ('"ab"c"', "opens a quoted string that is broken"),
        ('"abc\\"', "opens a quoted string that is broken"),
        ('""', "the quoted Idempotency-Key must hold 1-255 characters"),
        ("a b", "Idempotency-Key must be 1-255 visible ASCII characters"),
    ],
)
async def test_an_invalid_key_is_told_what_is_wrong_with_it(header: str, says: str) -> None:
    async with client_for(make_app(MemoryStore())) as client:
        response = await client.post("/tickets", json={}, headers={"Idempotency-Key": header})
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/problem+json"
    assert says in response.json()["detail"]


def test_the_checkout_migrations_log_through_alembic_ini(tmp_path: Path) -> None:
    """``alembic upgrade head`` from a checkout prints Alembic's lines (env.py runs fileConfig)."""
    env = {**os.environ, "IDEMPOTENCY_DATABASE_URL": f"sqlite:///{tmp_path / 'i.db'}"}
    alembic = Path(sys.executable).parent / "alembic"
    result = subprocess.run(
        [str(alembic), "-c", str(ROOT / "alembic.ini"), "upgrade", "head"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "INFO  [alembic.runtime.migration] Running upgrade" in result.stderr


async def test_one_scrape_sees_every_uvicorn_workers_counts(tmp_path: Path) -> None:
    """prometheus_client's multiprocess mode under real uvicorn workers: one scrape, all counts."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    requests = 0
    pids: set[int] = set()
    with ServerProcess("tests.support.multiprocess_app:create_app", env, workers=2) as server:
        server.wait_ready()
        async with server.client() as client:

            async def send() -> None:
                answer = await client.post("/work", headers={"Idempotency-Key": uuid.uuid4().hex})
                assert answer.status_code == 200
                pids.add(answer.json()["pid"])

            # Rounds of four at once until both workers have answered (the kernel picks which
            # worker accepts a connection), and at least 20 requests in all.
            while (len(pids) < 2 or requests < 20) and requests < 400:
                async with anyio.create_task_group() as group:
                    for _ in range(4):
                        group.start_soon(send)
                requests += 4
            scraped = (await client.get("/metrics")).text
    assert len(pids) == 2, f"{requests} requests did not reach both workers"
    samples = [
        sample
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name.startswith("idempotency_")
    ]
    firsts = [s for s in samples if s.name == "idempotency_requests_total"]
    assert sum(s.value for s in firsts) == requests
    # livesum: one sample for the whole service (not one per worker pid), none left in flight.
    (in_flight,) = [s for s in samples if s.name == "idempotency_in_flight_claims"]
    assert in_flight.labels == {}
    assert in_flight.value == 0


def test_the_docs_env_py_keeps_alembics_logging() -> None:
    """The whole env.py of the Alembic recipes configures logging from alembic.ini, as
    ``alembic init`` does (tests/migrations/test_alembic_project.py runs it in a user's project)."""
    env_py = marked(
        "file alembic/env.py (run by Alembic in tests/migrations/test_alembic_project.py)"
    ).text
    assert "from logging.config import fileConfig\n" in env_py
    assert "    fileConfig(context.config.config_file_name)\n" in env_py
