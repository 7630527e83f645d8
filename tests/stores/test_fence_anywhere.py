"""fence() with any store: the proof of a committed effect is a row of the app's own database,
so a store that forgets (Redis flushed, a MemoryStore gone with its process) never runs a
key's effect twice."""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator
from typing import Any, cast

import anyio
import httpx
import pytest
import redis.asyncio
from fastapi import FastAPI
from sqlalchemy import Column, CursorResult, Integer, MetaData, String, Table, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from idempotency_mw import (
    ConfigurationError,
    IdempotencyMiddleware,
    RedisStore,
    Store,
    fence,
)
from idempotency_mw.engine.cleanup import purge
from idempotency_mw.engine.proofs import ProofTable, proof_metadata, proofs
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.metrics import Event
from tests.conftest import POSTGRESQL_URL, fresh_sql_store, require_server
from tests.support.apps import PausableStore, client_for, taken_over
from tests.support.faults import RedisServer

pytestmark = pytest.mark.anyio

COMMITTED = "urn:idempotency-mw:problem:committed-without-response"
metadata = MetaData()
orders = Table(
    "fence_anywhere_orders",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idem_key", String(100), nullable=False),
)


@pytest.fixture
async def app_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The application's database, with its own table and the proof table, both empty."""
    engine = create_async_engine(async_url(database_url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.run_sync(proof_metadata.create_all)
        await conn.execute(orders.delete())
        await conn.execute(proofs.delete())
    yield engine
    await engine.dispose()


def order_service(store: Store, engine: AsyncEngine, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    app.state.problems = []
    app.state.delay = 0.0

    @app.post("/orders", status_code=201)
    async def create(key: str) -> dict[str, int]:
        await anyio.sleep(app.state.delay)
        async with AsyncSession(engine) as db, db.begin():
            # An INSERT gives a CursorResult (the session types execute() for any statement).
            inserted = cast(
                CursorResult[Any], await db.execute(orders.insert().values(idem_key=key))
            )
            try:
                await fence(db)
            except ConfigurationError as exc:
                app.state.problems.append(exc)
                raise
        primary_key = inserted.inserted_primary_key
        assert primary_key is not None  # an INSERT of one row has its key
        return {"id": int(primary_key[0])}

    return app


async def count(engine: AsyncEngine, key: str) -> int:
    async with engine.connect() as conn:
        query = select(func.count()).select_from(orders).where(orders.c.idem_key == key)
        return int((await conn.execute(query)).scalar_one())


def post(client: httpx.AsyncClient, key: str) -> Any:
    return client.post(f"/orders?key={key}", headers={"Idempotency-Key": key})


def assert_committed(answer: httpx.Response) -> None:
    assert answer.status_code == 409
    assert answer.json()["type"] == COMMITTED


async def test_a_flushed_redis_store_never_runs_a_fenced_effect_twice(
    app_engine: AsyncEngine,
) -> None:
    # A Redis of the test's own, emptied between the run and its retry (a restart without
    # persistence, a failover that lost the last writes): the retry's claim is acquired
    # again, its handler runs, and its fence finds the first run's proof and rolls back.
    with RedisServer() as server:
        store = RedisStore(server.url)
        app = order_service(store, app_engine)
        async with client_for(app) as client:
            first = await post(client, "r")
            client_redis = redis.asyncio.Redis.from_url(server.url)
            await client_redis.flushdb()
            await client_redis.aclose()
            retry = await post(client, "r")
            again = await post(client, "r")
        await store.aclose()
    assert first.status_code == 201
    assert_committed(retry)
    # The refusal was recorded, so the next retry is told so without running again.
    assert_committed(again)
    assert again.headers["idempotent-replayed"] == "true"
    assert await count(app_engine, "r") == 1


async def test_a_memory_store_that_forgot_never_runs_a_fenced_effect_twice(
    tmp_path: Any,
) -> None:
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.run_sync(proof_metadata.create_all)
    answers = []
    # Two processes' worth of MemoryStore: the second knows nothing of the first run.
    for _ in range(2):
        async with client_for(order_service(MemoryStore(), engine)) as client:
            answers.append(await post(client, "m"))
    assert answers[0].status_code == 201
    assert_committed(answers[1])
    assert await count(engine, "m") == 1
    await engine.dispose()


async def test_a_run_whose_lease_was_taken_over_finds_the_proof_and_rolls_back(
    app_engine: AsyncEngine,
) -> None:
    # The first run's renewals stall past its lease and it goes on unprotected; a retry takes
    # the key over in the store and commits. The first run's fence then finds the retry's
    # proof: its transaction rolls back, and the retry's answer stays the recorded one.
    store = PausableStore(MemoryStore())
    app = order_service(store, app_engine, lease=0.4, on_lease_lost="continue")
    app.state.delay = 1.0
    first, retry = await taken_over(app, store, lambda client: post(client, "t"))
    async with client_for(app) as client:
        again = await post(client, "t")
    assert retry.status_code == 201
    assert_committed(first)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == retry.json()
    assert await count(app_engine, "t") == 1


async def test_a_sql_store_on_another_database_fences_with_the_proof_table(
    app_engine: AsyncEngine, tmp_path: Any
) -> None:
    store_url = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    store = await fresh_sql_store(store_url)
    async with client_for(order_service(store, app_engine)) as client:
        first = await post(client, "s")
        await store.aclose()
        forgetful = await fresh_sql_store(store_url)  # the table emptied: the record is gone
        async with client_for(order_service(forgetful, app_engine)) as again_client:
            retry = await post(again_client, "s")
        await forgetful.aclose()
    assert first.status_code == 201
    assert_committed(retry)
    assert await count(app_engine, "s") == 1


async def test_a_host_spelled_differently_is_fenced_not_a_500() -> None:
    # The store names the server 127.0.0.1, the app's session localhost: the same database,
    # which fence() cannot prove, so the proof table in the session's database decides.
    require_server(POSTGRESQL_URL)
    store = await fresh_sql_store(POSTGRESQL_URL)
    engine = create_async_engine(async_url(POSTGRESQL_URL.replace("127.0.0.1", "localhost")))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.run_sync(proof_metadata.create_all)
        await conn.execute(orders.delete())
    async with client_for(order_service(store, engine)) as client:
        answers = [await post(client, "h") for _ in range(2)]
    await store.aclose()
    assert answers[0].status_code == 201
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert await count(engine, "h") == 1
    await engine.dispose()


async def test_without_the_proof_table_fence_names_it_and_rolls_back(tmp_path: Any) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'app.db'}"
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    events: list[Event] = []
    app = order_service(MemoryStore(), engine, on_event=events.append)
    async with client_for(app) as client:
        answer = await post(client, "order-7f3a")
    assert answer.status_code == 500
    [error] = app.state.problems
    problem = str(error)
    assert "idempotency_proofs" in problem
    assert str(tmp_path / "app.db") in problem
    assert "migrate --proofs" in problem
    # The key is named by its hash, in the message and anywhere its traceback would be logged.
    assert f"key {events[0].key_hash}" in problem
    assert "order-7f3a" not in "".join(traceback.format_exception(error))
    assert await count(engine, "order-7f3a") == 0
    await engine.dispose()


async def test_proofs_expire_with_the_key_and_the_purge_deletes_them(
    app_engine: AsyncEngine,
) -> None:
    store = MemoryStore()
    async with client_for(order_service(store, app_engine, ttl=1, lease=0.5)) as client:
        assert (await post(client, "e")).status_code == 201
        report = await purge(ProofTable(app_engine))
        assert report.deleted == 0  # still live
        async with app_engine.begin() as conn:
            await conn.execute(proofs.update().values(expires_at=proofs.c.expires_at - 2000))
        # Past its TTL the key is new again, in the store as in the proof table.
        async with client_for(order_service(MemoryStore(), app_engine, ttl=1, lease=0.5)) as fresh:
            assert (await post(fresh, "e")).status_code == 201
        async with app_engine.begin() as conn:
            await conn.execute(proofs.update().values(expires_at=proofs.c.expires_at - 2000))
        report = await purge(ProofTable(app_engine), batch_size=1)
    assert report.deleted == 1
    assert await count(app_engine, "e") == 2
    async with app_engine.connect() as conn:
        assert (await conn.execute(select(func.count()).select_from(proofs))).scalar_one() == 0


def test_the_cli_purges_expired_proofs(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from sqlalchemy import create_engine, insert

    from idempotency_mw.operator.cli import main

    url = f"sqlite:///{tmp_path / 'app.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:
        proof_metadata.create_all(conn)
        conn.execute(
            insert(proofs),
            [
                {"scope": "", "key": "old", "token": "a" * 32, "expires_at": 0},
                {"scope": "", "key": "live", "token": "b" * 32, "expires_at": 2**62},
            ],
        )
    assert main(["purge", "--proofs", "--url", url]) == 0
    assert "purged 1 expired fence() proofs" in capsys.readouterr().out
    with engine.connect() as conn:
        assert list(conn.execute(select(proofs.c.key)).scalars()) == ["live"]
    engine.dispose()
