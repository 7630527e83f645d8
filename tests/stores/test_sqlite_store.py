"""SQLStore on a SQLite file: locks held by other connections, the first connection, WAL."""

from __future__ import annotations

import gc
import math
import sqlite3
import statistics
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import ConfigurationError, SQLStore, Store, StoreError
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.claims import SQLiteClaim
from idempotency_mw.stores.sql.database import Database, engine_for
from idempotency_mw.stores.sql.sqlite import Synchronous
from idempotency_mw.stores.sql.statements import READ
from idempotency_mw.values.outcome import Asking
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse
from tests.conftest import POSTGRESQL_URL, built_store, fresh_sql_store

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'idempotency.db'}"
    await (await fresh_sql_store(url)).aclose()
    return url


@contextmanager
def locked(url: str, how: str) -> Iterator[sqlite3.Connection]:
    """Another connection holding the file's lock (``IMMEDIATE`` or ``EXCLUSIVE``) until exit."""
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)) as other:
        other.execute(f"BEGIN {how}")
        try:
            yield other
        finally:
            other.execute("ROLLBACK")


class Stalls:
    """The event loop's longest stall while :meth:`watch` runs (a 10 ms ticker's lateness)."""

    def __init__(self) -> None:
        self.longest = 0.0

    async def watch(self) -> None:
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            self.longest = max(self.longest, time.monotonic() - before)


def records_in(url: str) -> int:
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        return int(db.execute("SELECT COUNT(*) FROM idempotency_records").fetchone()[0])


def wal_bytes(url: str) -> int:
    return Path(url.removeprefix("sqlite:///") + "-wal").stat().st_size


async def test_a_claim_that_timed_out_never_takes_the_key_later(sqlite_url: str) -> None:
    # In WAL mode (the file's own) the claim's read passes the writer; its write must wait.
    with closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as db:
        db.execute("PRAGMA journal_mode=WAL")
    store = SQLStore(sqlite_url, operation_timeout=0.5)
    try:
        with locked(sqlite_url, "IMMEDIATE"):
            began = time.monotonic()
            with pytest.raises(StoreError):
                await store.claim("", "k", "f", ttl=60, lease=60)
            assert time.monotonic() - began < 1
        # The lock is gone: a statement still waiting for it in a thread would now run.
        await anyio.sleep(0.5)
        assert records_in(sqlite_url) == 0
        assert (await store.claim("", "k", "f", ttl=60, lease=60)).token
    finally:
        await store.aclose()


async def test_a_statement_that_failed_on_the_driver_is_not_sent_again(tmp_path: Path) -> None:
    # On SQLite a failed statement is final: one refused for a lock already waited as long as
    # the deadline allows, and a second wait would outlast its caller and land after it. A
    # statement the database refused leaves its connection as good as before.
    engine = engine_for(f"sqlite:///{tmp_path / 'no-table.db'}")
    database = Database(engine, owned=True, direct=[READ])
    through_sqlalchemy: list[str] = []
    event.listen(
        engine.sync_engine,
        "before_cursor_execute",
        lambda _conn, _cursor, sql, *_: through_sqlalchemy.append(sql),
    )
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            await database.fetch(
                READ,
                {
                    "p_scope": "",
                    "p_key": "k",
                    "p_token": "t",
                    "p_fingerprint": "f",
                    "p_binding": "",
                },
                deadline=time.monotonic() + 5,
            )
        assert through_sqlalchemy == []
        # The database refused the statement: its connection went back to the pool as it was.
        assert engine.pool.checkedin() == 1  # type: ignore[attr-defined]
    finally:
        await database.aclose()


async def test_a_claim_statement_run_after_its_deadline_takes_nothing(sqlite_url: str) -> None:
    # What a claim cancelled by its timeout leaves in the driver's thread, run late (after a
    # wait for the lock that outlasted its caller): the upsert carries the caller's deadline
    # and changes nothing once it passed.
    database = Database(engine_for(sqlite_url), owned=True)
    params = {
        "p_scope": "",
        "p_key": "late",
        "p_fingerprint": "f",
        "p_binding": "",
        "p_token": "t",
        "p_ttl_ms": 60_000,
        "p_lease_ms": 60_000,
    }
    try:
        claim, asking = SQLiteClaim(), Asking("f", token="t", ttl=60)
        late = await claim.attempt(database, params, asking, time.monotonic() - 0.01, durable=True)
        assert late is None
        assert records_in(sqlite_url) == 0
        in_time = await claim.attempt(database, params, asking, time.monotonic() + 5, durable=True)
        assert in_time == Claim(ClaimOutcome.ACQUIRED, token="t")
        assert records_in(sqlite_url) == 1
    finally:
        await database.aclose()


async def test_the_first_connection_never_blocks_the_event_loop(sqlite_url: str) -> None:
    store = SQLStore(sqlite_url, operation_timeout=1)
    stalls = Stalls()

    try:
        with locked(sqlite_url, "EXCLUSIVE"):
            async with anyio.create_task_group() as group:
                group.start_soon(stalls.watch)
                await anyio.sleep(0.05)
                with pytest.raises(StoreError):
                    await store.claim("", "k", "f", ttl=60, lease=60)
                group.cancel_scope.cancel()
    finally:
        await store.aclose()
    assert stalls.longest < 0.3


@pytest.mark.parametrize(
    ("options", "mode", "synchronous"),
    [
        ({}, "wal", 2),
        ({"sqlite_synchronous": "NORMAL"}, "wal", 1),
        ({"sqlite_wal": False}, "delete", 2),
    ],
)
async def test_a_file_is_switched_to_wal_and_synced_in_full_unless_asked_otherwise(
    tmp_path: Path, options: dict[str, Any], mode: str, synchronous: int
) -> None:
    path = tmp_path / "idempotency.db"
    store = await fresh_sql_store(f"sqlite:///{path}", **options)
    try:
        token = (await store.claim("", "k", "f", ttl=60, lease=60)).token
        assert token is not None
        assert await store.complete("", "k", token, None, ttl=60)
        # The level the store's connections commit with (2: FULL, 1: NORMAL), and how long
        # they wait for another's lock: 0.9 of the operation timeout.
        async with store.engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == synchronous
            assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar() == 9000
    finally:
        await store.aclose()
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == mode


async def test_a_store_opening_a_file_that_another_process_writes_waits_to_switch_it_to_wal(
    tmp_path: Path,
) -> None:
    """On a file not yet in WAL, SQLite fails the switch at once while another connection
    writes (its busy timeout does not apply there), as when several processes open a new
    file together: the store tries again until the writer is done, within its deadline."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    # The table only, as a migration leaves it: the file is still in its default mode.
    await (await fresh_sql_store(url, sqlite_wal=False)).aclose()
    store = SQLStore(url)
    outcomes: list[ClaimOutcome] = []

    async def claim() -> None:
        outcomes.append((await store.claim("", "k", "f", ttl=60, lease=60)).outcome)

    try:
        async with anyio.create_task_group() as group:
            with locked(url, "IMMEDIATE"):
                group.start_soon(claim)
                await anyio.sleep(0.3)
                assert outcomes == []  # still waiting for the writer
        await claim()
        assert outcomes == [ClaimOutcome.ACQUIRED, ClaimOutcome.IN_PROGRESS]
    finally:
        await store.aclose()
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_normal_sync_outside_wal_is_refused(tmp_path: Path) -> None:
    # In a rollback journal, synchronous=NORMAL can corrupt the file on a power cut.
    with pytest.raises(ConfigurationError, match="needs WAL"):
        SQLStore(f"sqlite:///{tmp_path / 'i.db'}", sqlite_wal=False, sqlite_synchronous="NORMAL")


@pytest.mark.parametrize("level", ["OFF", "full", "EXTRA; DROP TABLE idempotency_records"])
def test_a_sync_level_other_than_full_or_normal_is_refused(tmp_path: Path, level: str) -> None:
    with pytest.raises(ConfigurationError, match="'FULL' or 'NORMAL'"):
        SQLStore(f"sqlite:///{tmp_path / 'i.db'}", sqlite_synchronous=level)  # type: ignore[arg-type]


async def test_wal_and_sync_levels_are_refused_where_they_mean_nothing(tmp_path: Path) -> None:
    # An engine of the application's own is used as it is: its PRAGMAs are the application's.
    engine = create_async_engine(async_url(f"sqlite:///{tmp_path / 'i.db'}"))
    for database in (POSTGRESQL_URL, "sqlite://", "sqlite:///:memory:", engine):
        await SQLStore(database).aclose()  # the defaults apply to SQLite files only
        for options in ({"sqlite_wal": True}, {"sqlite_synchronous": "NORMAL"}):
            with pytest.raises(ConfigurationError, match="SQLite file URL only"):
                SQLStore(database, **options)
    await engine.dispose()


async def test_every_connection_of_the_pool_is_prepared(sqlite_url: str) -> None:
    # Concurrent calls open several connections: each is in WAL, FULL, with its busy timeout.
    store = SQLStore(sqlite_url, operation_timeout=2)

    async def claim(key: str) -> None:
        assert (await store.claim("", key, "f", ttl=60, lease=60)).token

    try:
        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(claim, f"k{n}")
        async with store.engine.connect() as a, store.engine.connect() as b:
            for conn in (a, b):
                assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
                assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == 2
                assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar() == 1800
    finally:
        await store.aclose()


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
async def test_the_wal_restarts_under_steady_load(
    sqlite_url: str, synchronous: Synchronous
) -> None:
    # SQLite checkpoints the WAL as commits go on, here every 100 pages (400 kB). Were readers
    # of the pool's other connections to keep every checkpoint from letting the WAL restart, it
    # would keep growing: 14 MB here. (A loaded machine lets a few checkpoints go by.)
    response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}" * 100)
    store = SQLStore(sqlite_url, sqlite_synchronous=synchronous)

    @event.listens_for(store.engine.sync_engine, "connect")
    def checkpoint_often(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.cursor().execute("PRAGMA wal_autocheckpoint=100")

    async def first_request(key: str) -> None:
        claim = await store.claim("", key, "f", ttl=60, lease=60)
        assert claim.token is not None
        assert await store.complete("", key, claim.token, response, ttl=60)

    try:
        for batch in range(60):  # ten at a time, on several connections
            async with anyio.create_task_group() as group:
                for request in range(10):
                    group.start_soon(first_request, f"k{batch}-{request}")
        assert wal_bytes(sqlite_url) < 4_000_000
    finally:
        await store.aclose()
    assert records_in(sqlite_url) == 600


#: How much later than beside Redis the ticker may run beside SQLite (seconds, p90).
MARGIN = 0.001


async def lateness_beside_first_requests(store: Store, seconds: float = 0.3) -> float:
    """How late (p90, seconds) a 1 ms ticker runs while keyed first requests (a claim and a
    completion each) run one after another on ``store`` for ``seconds``."""
    late: list[float] = []
    response = StoredResponse(201, ((b"content-type", b"application/json"),), b"{}")

    async def tick() -> None:
        while True:
            before = time.perf_counter()
            await anyio.sleep(0.001)
            late.append(time.perf_counter() - before - 0.001)

    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        ends = time.monotonic() + seconds
        while time.monotonic() < ends or len(late) < 100:
            key = uuid.uuid4().hex
            claim = await store.claim("", key, "f", ttl=60, lease=60)
            assert claim.token is not None
            assert await store.complete("", key, claim.token, response, ttl=60)
            # A server's requests are tasks of their own, which the loop switches between.
            await anyio.lowlevel.checkpoint()
        group.cancel_scope.cancel()
    return statistics.quantiles(late, n=10)[8]


@pytest.mark.servers
async def test_first_requests_hold_the_event_loop_no_longer_than_on_redis(
    sqlite_url: str, request: pytest.FixtureRequest
) -> None:
    # A commit in FULL (the default) waits for two fsyncs: on the event loop, every other task
    # of the worker would wait with it. Rounds alternate, and each store keeps its best: other
    # processes (the suite's other workers, a busy disk) only ever make the ticker later, so
    # rounds go on until the best of SQLite is within the margin, ten at most.
    sqlite_store = SQLStore(sqlite_url)
    on_sqlite = on_redis = math.inf
    try:
        async with built_store("redis-url", request) as redis_store:
            for _ in range(10):
                on_redis = min(on_redis, await lateness_beside_first_requests(redis_store))
                on_sqlite = min(on_sqlite, await lateness_beside_first_requests(sqlite_store))
                if on_sqlite <= on_redis + MARGIN:
                    break
    finally:
        await sqlite_store.aclose()
    # Beside Redis the ticker shows what the machine's scheduling costs. What the loop still
    # does per request on SQLite (its reads, the hops to the thread) fits in the margin; the
    # two fsyncs of a commit held on the loop would not.
    assert on_sqlite <= on_redis + MARGIN


async def test_closing_never_waits_for_the_connections_threads_on_the_event_loop(
    sqlite_url: str,
) -> None:
    # Claims wait in their connections' threads for a lock another connection holds, one begun
    # before the close and one after it: the close must not hold the loop while they wait.
    store = SQLStore(sqlite_url, operation_timeout=1)
    await store.claim("", "warm", "f", ttl=60, lease=60)
    stalls = Stalls()

    async def claim_fails(key: str) -> None:
        with pytest.raises(StoreError):
            await store.claim("", key, "f", ttl=60, lease=60)

    with locked(sqlite_url, "IMMEDIATE"):
        async with anyio.create_task_group() as group:
            group.start_soon(stalls.watch)
            group.start_soon(claim_fails, "before")
            await anyio.sleep(0.05)
            async with anyio.create_task_group() as closing:
                closing.start_soon(store.aclose)
                await anyio.sleep(0.6)  # the close still waits behind the first claim
                closing.start_soon(claim_fails, "after")
            group.cancel_scope.cancel()
    await store.aclose()
    assert stalls.longest < 0.3
    # The close waited for the claims under way to give their connections back, and closed
    # them: none is left for the collector (aiosqlite would warn).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
