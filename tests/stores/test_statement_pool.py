"""The PostgreSQL store's own connection pool, on a real server: which connections it keeps."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy import func, select

from idempotency_mw.stores.sql.drivers import async_url, statement_pool
from idempotency_mw.stores.sql.drivers.postgresql import AsyncpgDriver
from idempotency_mw.stores.sql.drivers.statement_pool import StatementPool
from tests.conftest import POSTGRESQL_URL, require_server

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

PID = "SELECT pg_backend_pid()"


@pytest.fixture
async def observer() -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own, to see the server's backends."""
    require_server(POSTGRESQL_URL)
    connection = await asyncpg.connect(POSTGRESQL_URL)
    yield connection
    await connection.close()


def pool_of(**options: float) -> StatementPool:
    return StatementPool(lambda: asyncpg.connect(POSTGRESQL_URL), **options)  # type: ignore[arg-type]


async def pid(pool: StatementPool, sleep: float = 0) -> int:
    rows = await pool.fetch("SELECT pg_backend_pid(), pg_sleep($1)", (sleep,))
    return int(rows[0][0])


async def live(observer: asyncpg.Connection, pids: set[int], *, within: float = 5) -> set[int]:
    """Which of ``pids`` the server still has, once those going away have gone."""
    deadline = time.monotonic() + within
    while True:
        rows = await observer.fetch(
            "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1::int[])", list(pids)
        )
        found = {int(row[0]) for row in rows}
        if not found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_a_connection_is_reused_after_the_server_answers_with_an_error() -> None:
    pool = pool_of()
    first = await pid(pool)
    with pytest.raises(asyncpg.DivisionByZeroError):
        await pool.execute("SELECT 1 / $1::int", (0,))
    assert await pid(pool) == first
    await pool.aclose()


async def test_an_interrupted_statement_ends_its_connection(observer: asyncpg.Connection) -> None:
    pool = pool_of()
    busy = await pid(pool)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await pool.fetch("SELECT pg_sleep(30)", ())
    # The next statement gets a connection that is not busy with the one cut short.
    assert await pid(pool) != busy
    assert await live(observer, {busy}) == set()
    await pool.aclose()


async def test_no_more_than_max_size_connections_are_open_at_once() -> None:
    pool = pool_of(max_size=2)
    pids = await asyncio.gather(*(pid(pool, sleep=0.1) for _ in range(6)))
    assert len(set(pids)) == 2
    await pool.aclose()


async def test_a_connection_idle_past_max_idle_is_closed(observer: asyncpg.Connection) -> None:
    pool = pool_of(max_size=2, max_idle=0.5)
    pair = set(await asyncio.gather(pid(pool, sleep=0.1), pid(pool, sleep=0.1)))
    assert len(pair) == 2
    # Statements one at a time use the most recent connection; the other idles past max_idle.
    used = set()
    ends = time.monotonic() + 1.0
    while time.monotonic() < ends:
        used.add(await pid(pool))
        await asyncio.sleep(0.05)
    assert len(used) == 1
    assert await live(observer, pair - used) == set()
    assert await live(observer, used, within=0) == used
    # With no traffic at all, the most recent one is closed too once it idled past max_idle.
    await asyncio.sleep(0.6)
    assert await live(observer, used) == set()
    assert await pid(pool) not in pair
    await pool.aclose()


async def test_closing_the_pool_closes_idle_connections_and_those_in_use_when_done(
    observer: asyncpg.Connection,
) -> None:
    pool = pool_of()
    idle = set(await asyncio.gather(pid(pool, sleep=0.1), pid(pool, sleep=0.1)))
    in_use = asyncio.ensure_future(pid(pool, sleep=0.3))
    await asyncio.sleep(0.1)
    await pool.aclose()
    assert await live(observer, idle) == set()
    last = await in_use  # the statement under way ends normally
    assert await live(observer, {last}) == set()
    with pytest.raises(ConnectionError):
        await pid(pool)


async def test_closing_the_driver_waits_for_the_pool_it_left_in_another_running_loop() -> None:
    require_server(POSTGRESQL_URL)
    driver = AsyncpgDriver(async_url(POSTGRESQL_URL))
    backend_pid = select(func.pg_backend_pid())
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever)
    thread.start()
    try:
        used = asyncio.run_coroutine_threadsafe(
            driver.fetch(backend_pid, {}, deadline=math.inf), other
        )
        used.result(timeout=10)
        left = [connection for connection, _ in driver._pool.durable._idle]
        assert left
        # The other loop is busy for a while: its pool closes there only afterwards.
        other.call_soon_threadsafe(time.sleep, 0.3)
        await driver.fetch(backend_pid, {}, deadline=math.inf)  # a pool of this loop's own
        await driver.aclose()
        assert all(connection.is_closed() for connection in left)
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join()
        other.close()


def test_a_statement_running_when_its_event_loop_shuts_down_leaves_nothing_open() -> None:
    # asyncio.run cancels the tasks still running, then closes the loop: the statement's
    # connection (and any asyncpg would open to cancel it) must be closed by then.
    require_server(POSTGRESQL_URL)

    async def leave_a_statement_running() -> None:
        pool = pool_of()
        asyncio.get_running_loop().create_task(pid(pool, sleep=5))
        await asyncio.sleep(0.3)  # the statement runs on the server

    asyncio.run(leave_a_statement_running())
    gc.collect()  # what was left open warns here (an error in this suite)


async def test_a_server_that_refuses_the_client_check_still_runs_statements(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # PostgreSQL on a platform without the check refuses any value but 0; an invalid value
    # is refused the same way here.
    monkeypatch.setattr(statement_pool, "CHECK_CLIENT_EVERY", -1)
    pool = pool_of()
    try:
        # Two connections at once: the refusal is said once for the pool.
        pids = await asyncio.gather(pid(pool, sleep=0.1), pid(pool, sleep=0.1))
        assert len(set(pids)) == 2
    finally:
        await pool.aclose()
    refusals = [r for r in caplog.records if "client_connection_check_interval" in r.message]
    assert len(refusals) == 1
