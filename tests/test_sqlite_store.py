"""SQLStore on a SQLite file: locks held by other connections, the first connection, WAL."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import anyio
import pytest

from idempotency_mw import ConfigurationError, SQLStore, StoreError
from tests.conftest import POSTGRESQL_URL, fresh_sql_store

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


def records_in(url: str) -> int:
    with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
        return int(db.execute("SELECT COUNT(*) FROM idempotency_records").fetchone()[0])


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


async def test_the_first_connection_never_blocks_the_event_loop(sqlite_url: str) -> None:
    store = SQLStore(sqlite_url, operation_timeout=1)
    longest_stall = 0.0

    async def tick() -> None:
        nonlocal longest_stall
        while True:
            before = time.monotonic()
            await anyio.sleep(0.01)
            longest_stall = max(longest_stall, time.monotonic() - before)

    try:
        with locked(sqlite_url, "EXCLUSIVE"):
            async with anyio.create_task_group() as group:
                group.start_soon(tick)
                await anyio.sleep(0.05)
                with pytest.raises(StoreError):
                    await store.claim("", "k", "f", ttl=60, lease=60)
                group.cancel_scope.cancel()
    finally:
        await store.aclose()
    assert longest_stall < 0.3


async def test_the_journal_mode_is_the_files_own_unless_wal_is_asked_for(
    sqlite_url: str,
) -> None:
    def journal_mode() -> str:
        with closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as db:
            return str(db.execute("PRAGMA journal_mode").fetchone()[0])

    for options, mode in (({}, "delete"), ({"sqlite_wal": True}, "wal")):
        store = SQLStore(sqlite_url, **options)
        try:
            await store.startup()
            assert (await store.claim("", f"k{mode}", "f", ttl=60, lease=60)).token
        finally:
            await store.aclose()
        assert journal_mode() == mode


def test_wal_is_refused_where_it_means_nothing() -> None:
    for url in (POSTGRESQL_URL, "sqlite://", "sqlite:///:memory:"):
        with pytest.raises(ConfigurationError, match="sqlite_wal"):
            SQLStore(url, sqlite_wal=True)
