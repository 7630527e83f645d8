"""A SQLite file's connections as SQLStore's engine opens them: WAL, the sync level, how long to
wait for another's lock. aiosqlite runs every statement in a thread of the connection's own, so
the event loop never waits for the disk or for a lock."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any, Literal

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from idempotency_mw._backoff import Backoff
from idempotency_mw.values.exceptions import ConfigurationError

#: SQLite's sync level for the store's connections.
Synchronous = Literal["FULL", "NORMAL"]
#: The longest wait for another connection's lock (seconds).
LONGEST_BUSY_WAIT = 30.0
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
#: Pauses between tries to switch a file to WAL while another connection holds it.
_WAL_SWITCH_RETRY = Backoff(first=0.001, cap=0.05)


def check_options(wal: bool | None, synchronous: Synchronous, *, sqlite_file: bool) -> None:
    """Refuse ``sqlite_wal`` and ``sqlite_synchronous`` where they mean nothing or are unsafe."""
    if synchronous not in ("FULL", "NORMAL"):
        raise ConfigurationError("sqlite_synchronous must be 'FULL' or 'NORMAL'")
    if not sqlite_file:
        if wal or synchronous != "FULL":
            raise ConfigurationError(
                "sqlite_wal=True and sqlite_synchronous apply to a SQLite file URL only"
            )
    elif synchronous == "NORMAL" and wal is False:
        # Outside WAL, NORMAL can corrupt the file on a power cut.
        raise ConfigurationError("sqlite_synchronous='NORMAL' needs WAL (sqlite_wal=False)")


def prepare_connections(
    engine: AsyncEngine, *, wal: bool, synchronous: Synchronous, busy: float
) -> None:
    """Have each new connection of ``engine`` (aiosqlite) wait ``busy`` seconds at most for a
    lock, put the file in WAL if ``wal`` (else leave its journal mode as it is), and commit at
    ``synchronous`` (``FULL``: a commit survives a power cut)."""
    busy = min(busy, LONGEST_BUSY_WAIT)

    @event.listens_for(engine.sync_engine, "connect")
    def prepare(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.run_async(lambda connection: _prepare(connection, wal, synchronous, busy))


async def _prepare(connection: Any, wal: bool, synchronous: Synchronous, busy: float) -> None:
    await connection.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
    if wal:
        await _switch_to_wal(connection, time.monotonic() + busy)
    await connection.execute(f"PRAGMA synchronous={synchronous}")


async def _switch_to_wal(connection: Any, deadline: float) -> None:
    """Put the file in WAL, retrying until ``deadline`` while another connection holds a lock:
    SQLite fails the switch at once then (its busy timeout does not apply), as when several
    processes open a new file together."""
    attempt = 0
    while True:
        try:
            await connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            left = deadline - time.monotonic()
            if exc.sqlite_errorcode & 0xFF not in _BUSY or left <= 0:
                raise
        await asyncio.sleep(_WAL_SWITCH_RETRY.delay(attempt, limit=left))
        attempt += 1
