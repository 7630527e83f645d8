"""fence(): the record moves with the application's own transaction, so the effect is exact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException
from sqlalchemy import (
    Column,
    CursorResult,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from idempotency_mw import (
    ConfigurationError,
    IdempotencyMiddleware,
    LeaseLost,
    SQLStore,
    fence,
    fence_sync,
)
from idempotency_mw.stores.sql import async_url
from tests.conftest import fresh_sql_store
from tests.support.apps import PausableStore, client_for, taken_over

pytestmark = pytest.mark.anyio

SYNC_DRIVERS = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}
metadata = MetaData()
tickets = Table(
    "fence_tickets",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idem_key", String(100), nullable=False),
)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_url(database_url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(tickets.delete())
    yield engine
    await engine.dispose()


@pytest.fixture
async def store(database_url: str, engine: AsyncEngine) -> AsyncIterator[PausableStore]:
    store = PausableStore(await fresh_sql_store(database_url))
    yield store
    await store.aclose()


def ticket_service(store: Any, engine: AsyncEngine, **options: Any) -> FastAPI:
    """Tickets created in the app's own transaction, fenced; behaviours picked by query."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    app.state.delay = 0.0
    app.state.linger = 0.0

    async def session() -> AsyncIterator[AsyncSession]:
        async with AsyncSession(engine) as session:
            yield session

    @app.post("/tickets", status_code=201)
    async def create(
        key: str,
        then: str = "answer",
        db: AsyncSession = Depends(session),  # noqa: B008
    ) -> dict[str, int]:
        await anyio.sleep(app.state.delay)
        async with db.begin():
            # An INSERT gives a CursorResult (the session types execute() for any statement).
            inserted = cast(
                CursorResult[Any], await db.execute(tickets.insert().values(idem_key=key))
            )
            ticket_id = inserted.inserted_primary_key
            assert ticket_id is not None  # an INSERT of one row has its key
            await fence(db)
        if then == "linger":
            await anyio.sleep(app.state.linger)
        if then == "raise":
            raise RuntimeError("failed after its transaction committed")
        if then == "500":
            raise HTTPException(500, "failed after its transaction committed")
        return {"id": int(ticket_id[0])}

    async def fenced_ticket(key: str, db: AsyncSession = Depends(session)) -> int:  # noqa: B008
        async with db.begin():
            await db.execute(tickets.insert().values(idem_key=key))
            await fence(db)
        return 1

    @app.post("/dependency-tickets", status_code=201)
    async def create_in_a_dependency(
        created: int = Depends(fenced_ticket),
    ) -> dict[str, int]:
        return {"created": created}

    @app.post("/sync-tickets", status_code=201)
    def create_sync(key: str) -> dict[str, str]:
        sync_driver = SYNC_DRIVERS[engine.url.get_backend_name()]
        sync_engine = create_engine(engine.url.set(drivername=sync_driver))
        try:
            with Session(sync_engine) as db, db.begin():
                db.execute(tickets.insert().values(idem_key=key))
                fence_sync(db)
        finally:
            sync_engine.dispose()
        return {"created": key}

    return app


async def count(engine: AsyncEngine, key: str) -> int:
    async with engine.connect() as conn:
        query = select(func.count()).select_from(tickets).where(tickets.c.idem_key == key)
        return int((await conn.execute(query)).scalar_one())


def post(client: httpx.AsyncClient, key: str, then: str = "answer") -> Any:
    return client.post(f"/tickets?key={key}&then={then}", headers={"Idempotency-Key": key})


async def test_a_fenced_request_runs_once_and_replays(
    store: PausableStore, engine: AsyncEngine
) -> None:
    app = ticket_service(store, engine)
    async with client_for(app) as client:
        first = await post(client, "k")
        again = await post(client, "k")
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert await count(engine, "k") == 1


@pytest.mark.parametrize("then", ["raise", "500"])
async def test_a_failure_after_the_commit_never_runs_again(
    store: PausableStore, engine: AsyncEngine, then: str
) -> None:
    app = ticket_service(store, engine)
    async with client_for(app) as client:
        first = await post(client, "k", then)
        retries = [await post(client, "k", then) for _ in range(2)]
    assert first.status_code == 500
    for retry in retries:
        assert retry.status_code == 409
        assert retry.json()["type"] == "urn:idempotency-mw:problem:committed-without-response"
    assert await count(engine, "k") == 1


async def test_a_response_that_cannot_be_recorded_is_never_run_again(
    store: PausableStore, engine: AsyncEngine
) -> None:
    app = ticket_service(store, engine, lease=0.4)
    async with client_for(app) as client:
        store.fail("complete")
        first = await post(client, "k")
        store.failing = frozenset()
        await anyio.sleep(0.5)  # the lease lapses: nobody holds the key any more
        retry = await post(client, "k")
        # Its holder may still be alive behind a stalled store: told to come back once.
        assert retry.status_code == 409
        assert retry.json()["type"].endswith(":in-progress")
        await anyio.sleep(0.5)  # and not heard from for a whole lease more
        late = await post(client, "k")
    assert first.status_code == 201  # the client got its answer
    assert late.status_code == 409
    assert late.json()["type"].endswith("committed-without-response")
    assert await count(engine, "k") == 1


async def test_a_takeover_after_a_lost_lease_commits_once(
    store: PausableStore, engine: AsyncEngine
) -> None:
    # The first request's renewals stall past its lease, and it goes on unprotected; a retry
    # takes the key over and commits. The first request's fence then finds the key another's,
    # and its transaction rolls back: one ticket.
    app = ticket_service(store, engine, lease=0.4, on_lease_lost="continue")
    app.state.delay = 1.0
    first, retry = await taken_over(app, store, lambda client: post(client, "k"))
    assert retry.status_code == 201
    assert first.status_code == 409
    assert first.json()["type"].endswith("in-progress")
    assert await count(engine, "k") == 1


async def test_a_committed_request_is_never_stopped_by_a_stalled_store(
    store: PausableStore, engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    # The effect committed (fenced); then the store stalls past the lease. Nothing can take
    # the key over any more, so the request goes on and its client gets the answer (no 503).
    app = ticket_service(store, engine, lease=0.4)
    async with client_for(app) as client:
        # A first request opens the store: a claim slower than a third of the lease would be
        # proven again by a renewal before its work starts, which the stall below would hold.
        await post(client, "warm-up", "answer")
        app.state.linger = 1.0
        store.pause("renew")
        with anyio.fail_after(10):
            first = await post(client, "c", "linger")
        store.resume()
        app.state.linger = 0.0
        retry = await post(client, "c", "linger")
    assert "did not confirm the lease in time, but the effect is committed" in caplog.text
    assert first.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == first.json()
    assert await count(engine, "c") == 1


async def test_a_retry_as_a_stalled_store_returns_waits_for_the_committed_answer(
    store: PausableStore, engine: AsyncEngine
) -> None:
    # The effect committed (fenced), then the store stalled past the lease: the request went
    # on and answered. A retry sent as the store came back, before the answer was recorded,
    # is told to come back (in-progress), not "committed, do not send again"; with wait=, it
    # waits for the answer.
    app = ticket_service(store, engine, lease=0.6)
    app.state.linger = 0.8
    # Another worker of the service whose route waits for a key's outcome.
    waiting = ticket_service(store, engine, lease=0.6, wait=5)
    answers: dict[str, httpx.Response] = {}
    async with client_for(app) as client, client_for(waiting) as waiting_client:
        async with anyio.create_task_group() as group:

            async def send(name: str, to: httpx.AsyncClient) -> None:
                answers[name] = await post(to, "p", "linger")

            group.start_soon(send, "first", client)
            # The store stalls once the claim answered (a claim slow enough to need a renewal
            # before the work starts gets it), however late a busy machine sent it.
            with anyio.fail_after(10):
                await store.claimed.wait()
            store.pause("renew", "complete")
            await anyio.sleep(1.0)  # answered, its lease lapsed, its completion held
            await send("retry", client)
            group.start_soon(send, "waiting", waiting_client)
            await anyio.sleep(0.2)
            store.resume()
        await send("replay", client)
    first, retry = answers["first"], answers["retry"]
    assert first.status_code == 201
    assert retry.status_code == 409, retry.text
    assert retry.json()["type"].endswith(":in-progress")
    assert retry.headers["retry-after"]
    for name in ("waiting", "replay"):
        assert answers[name].headers["idempotent-replayed"] == "true", answers[name].text
        assert answers[name].json() == first.json()
    assert await count(engine, "p") == 1


async def test_fence_without_a_key_on_an_optional_route_does_nothing(
    store: PausableStore, engine: AsyncEngine
) -> None:
    app = ticket_service(store, engine)
    async with client_for(app) as client:
        answers = [await client.post("/tickets?key=none") for _ in range(2)]
    assert [answer.status_code for answer in answers] == [201, 201]
    assert await count(engine, "none") == 2


async def test_fence_in_a_fastapi_dependency(store: PausableStore, engine: AsyncEngine) -> None:
    app = ticket_service(store, engine)
    async with client_for(app) as client:
        answers = [
            await client.post("/dependency-tickets?key=d", headers={"Idempotency-Key": "d"})
            for _ in range(2)
        ]
    assert answers[0].status_code == 201
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert await count(engine, "d") == 1


async def test_fence_sync_in_a_sync_endpoint(store: PausableStore, engine: AsyncEngine) -> None:
    app = ticket_service(store, engine)
    async with client_for(app) as client:
        answers = [
            await client.post("/sync-tickets?key=s", headers={"Idempotency-Key": "s"})
            for _ in range(2)
        ]
    assert answers[0].status_code == 201
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert await count(engine, "s") == 1


async def test_fence_outside_a_guarded_request_or_transaction_is_refused(
    engine: AsyncEngine, tmp_path: Any
) -> None:
    async with AsyncSession(engine) as session:
        with pytest.raises(ConfigurationError, match="guarded by IdempotencyMiddleware"):
            await fence(session)
    problems: list[str] = []
    other = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    app = FastAPI()
    store = SQLStore(f"sqlite:///{tmp_path / 'store.db'}")
    await (await fresh_sql_store(f"sqlite:///{tmp_path / 'store.db'}")).aclose()
    app.add_middleware(IdempotencyMiddleware, store=store)

    @app.post("/misused")
    async def misused(how: str) -> None:
        try:
            if how == "no-transaction":
                async with AsyncSession(engine) as session:
                    await fence(session)
            else:
                async with other.connect() as conn, conn.begin():
                    await fence(conn)
        except ConfigurationError as exc:
            problems.append(str(exc))

    async with client_for(app) as client:
        for how in ("no-transaction", "other-database"):
            await client.post(f"/misused?how={how}", headers={"Idempotency-Key": how})
    await other.dispose()
    await store.aclose()
    assert "inside the transaction" in problems[0]
    # Another database than the store's: fence() writes its proof there, in a table it lacks.
    assert "idempotency_proofs" in problems[1]
    assert "other.db" in problems[1]  # the session's database
    assert "store.db" in problems[1]  # and the store's


def test_lease_lost_is_an_idempotency_error() -> None:
    from idempotency_mw import IdempotencyError

    assert issubclass(LeaseLost, IdempotencyError)
