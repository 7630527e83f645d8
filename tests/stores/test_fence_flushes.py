"""One durable flush per fenced request: a route declared ``fenced=True`` claims and completes
without waiting for its own flush (PostgreSQL); every other route records its answer durably."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import anyio.lowlevel
import asyncpg
import pytest
from fastapi import FastAPI
from sqlalchemy import Column, MetaData, String, Table, delete, event, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import (
    Claim,
    IdempotencyMiddleware,
    SQLStore,
    Store,
    StoredResponse,
    fence,
    idempotent,
)
from idempotency_mw.functions import IdempotentFunctions
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.database import UNFLUSHED
from idempotency_mw.stores.sql.schema import records
from idempotency_mw.testing import MemoryStore
from tests.conftest import SERVER_DATABASES, fresh_sql_store, require_server
from tests.support.apps import client_for

pytestmark = pytest.mark.anyio

metadata = MetaData()
orders = Table("flush_orders", metadata, Column("id", String(32), primary_key=True))


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'app.db'}"
    found: str = SERVER_DATABASES["postgresql"]
    require_server(found)
    return found


@pytest.fixture
async def engine(url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(orders.delete())
    yield engine
    await engine.dispose()


@pytest.fixture
async def store(url: str, engine: AsyncEngine) -> AsyncIterator[SQLStore]:
    store = await fresh_sql_store(url)
    yield store
    await store.aclose()


def order_service(store: Any, engine: AsyncEngine, *, forget_claim: bool = False) -> FastAPI:
    """``/fenced`` (declared, fences), ``/unfenced`` (fences, not declared) and ``/forgot``
    (declared, never fences). ``forget_claim`` deletes the claim's record before the fence,
    as a crash before its flush would have lost it."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store)

    async def order(fenced: bool = True) -> dict[str, str]:
        order_id = uuid.uuid4().hex
        if forget_claim:
            async with engine.begin() as connection:
                await connection.execute(delete(records))
        async with engine.begin() as connection:
            await connection.execute(orders.insert().values(id=order_id))
            if fenced:
                await fence(connection)
        return {"id": order_id}

    @app.post("/fenced", status_code=201)
    @idempotent(fenced=True)
    async def fenced() -> dict[str, str]:
        return await order()

    @app.post("/unfenced", status_code=201)
    async def unfenced() -> dict[str, str]:
        return await order()

    @app.post("/forgot", status_code=201)
    @idempotent(fenced=True)
    async def forgot() -> dict[str, str]:
        return await order(fenced=False)

    return app


class Writes:
    """The store's writes, each ``fast`` (it ran in a transaction that set
    ``synchronous_commit = off`` first) or ``durable``: those through SQLAlchemy as its engine
    sends them, those on the driver's own connection (each on its own, in autocommit) as the
    driver traces them. Requests are sent one at a time, from a store without connections."""

    def __init__(self, store: SQLStore) -> None:
        self._kinds: list[str] = []
        self._previous = ""
        engine = store.engine.sync_engine
        event.listen(engine, "before_cursor_execute", self._saw)
        event.listen(engine, "connect", self._trace)

    def _saw(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if _writes(statement):
            self._kinds.append("fast" if self._previous == UNFLUSHED else "durable")
        self._previous = statement

    def _trace(self, dbapi_connection: Any, _: Any) -> None:
        def traced(statement: str) -> None:
            if _writes(statement):
                self._kinds.append("durable")

        connection = dbapi_connection.driver_connection
        if isinstance(connection, asyncpg.Connection):
            # Its log leaves out the statements SQLAlchemy prepares itself (seen above).
            connection.add_query_logger(lambda query: traced(query.query))
        else:  # aiosqlite: sqlite3 traces every statement, SQLAlchemy's too (none here)
            dbapi_connection.run_async(lambda driver: driver.set_trace_callback(traced))

    async def kinds(self) -> list[str]:
        """The writes so far (asyncpg hands a statement to its loggers on the loop's next
        turn)."""
        await anyio.lowlevel.checkpoint()
        return self._kinds


def _writes(statement: str) -> bool:
    return any(write in statement for write in ("INSERT INTO", "UPDATE ", "DELETE FROM"))


async def test_a_declared_fenced_route_claims_and_completes_without_their_own_flush(
    store: SQLStore, engine: AsyncEngine
) -> None:
    writes = Writes(store)
    async with client_for(order_service(store, engine)) as client:
        reply = await client.post("/fenced", headers={"Idempotency-Key": "k"})
        assert reply.status_code == 201
        # PostgreSQL only: elsewhere every write waits for the disk, which is always safe.
        assert (
            await writes.kinds()
            == (["durable"] if store.url.get_backend_name() == "sqlite" else ["fast"]) * 2
        )
        again = await client.post("/fenced", headers={"Idempotency-Key": "k"})
    assert again.json() == reply.json()
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(orders)) == 1


async def test_an_unfenced_route_records_its_answer_durably(
    store: SQLStore, engine: AsyncEngine
) -> None:
    writes = Writes(store)
    async with client_for(order_service(store, engine)) as client:
        assert (await client.post("/unfenced", headers={"Idempotency-Key": "k"})).is_success
    assert await writes.kinds() == ["durable", "durable"]


async def test_a_declared_route_that_did_not_fence_completes_durably_and_says_so_once(
    store: SQLStore, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    writes = Writes(store)
    async with client_for(order_service(store, engine)) as client:
        with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
            for key in ("a", "b", "c"):
                assert (await client.post("/forgot", headers={"Idempotency-Key": key})).is_success
    said = [r for r in caplog.records if "answered without fence()" in r.getMessage()]
    assert len(said) == 1
    assert "POST /forgot" in said[0].getMessage()
    # The claims skipped their flush; each completion, the only proof, waited for it.
    if store.url.get_backend_name() == "postgresql":
        assert await writes.kinds() == ["fast", "durable"] * 3
    else:
        assert await writes.kinds() == ["durable", "durable"] * 3
    async with engine.connect() as conn:
        completed = await conn.scalar(
            select(func.count()).select_from(records).where(records.c.status == "completed")
        )
    assert completed == 3


async def test_a_function_declared_fenced_skips_the_flushes_its_fence_makes_up_for(
    store: SQLStore, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    # The same setting as a route's, for idempotent functions and (through them) MCP tools.
    writes = Writes(store)
    protect = IdempotentFunctions(store, fenced=True)

    async def place(fenced: bool) -> str:
        order_id = uuid.uuid4().hex
        async with engine.begin() as connection:
            await connection.execute(orders.insert().values(id=order_id))
            if fenced:
                await fence(connection)
        return order_id

    fast = "fast" if store.url.get_backend_name() == "postgresql" else "durable"
    placed = await protect.call("a", "f", lambda: place(True), name="place")
    assert await writes.kinds() == [fast, fast]
    assert await protect.call("a", "f", lambda: place(True), name="place") == placed
    before = len(await writes.kinds())
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        for key in ("b", "c"):
            await protect.call(key, "f", lambda: place(False), name="forgot")
    # Without fence(), the completion is the only proof: it waits for its flush.
    assert (await writes.kinds())[before:] == [fast, "durable"] * 2
    said = [r for r in caplog.records if "answered without fence()" in r.getMessage()]
    assert [r.getMessage().split(" declares")[0] for r in said] == ["CALL forgot"]


async def test_a_lost_claim_still_commits_its_effect_once_and_a_retry_is_refused(
    store: SQLStore, engine: AsyncEngine
) -> None:
    async with client_for(order_service(store, engine, forget_claim=True)) as client:
        first = await client.post("/fenced", headers={"Idempotency-Key": "k"})
        assert first.status_code == 201
    # The fence wrote the record again, committed with the effect: the retry replays.
    async with client_for(order_service(store, engine)) as client:
        again = await client.post("/fenced", headers={"Idempotency-Key": "k"})
    assert again.json() == first.json()
    async with engine.connect() as conn:
        assert await conn.scalar(select(func.count()).select_from(orders)) == 1


class EarlierStore(MemoryStore):
    """A store written for the protocol before ``durable=``: its methods lack the keyword."""

    async def claim(  # type: ignore[override]
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float, binding: str = ""
    ) -> Claim:
        return await super().claim(scope, key, fingerprint, ttl=ttl, lease=lease, binding=binding)

    async def complete(  # type: ignore[override]
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        return await super().complete(scope, key, token, response, ttl=ttl)


async def test_a_store_without_the_keyword_is_never_given_it() -> None:
    app = FastAPI()
    # A store written for the protocol before durable= (typed against today's on purpose).
    app.add_middleware(IdempotencyMiddleware, store=cast(Store, EarlierStore()))

    @app.post("/fenced", status_code=201)
    @idempotent(fenced=True)
    async def fenced() -> dict[str, str]:
        return {"id": "1"}

    async with client_for(app) as client:
        first = await client.post("/fenced", headers={"Idempotency-Key": "k"})
        again = await client.post("/fenced", headers={"Idempotency-Key": "k"})
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
