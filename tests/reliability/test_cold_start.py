"""A service starts, and uvicorn replaces its workers, while its store is down.

The store is a PostgreSQL or Redis server of the test's own (``tests/support/faults.py``), stopped
before uvicorn starts ``tests/support/reliability_app.py`` with 2 worker processes. An unreachable
store only makes keyed requests wait (503); a store that answers without the idempotency
table (an empty database of the shared server) fails start-up, with the hint to migrate.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import anyio
import httpx
import pytest

from tests.reliability.test_reliability import (
    FACTORY,
    eventually,
    headers_for,
    problem_type,
    replay_of,
    replayed,
    retry_until_settled,
)
from tests.support.faults import ServerProcess, StoreServer
from tests.support.reliability_app import Effects, service_env

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

WORKERS = 2


async def pid_answering(service: ServerProcess, client: httpx.AsyncClient) -> int:
    """The pid of the worker that answers ``GET /health``; fails when none answers."""
    try:
        response = await client.get("/health", timeout=2)
    except httpx.TimeoutException as exc:
        raise AssertionError(f"the service stopped answering:\n{service.output()}") from exc
    assert response.status_code == 200, response.text
    return int(response.json()["pid"])


async def test_a_service_starts_and_replaces_workers_while_its_store_is_down(
    own_store: StoreServer, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    own_store.stop()
    env = service_env(own_store.url, effects, lease=2, delay=0)
    with ServerProcess(FACTORY, env, workers=WORKERS) as service:
        await anyio.to_thread.run_sync(service.wait_ready)
        async with service.client() as client:
            # Only keyed requests need the store.
            assert (await client.post("/ping")).status_code == 200
            waiting = await client.post("/work", json={}, headers=headers_for("early"))
            assert waiting.status_code == 503, waiting.text
            assert problem_type(waiting) == "store-unavailable"
            assert waiting.headers["retry-after"]

            # A worker dies while the store is still down: uvicorn starts another, which
            # starts although the store is down, and the service answers throughout.
            await eventually(lambda: len(service.worker_pids()) == WORKERS)
            first_workers = service.worker_pids()
            killed = await anyio.to_thread.run_sync(service.kill_worker)
            await pid_answering(service, client)
            await eventually(
                lambda: len(service.worker_pids() - first_workers) == 1 or not service.alive(),
                within=15,
            )
            assert service.alive(), f"uvicorn stopped:\n{service.output()}"
            (replacement,) = service.worker_pids() - first_workers
            deadline = time.monotonic() + 15
            while await pid_answering(service, client) != replacement:
                assert service.alive(), f"uvicorn stopped:\n{service.output()}"
                assert time.monotonic() < deadline, (
                    f"the new worker never answered:\n{service.output()}"
                )
                await anyio.sleep(0.05)
            assert service.worker_pids() == first_workers - {killed} | {replacement}

            # The store comes back (PostgreSQL with its table): keyed requests run once, on
            # each worker, and are replayed.
            await anyio.to_thread.run_sync(own_store.start)
            ran_on: set[int] = set()
            keys = ["early", *(f"cold-{n}-{uuid.uuid4().hex}" for n in range(100))]
            for key in keys:
                answer, _ = await retry_until_settled(client, "/work", key, within=10, json={})
                assert answer.status_code == 200, answer.text
                assert not replayed(answer)
                replay = await replay_of(client, "/work", key, json={})
                assert replayed(replay)
                assert replay.content == answer.content
                assert effects.count(key) == 1
                ran_on.add(answer.json()["pid"])
                if ran_on == service.worker_pids():
                    break
            assert ran_on == service.worker_pids()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
async def test_a_store_without_its_table_fails_startup_with_the_migrate_hint(
    fresh_database: str, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    env = service_env(fresh_database, effects, lease=2, delay=0)
    with (
        ServerProcess(FACTORY, env) as service,
        pytest.raises(RuntimeError, match=r"the server exited \(3\)") as failure,
    ):
        await anyio.to_thread.run_sync(service.wait_ready)
    assert "does not exist: run `idempotency-mw migrate --store" in str(failure.value)
