"""A chain of two services behind the middleware, on SQLite, PostgreSQL and Redis: service A's
handler charges through service B with the package's client, A's worker is killed after B
acted, and the order is retried: B charges once (A's re-run is replayed B's answer, under the
key derived from the order's), and A completes."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.to_thread
import httpx
import pytest

from tests.conftest import (
    POSTGRESQL_URL,
    REDIS_URL,
    forget_redis_prefix,
    fresh_sql_store,
    redis_prefix,
    require_server,
)
from tests.support.chain_app import chain_env, create_orders, create_payments
from tests.support.faults import ServerProcess, serve
from tests.support.reliability_app import Effects, store_from_url

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

LEASE = 1.0


@pytest.fixture(params=["sqlite", "postgresql", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """A store URL both services keep their records in (each its own), and a Redis prefix."""
    prefix = redis_prefix("chain")
    if request.param == "redis":
        require_server(REDIS_URL)
        yield REDIS_URL, prefix
        forget_redis_prefix(prefix)
        return
    url = (
        f"sqlite:///{tmp_path / 'idempotency.db'}" if request.param == "sqlite" else POSTGRESQL_URL
    )
    if request.param != "sqlite":
        require_server(url)
    await (await fresh_sql_store(url)).aclose()
    yield url, prefix


async def test_a_killed_worker_that_charged_downstream_is_rerun_without_a_second_charge(
    backend: tuple[str, str], tmp_path: Path
) -> None:
    url, prefix = backend
    effects = Effects(tmp_path / "effects.db")
    order = {"amount": 42}
    headers = {"Idempotency-Key": f"order-{uuid.uuid4().hex}"}
    payments_store = store_from_url(url, prefix)
    survivor_store = store_from_url(url, prefix)
    async with serve(create_payments(payments_store, effects)) as payments:
        env = chain_env(
            url,
            prefix,
            payments,
            effects,
            str(tmp_path / "doomed-journal.sqlite3"),
            lease=LEASE,
            delay=120,
        )
        survivor = create_orders(
            survivor_store,
            payments_url=payments,
            effects=effects,
            journal=str(tmp_path / "survivor-journal.sqlite3"),
            lease=LEASE,
            delay=0,
        )
        with ServerProcess("tests.support.chain_app:create_orders", env) as doomed:
            async with serve(survivor) as orders, httpx.AsyncClient(timeout=30) as http:
                await anyio.to_thread.run_sync(doomed.wait_ready)
                lost: list[BaseException] = []

                async def first_attempt() -> None:
                    try:
                        await http.post(doomed.url + "/orders", json=order, headers=headers)
                    except httpx.TransportError as exc:
                        lost.append(exc)

                async with anyio.create_task_group() as group:
                    group.start_soon(first_attempt)
                    # B charged and answered; A's worker dies before it answers.
                    for _ in range(1000):
                        if effects.count(None, "order-charged"):
                            break
                        await anyio.sleep(0.02)
                    doomed.kill()
                assert len(lost) == 1
                # The retry waits (409) for the dead worker's lease, then runs A again.
                deadline = time.monotonic() + LEASE + 10
                while True:
                    answer = await http.post(orders + "/orders", json=order, headers=headers)
                    if answer.status_code != 409 or time.monotonic() > deadline:
                        break
                    await anyio.sleep(0.1)
                replay = await http.post(orders + "/orders", json=order, headers=headers)
    await payments_store.aclose()
    await survivor_store.aclose()
    assert answer.status_code == 201, answer.text
    assert answer.json()["pid"] == os.getpid()
    # A's re-run sent the charge under the same derived key: B replayed it.
    assert answer.json()["replayed"] is True
    assert answer.json()["charge"]["amount"] == 42
    assert effects.count(None, "charged") == 1
    assert effects.count(None, "order-charged") == 2
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == answer.content
