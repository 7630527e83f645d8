"""SQLStore on SQLAlchemy's engine: the options of a URL reach the driver, an engine given is
the application's, and a dropped connection costs no request."""

from __future__ import annotations

import asyncio
import gc
import re
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import asyncpg
import pytest
from sqlalchemy import event, update
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import ClaimOutcome, ConfigurationError, SQLStore, StoredResponse, StoreError
from idempotency_mw.stores.checks import check_store
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.database import engine_for
from idempotency_mw.stores.sql.direct import Direct
from idempotency_mw.stores.sql.schema import records
from tests.conftest import (
    DATABASES,
    MARIADB_URL,
    POSTGRESQL_URL,
    REQUIRE_SERVERS,
    SERVER_DATABASES,
    fresh_sql_store,
    require_server,
)
from tests.support.pgbouncer import PROGRAM, pgbouncer

pytestmark = pytest.mark.anyio

RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id": 1}')


async def first_and_replay(store: SQLStore) -> None:
    """A first request's claim and completion, then its replay."""
    key = uuid.uuid4().hex
    claim = await store.claim("", key, "f", ttl=60, lease=60)
    assert claim.token is not None
    assert await store.complete("", key, claim.token, RESPONSE, ttl=60)
    replay = await store.claim("", key, "f", ttl=60, lease=60)
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.response == RESPONSE


@pytest.fixture
async def postgresql() -> AsyncIterator[asyncpg.Connection]:
    """A connection of the test's own to the run's PostgreSQL database, its table empty."""
    require_server(POSTGRESQL_URL)
    await (await fresh_sql_store(POSTGRESQL_URL)).aclose()
    connection = await asyncpg.connect(POSTGRESQL_URL)
    yield connection
    await connection.close()


@pytest.mark.parametrize(
    ("options", "kept"), [("", True), ("&prepared_statement_cache_size=0", False)]
)
async def test_prepared_statements_stay_on_the_connections_unless_the_url_turns_them_off(
    postgresql: asyncpg.Connection, options: str, kept: bool
) -> None:
    # PgBouncer in transaction mode hands a session's statements to other clients: with
    # prepared_statement_cache_size=0 neither SQLAlchemy nor asyncpg keeps named statements.
    async with named_store(options) as (store, _):
        await first_and_replay(store)
        async with store.engine.connect() as conn:
            count = "SELECT count(*) FROM pg_prepared_statements"
            assert bool((await conn.exec_driver_sql(count)).scalar()) is kept


async def test_a_pgbouncer_url_runs_and_names_its_connections(
    postgresql: asyncpg.Connection,
) -> None:
    # PgBouncer in transaction mode: no prepared statements kept per connection. The name
    # shows where the store's connections come from, on the server itself.
    async with named_store("&prepared_statement_cache_size=0") as (store, name):
        for _ in range(3):
            await first_and_replay(store)
        assert await on_the_server(postgresql, "count(*)", name) >= 1
    assert "prepared_statement_cache_size=0" in repr(store)


@pytest.fixture
def through_pgbouncer(postgresql: asyncpg.Connection) -> Iterator[str]:
    """The run's PostgreSQL database, its table empty, through a PgBouncer in transaction mode."""
    if PROGRAM is None:
        if REQUIRE_SERVERS:
            pytest.fail("pgbouncer is needed (IDEMPOTENCY_REQUIRE_SERVERS=1)")
        pytest.skip("pgbouncer is not installed")
    with pgbouncer(POSTGRESQL_URL) as url:
        yield url


async def test_behind_pgbouncer_in_transaction_mode_on_psycopg_without_prepared_statements(
    through_pgbouncer: str,
) -> None:
    # The docs' recipe (stores/sql.md): PgBouncer in transaction mode hands each statement
    # outside a transaction to any of its server connections, so a statement prepared on one is
    # not there on the next; psycopg without prepared statements sends each one whole.
    engine = create_async_engine(
        async_url(through_pgbouncer).set(drivername="postgresql+psycopg"),
        connect_args={"prepare_threshold": None},
    )
    store = SQLStore(engine)
    try:
        for _ in range(3):  # more requests at once than PgBouncer has server connections
            async with anyio.create_task_group() as requests:
                for _ in range(20):
                    requests.start_soon(first_and_replay, store)
    finally:
        await store.aclose()
        await engine.dispose()


@asynccontextmanager
async def named_store(options: str = "") -> AsyncIterator[tuple[SQLStore, str]]:
    """A store on the run's PostgreSQL database (and more URL ``options``), and the name its
    connections show on the server (``application_name``); closed after the block."""
    name = f"idempotency-test-{uuid.uuid4().hex[:8]}"
    store = SQLStore(f"{POSTGRESQL_URL}?application_name={name}{options}")
    try:
        yield store, name
    finally:
        await store.aclose()


async def on_the_server(postgresql: asyncpg.Connection, what: str, name: str) -> int:
    """``what`` (an aggregate) of the server's connections named ``name``."""
    found: int = await postgresql.fetchval(
        f"SELECT {what} FROM pg_stat_activity WHERE application_name = $1", name
    )
    return found


@pytest.mark.parametrize(
    ("driver", "option"),
    [("asyncpg", "ssl"), ("asyncpg", "sslmode"), ("psycopg", "sslmode")],
    ids=["asyncpg-ssl", "asyncpg-sslmode", "psycopg-sslmode"],
)
async def test_tls_options_reach_the_driver(
    postgresql: asyncpg.Connection, driver: str, option: str
) -> None:
    # The test server has no TLS: "require" fails (the option reached the driver), "prefer"
    # falls back to a plain connection.
    url = async_url(POSTGRESQL_URL).set(drivername=f"postgresql+{driver}")
    refused = SQLStore(url.update_query_dict({option: "require"}), operation_timeout=5)
    try:
        with pytest.raises(StoreError, match=r"(?i)ssl"):
            await refused.claim("", "k", "f", ttl=60, lease=60)
    finally:
        await refused.aclose()
    plain = SQLStore(url.update_query_dict({option: "prefer"}))
    try:
        await first_and_replay(plain)
    finally:
        await plain.aclose()


@pytest.fixture(params=DATABASES)
async def own_engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    """An engine of the application's own, on an empty table."""
    if request.param == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'idempotency.db'}"
    else:
        url = SERVER_DATABASES[request.param]
        require_server(url)
    await (await fresh_sql_store(url)).aclose()
    engine = create_async_engine(async_url(url))
    yield engine
    await engine.dispose()


async def test_an_engine_given_is_used_as_it_is_and_never_disposed(
    own_engine: AsyncEngine,
) -> None:
    pool = own_engine.pool
    sent: list[str] = []

    @event.listens_for(own_engine.sync_engine, "before_cursor_execute")
    def saw(conn: object, cursor: object, statement: str, *_: object) -> None:
        sent.append(statement)

    store = SQLStore(own_engine)
    assert store.engine is own_engine
    await first_and_replay(store)
    await store.aclose()
    # The store's statements went through the application's engine, whose pool is still the
    # one it had (a dispose replaces it).
    assert len(sent) >= 3
    assert own_engine.pool is pool
    async with own_engine.connect() as conn:
        assert (await conn.exec_driver_sql("SELECT 1")).scalar() == 1


async def test_an_owned_engine_is_disposed_and_opens_again_when_used(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/idempotency.db"
    store = await fresh_sql_store(url)
    await first_and_replay(store)
    assert store.engine.pool.checkedin() >= 1  # type: ignore[attr-defined]
    await store.aclose()
    assert store.engine.pool.checkedin() == 0  # type: ignore[attr-defined]
    await first_and_replay(store)
    await store.aclose()


async def test_a_connection_the_server_dropped_costs_no_request(
    postgresql: asyncpg.Connection,
) -> None:
    # The server ends every pooled connection of the store (a restart, an idle timeout), and
    # the store does not notice until it uses one: the statement runs again on a new one, and
    # the other connections pooled before it are replaced too.
    async with named_store() as (store, name):
        await asyncio.gather(*(first_and_replay(store) for _ in range(4)))
        ended = await on_the_server(postgresql, "count(pg_terminate_backend(pid))", name)
        assert ended >= 2
        for _ in range(4):
            await first_and_replay(store)


@pytest.fixture
async def url_store(database_url: str) -> AsyncIterator[SQLStore]:
    """A store made from a URL, on an empty table, with a short operation timeout."""
    store = await fresh_sql_store(database_url, operation_timeout=0.5)
    yield store
    await store.aclose()


async def test_a_url_store_runs_a_request_on_its_pools_driver_connections(
    url_store: SQLStore,
) -> None:
    # The documented trade: SQLAlchemy's statement events (and the instrumentation built on
    # them) do not see a request's statements; the pool's events still see every connection.
    engine = url_store.engine.sync_engine
    sent: list[str] = []
    taken: list[object] = []
    event.listen(engine, "before_cursor_execute", lambda *args: sent.append(args[2]))
    event.listen(engine, "checkout", lambda *args: taken.append(args[0]))
    await first_and_replay(url_store)
    assert sent == []
    assert len(taken) >= 3
    assert url_store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


async def test_more_calls_at_once_than_the_pool_holds_wait_for_its_connections(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The pool opens no connection beyond its size: one would be closed on its way back, and
    # the direct path gives connections back outside SQLAlchemy's greenlet, where a close
    # cannot wait for the driver (it would fail, and leave the connection to the collector).
    store = await fresh_sql_store(database_url)
    pool = store.engine.pool
    size = pool.size()  # type: ignore[attr-defined]
    await asyncio.gather(*(first_and_replay(store) for _ in range(size + 4)))
    assert pool.checkedin() <= size  # type: ignore[attr-defined]
    await store.aclose()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy")] == []


@asynccontextmanager
async def record_held(url: str, key: str) -> AsyncIterator[None]:
    """Another session holds ``key``'s record (its row; SQLite's whole file) until exit."""
    engine = create_async_engine(async_url(url))
    try:
        async with engine.begin() as conn:
            await conn.execute(
                update(records).where(records.c.key == key).values(token=records.c.token)
            )
            yield
    finally:
        await engine.dispose()


async def test_a_statement_cancelled_midway_gives_its_connection_up(
    url_store: SQLStore, database_url: str
) -> None:
    claim = await url_store.claim("", "k", "f", ttl=60, lease=60)
    assert claim.token is not None
    engine = url_store.engine
    invalidated: list[object] = []
    event.listen(engine.sync_engine, "invalidate", lambda *args: invalidated.append(args[0]))
    async with record_held(database_url, "k"):
        # The completion waits for the record, and the store stops waiting for it.
        with pytest.raises(StoreError):
            await url_store.complete("", "k", claim.token, RESPONSE, ttl=60)
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        if not database_url.startswith("sqlite"):
            # Its connection, still busy with the statement, never went back to the pool.
            # (SQLite refuses the statement itself once its wait for the lock, a share of the
            # operation's time, ends: that connection is as good as before.)
            assert invalidated
    assert await url_store.complete("", "k", claim.token, RESPONSE, ttl=60)
    for _ in range(3):
        await first_and_replay(url_store)
    await url_store.aclose()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


async def test_closing_waits_for_a_call_between_two_of_its_statements(database_url: str) -> None:
    # A release that finds no claim of its token runs two statements; the close, asked for
    # while the first runs, resumes as the second has taken its connection. Disposing of the
    # engine then would leave that connection out of every pool, to the collector (which
    # warns in whichever later test it runs).
    store = await fresh_sql_store(database_url)
    await first_and_replay(store)
    release = asyncio.create_task(store.release("", "absent", "not-a-token"))
    await asyncio.sleep(0)
    await store.aclose()
    assert await release is False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


@pytest.mark.parametrize(
    ("option", "refusal"),
    [
        ("no_such_parameter=1", 'unrecognized configuration parameter "no_such_parameter"'),
        ("statement_timeout=soon", 'invalid value for parameter "statement_timeout"'),
    ],
    ids=["unknown", "invalid"],
)
async def test_a_setting_the_server_refuses_fails_the_start_up(
    postgresql: asyncpg.Connection, option: str, refusal: str
) -> None:
    # It would fail every connection however long the service waited: not a store that is
    # down for now (a warning at start-up, then 503 to every keyed request).
    store = SQLStore(f"{POSTGRESQL_URL}?{option}", operation_timeout=5)
    try:
        with pytest.raises(ConfigurationError, match=re.escape(refusal)):
            await check_store(store)
    finally:
        await store.aclose()


async def test_a_url_option_asyncmy_does_not_take_is_refused_when_the_store_is_made() -> None:
    with pytest.raises(ConfigurationError, match="asyncmy does not take the URL option"):
        SQLStore(f"{MARIADB_URL}?conect_timeout=5")
    # Those it takes, as SQLAlchemy hands them over, pass.
    await SQLStore(f"{MARIADB_URL}?charset=utf8mb4&connect_timeout=5").aclose()


async def test_a_connection_postgresql_ended_never_goes_back_to_the_pool() -> None:
    # The server's answer to a statement leaves the connection as it was; one that ends the
    # connection (an administrator's shutdown, the server starting up) does not.
    engine = engine_for(POSTGRESQL_URL)
    try:
        direct = Direct.of(engine, [])
        assert direct is not None
        assert direct.keeps_connection(asyncpg.UniqueViolationError("duplicate key"))
        for ended in (
            asyncpg.AdminShutdownError("terminating connection due to administrator command"),
            asyncpg.CannotConnectNowError("the database system is starting up"),
            asyncpg.ConnectionFailureError("connection failure"),
        ):
            assert not direct.keeps_connection(ended), ended
    finally:
        await engine.dispose()
