"""Shared fixtures: every database-backed test runs on SQLite, PostgreSQL and MariaDB.

Tests against a server skip when it is not reachable, unless IDEMPOTENCY_REQUIRE_SERVERS=1
(set by .ci/run), which turns a missing server into a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
import redis
import redis.asyncio
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import RedisStore, SQLStore, Store
from idempotency_mw.client import journal_table, sync_url
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import metadata
from idempotency_mw.testing import MemoryStore
from tests.support.client_support import FakeTime, Server, sqlite_store_at
from tests.support.faults import PostgreSQLServer, RedisServer, StoreServer
from tests.support.redis_servers import RedisCluster, RedisSentinel
from tests.support.scratch import (
    create_run_databases,
    drop_run_databases,
    run_database_url,
    scratch_database,
)

S = TypeVar("S", bound=StoreServer)

REQUIRE_SERVERS = os.environ.get("IDEMPOTENCY_REQUIRE_SERVERS") == "1"

#: Every run makes databases of its own on the servers these variables name (their database
#: is only the one the run connects to for CREATE DATABASE), and drops them when it ends.
RUN_ID = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
SERVER_URLS = {
    "postgresql": os.environ.get(
        "IDEMPOTENCY_TEST_POSTGRESQL_URL", "postgresql://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("IDEMPOTENCY_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test"),
}
POSTGRESQL_URL, MARIADB_URL = (
    run_database_url(url, RUN_ID) for url in (SERVER_URLS["postgresql"], SERVER_URLS["mariadb"])
)
#: Redis keeps the run's keys under prefixes of each test's own, in a database that is not 0.
REDIS_URL = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")


def redis_prefix(name: str) -> str:
    """A Redis key prefix of one test's own on ``REDIS_URL``, named after this run, so that
    the run can check at its end that its tests left no key behind."""
    return f"test-{name}-{RUN_ID}-{uuid.uuid4().hex}:"


def forget_redis_prefix(prefix: str) -> None:
    """Delete the keys under ``prefix`` on ``REDIS_URL`` (what a test's records left)."""
    with redis.Redis.from_url(REDIS_URL) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="session", autouse=True)
def no_redis_keys_left_behind() -> Iterator[None]:
    """Fail the run (this worker's last test) if its tests left keys under their prefixes on
    ``REDIS_URL``: a shared server must not fill up with records that live for a day."""
    yield
    try:
        with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2) as client:
            left = sorted(k.decode() for k in client.scan_iter(match=f"test-*-{RUN_ID}-*"))
            if left:
                client.delete(*left)
    except redis.ConnectionError:
        return  # no server: the tests that needed one skipped (or failed, in CI)
    assert not left, f"the run's tests left {len(left)} Redis keys behind: {left[:10]}"


SERVER_DATABASES = {"postgresql": POSTGRESQL_URL, "mariadb": MARIADB_URL}
DATABASES = ["sqlite", *SERVER_DATABASES]


def require_server(url: str) -> None:
    """Skip (or, in CI, fail) when the server behind ``url`` does not accept connections, or
    when the run could not make its database there (a URL naming a database the server lacks)."""
    if url in RUN_DATABASE_PROBLEMS:
        _missing(RUN_DATABASE_PROBLEMS[url])
    parsed = async_url(url) if not url.startswith("redis") else None
    host = parsed.host if parsed else "127.0.0.1"
    port = parsed.port if parsed else int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        socket.create_connection((host or "127.0.0.1", port or 0), timeout=2).close()
    except OSError:
        _missing(f"no server at {host}:{port}")


def _missing(message: str) -> NoReturn:
    if REQUIRE_SERVERS:
        pytest.fail(message + " (IDEMPOTENCY_REQUIRE_SERVERS=1)")
    pytest.skip(message)


#: Why the run has no database of its own on a server, by the run database's URL.
RUN_DATABASE_PROBLEMS: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    # The run's processes (xdist workers, uvicorn workers, agents, warm forkservers: a hundred
    # and more) import the package and tests.support from source: they keep the bytecode they
    # compile (PYTHONDONTWRITEBYTECODE is set on some machines) instead of each compiling the
    # same modules again. Set here, before the workers start, so that every process inherits it.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_sessionstart(session: pytest.Session) -> None:
    RUN_DATABASE_PROBLEMS.update(create_run_databases(SERVER_URLS.values(), RUN_ID))
    if RUN_DATABASE_PROBLEMS and REQUIRE_SERVERS:
        # CI fails the run at once, with the reason, rather than every test at its setup.
        drop_run_databases(SERVER_URLS.values(), RUN_ID)
        reasons = "; ".join(RUN_DATABASE_PROBLEMS.values())
        pytest.exit(f"{reasons} (IDEMPOTENCY_REQUIRE_SERVERS=1)", returncode=1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    drop_run_databases(SERVER_URLS.values(), RUN_ID)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=DATABASES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL (plain, not async) of each kind; servers are shared between tests."""
    name: str = request.param
    if name == "sqlite":
        yield f"sqlite:///{tmp_path / 'idempotency.db'}"
        return
    url = SERVER_DATABASES[name]
    require_server(url)
    yield url


_REBUILT: set[str] = set()


async def fresh_sql_store(url: str, **options: Any) -> SQLStore:
    """A SQLStore on an empty idempotency table at ``url``.

    A server's table is rebuilt from the model once per session, so a table that an older
    version left behind never stands in for the current one.
    """
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        if url not in _REBUILT:
            await conn.run_sync(metadata.drop_all)
            _REBUILT.add(url)
        await conn.run_sync(metadata.create_all)
        await conn.execute(text("DELETE FROM idempotency_records"))
    await engine.dispose()
    return SQLStore(url, **options)


_JOURNALS_REBUILT: set[str] = set()


def fresh_journal_table(url: str) -> None:
    """Drop a server's client journal table once per session (the journal makes it again), so
    that a table an older version left behind never stands in for the current one."""
    if url in _JOURNALS_REBUILT:
        return
    engine = create_engine(sync_url(url))
    with engine.begin() as conn:
        journal_table.drop(conn, checkfirst=True)
    engine.dispose()
    _JOURNALS_REBUILT.add(url)


@pytest.fixture
def fresh_database(database_url: str) -> Iterator[str]:
    """An empty database of ``database_url``'s kind that no other test uses.

    SQLite's is a file of the test's own; a server's is made with the shared URL's account and
    dropped afterwards, so migrations never race with the tests that use the shared database.
    """
    if database_url.startswith("sqlite"):
        yield database_url
        return
    with scratch_database(database_url, "fresh") as url:
        yield url


@pytest.fixture
async def sql_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine of the test's own on the database of ``database_url``."""
    engine = create_async_engine(async_url(database_url))
    yield engine
    await engine.dispose()


@pytest.fixture
async def sql_store(database_url: str) -> AsyncIterator[SQLStore]:
    """A SQLStore on an empty table, on each database."""
    store = await fresh_sql_store(database_url)
    yield store
    await store.aclose()


@pytest.fixture
async def redis_client() -> AsyncIterator[redis.asyncio.Redis]:
    """A redis-py client of the test's own, to look behind a store's back."""
    require_server(REDIS_URL)
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


def require_redis_server() -> None:
    """Skip (or, in CI, fail) when this machine cannot start Redis servers of the tests' own."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if REQUIRE_SERVERS:
            pytest.fail("redis-server and redis-cli are needed (IDEMPOTENCY_REQUIRE_SERVERS=1)")
        pytest.skip("redis-server and redis-cli are not installed")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A Redis Cluster of the session's own (3 masters, 3 replicas), started on first use."""
    require_redis_server()
    with RedisCluster.start(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    """A Redis master and a Sentinel watching it, the session's own, started on first use."""
    require_redis_server()
    sentinel = RedisSentinel.start(tmp_path_factory.mktemp("redis-sentinel"))
    yield sentinel
    sentinel.stop()


#: Every way a user can build a store: the contract suite runs on each.
STORE_PATHS = [
    *(f"{database}-{how}" for database in DATABASES for how in ("url", "engine")),
    "redis-url",
    "redis-client",
    "redis-cluster-url",
    "redis-cluster-client",
    "redis-sentinel-client",
    "memory",
]


@asynccontextmanager
async def built_store(
    path: str, request: pytest.FixtureRequest, *, settlement_notices: bool = False
) -> AsyncIterator[Store]:
    """An empty store built the way ``path`` names; what the test opened is closed after."""
    backend, _, how = path.partition("-")
    if backend == "memory":
        yield MemoryStore()
        return
    if backend == "redis":
        async with _redis_store(how, request) as made:
            yield made
        return
    if backend == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'idempotency.db'}"
    else:
        url = SERVER_DATABASES[backend]
        require_server(url)
    await (await fresh_sql_store(url)).aclose()
    if how == "url":
        sql_store = SQLStore(url, settlement_notices=settlement_notices)
        yield sql_store
        await sql_store.aclose()
        return
    engine = create_async_engine(async_url(url))
    yield SQLStore(engine, settlement_notices=settlement_notices)
    await engine.dispose()


@asynccontextmanager
async def _redis_store(how: str, request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    prefix = redis_prefix("idem")
    if how == "sentinel-client":
        sentinel: RedisSentinel = request.getfixturevalue("redis_sentinel")
        watcher = redis.asyncio.Sentinel([sentinel.sentinel_address])  # type: ignore[no-untyped-call, unused-ignore]
        master = watcher.master_for(sentinel.name)
        yield RedisStore(client=master, prefix=prefix)
        await master.aclose()
        for client in watcher.sentinels:
            await client.aclose()
        return
    if how.startswith("cluster"):
        # The cluster is the session's own: its keys go with it.
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        if how == "cluster-url":
            made = RedisStore(cluster.url, cluster=True, prefix=prefix)
            yield made
            await made.aclose()
            return
        cluster_client = redis.asyncio.RedisCluster.from_url(cluster.url)
        yield RedisStore(client=cluster_client, prefix=prefix)
        await cluster_client.aclose()
        return
    require_server(REDIS_URL)
    given = redis.asyncio.Redis.from_url(REDIS_URL) if how == "client" else None
    made = (
        RedisStore(REDIS_URL, prefix=prefix)
        if given is None
        else RedisStore(client=given, prefix=prefix)
    )
    yield made
    keys = [k async for k in made.client.scan_iter(match=f"{prefix}*")]
    if keys:
        await made.client.delete(*keys)
    await made.aclose()
    if given is not None:
        await given.aclose()


@pytest.fixture
def store(fake_time: FakeTime) -> MemoryStore:
    """An empty MemoryStore on the test's fake clock, for tests of the middleware's behaviour.

    The contract suite (``tests/contract/test_store_contract.py``) proves that every store
    agrees with it; leases and TTLs move when the test moves ``fake_time.now``, so they need no
    sleeps.
    """
    return MemoryStore(clock=fake_time.clock)


#: The stores that keep records outside the process (what the operator's CLI can open).
PERSISTENT_STORES = [*DATABASES, "redis"]


@pytest.fixture(params=["sqlite-url", "postgresql-url", "redis-url"])
async def backend_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """An empty store on SQLite, PostgreSQL and Redis in turn, made from a URL: for tests of
    what a caller sees on each kind of backend (the contract suite covers every way to build
    one)."""
    async with built_store(request.param, request) as made:
        yield made


# ---------------------------------------------------------------- store servers of the test's own


def _new_server(server_class: Callable[[], S]) -> S:
    """A server of ``server_class``, not started; skips (or, in CI, fails) without its programs."""
    try:
        return server_class()
    except FileNotFoundError as exc:
        _missing(f"no {getattr(server_class, '__name__', 'server')}: {exc}")


@pytest.fixture(scope="session")
def migrated_postgresql_data() -> Iterator[Path]:
    """The data folder of a stopped PostgreSQL cluster, its table made by ``idempotency-mw
    migrate``: what each :func:`own_postgresql` starts from."""
    with _new_server(PostgreSQLServer) as server:
        subprocess.run(
            [sys.executable, "-m", "idempotency_mw.operator.cli", "migrate", "--url", server.url],
            check=True,
            capture_output=True,
            timeout=60,
        )
        server.stop()
        yield server.data


@pytest.fixture
def own_postgresql(migrated_postgresql_data: Path) -> Iterator[PostgreSQLServer]:
    """A PostgreSQL server of the test's own, running, with the idempotency table."""
    with PostgreSQLServer(template=migrated_postgresql_data) as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis server of the test's own, running, empty."""
    with _new_server(RedisServer) as server:
        yield server


@pytest.fixture(params=["postgresql", "redis"])
def own_store(request: pytest.FixtureRequest) -> StoreServer:
    """A PostgreSQL and a Redis server of the test's own, which it may pause, stop and start."""
    server: StoreServer = request.getfixturevalue(f"own_{request.param}")
    return server


# --- The client's tests (tests/support/client_support.py holds what they build on) --------


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLStore]:
    """A SQLStore on a fresh SQLite file."""
    store = await sqlite_store_at(tmp_path / "idem.db")
    yield store
    await store.aclose()


@pytest.fixture
async def server(sqlite_store: SQLStore) -> Server:
    """A Starlette app behind the middleware on :func:`sqlite_store`."""
    return Server(sqlite_store)


@pytest.fixture
def fake_time() -> FakeTime:
    return FakeTime()


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    return tmp_path / "journal.sqlite3"
