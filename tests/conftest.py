"""Shared fixtures: every database-backed test runs on SQLite, PostgreSQL and MariaDB.

Tests against a server skip when it is not reachable, unless IDEMPOTENCY_REQUIRE_SERVERS=1
(set by .ci/run), which turns a missing server into a failure.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import RedisStore, SQLStore, Store
from idempotency_mw.stores.schema import metadata
from idempotency_mw.stores.sql import async_url
from tests.client_support import FakeTime, Server, sqlite_store_at

REQUIRE_SERVERS = os.environ.get("IDEMPOTENCY_REQUIRE_SERVERS") == "1"

POSTGRESQL_URL = os.environ.get(
    "IDEMPOTENCY_TEST_POSTGRESQL_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get("IDEMPOTENCY_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

SERVER_DATABASES = {"postgresql": POSTGRESQL_URL, "mariadb": MARIADB_URL}
DATABASES = ["sqlite", *SERVER_DATABASES]


def require_server(url: str) -> None:
    """Skip (or, in CI, fail) when the server behind ``url`` does not accept connections."""
    parsed = async_url(url) if not url.startswith("redis") else None
    host = parsed.host if parsed else "127.0.0.1"
    port = parsed.port if parsed else int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        socket.create_connection((host or "127.0.0.1", port or 0), timeout=2).close()
    except OSError:
        message = f"no server at {host}:{port}"
        if REQUIRE_SERVERS:
            pytest.fail(message + " (IDEMPOTENCY_REQUIRE_SERVERS=1)")
        pytest.skip(message)


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


async def fresh_sql_store(url: str) -> SQLStore:
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
    return SQLStore(url)


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


STORES = [*DATABASES, "redis"]


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """Every store the library ships, empty: the contract suite runs on each."""
    name: str = request.param
    if name == "redis":
        require_server(REDIS_URL)
        redis_store = RedisStore(REDIS_URL, prefix=f"test-idem-{uuid.uuid4().hex}:")
        yield redis_store
        keys = [k async for k in redis_store.client.scan_iter(match=f"{redis_store.prefix}*")]
        if keys:
            await redis_store.client.delete(*keys)
        await redis_store.aclose()
        return
    if name == "sqlite":
        url = f"sqlite:///{tmp_path / 'idempotency.db'}"
    else:
        url = SERVER_DATABASES[name]
        require_server(url)
    made = await fresh_sql_store(url)
    yield made
    await made.aclose()


# --- The client's tests (tests/client_support.py holds what they build on) -------------------


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
