"""A SQLite file through the standard library's driver: reads on the event loop, commits that
wait for the disk in one worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.expression import Executable

from idempotency_mw._backoff import Backoff
from idempotency_mw.stores.sql.drivers.base import CompileCache, Rows, T

#: SQLite's sync level for the store's connections.
Synchronous = Literal["FULL", "NORMAL"]
#: Changes between two WAL checkpoints, which the worker thread runs.
CHECKPOINT_EVERY = 250
#: Seconds a checkpoint waits for other processes' readers and writers of the file.
_RESTART_WAIT = 0.1
#: Without a deadline in sight, the longest wait for a SQLite lock.
_LONGEST_BUSY_WAIT = 30.0
#: The granularity (seconds) of the waits for a lock: a wait is never longer than asked.
_BUSY_STEP = 0.05
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
#: Pauses between tries to switch a file to WAL while another connection holds it.
_WAL_SWITCH_RETRY = Backoff(first=0.001, cap=_BUSY_STEP)
WalState = Literal["idle", "checkpointing", "restarting"]


class _Worker:
    """One thread and its connection: where statements wait for a lock or for the disk."""

    def __init__(self, connect: Callable[[float], sqlite3.Connection]) -> None:
        self._connect = connect
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="idempotency-mw-sqlite")
        self._connection: sqlite3.Connection | None = None
        #: The connection's busy timeout (ms), set again only when a call needs another.
        self._busy_ms = -1

    async def run(self, operation: Callable[[float], T], deadline: float) -> T:
        """``operation(seconds left before deadline)`` in the thread."""

        def run() -> T:
            return operation(deadline - time.monotonic())

        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    def submit(self, operation: Callable[[], None]) -> None:
        self._executor.submit(operation)

    def execute(self, sql: str, args: tuple[Any, ...], seconds: float) -> sqlite3.Cursor:
        """In the thread: ``sql`` on its connection, waiting ``seconds`` at most for a lock."""
        if self._connection is None:
            self._connection = self._connect(seconds)
        milliseconds = _busy_milliseconds(seconds)
        if milliseconds != self._busy_ms:
            self._connection.execute(f"PRAGMA busy_timeout={milliseconds}")
            self._busy_ms = milliseconds
        return self._connection.execute(sql, args)

    async def aclose(self, also: sqlite3.Connection | None) -> None:
        """Close the connection (and ``also``) once what is queued ran, without waiting for
        the thread on the event loop."""

        def close(_: float) -> None:
            for connection in (self._connection, also):
                if connection is not None:
                    connection.close()
            self._connection = None

        try:
            await self.run(close, time.monotonic())
        finally:
            self._executor.shutdown(wait=False)


class SQLiteDriver:
    """A SQLite file through the standard library's driver.

    Reads run on the event loop itself, on a connection that never waits for a lock (busy
    timeout 0): less than one hop to a thread. Commits that wait for the disk (any write with
    ``synchronous=FULL``, or outside WAL) run in one worker thread, as does a read that finds
    the file locked; there a connection waits for the lock, but only until the call's
    deadline: a statement that could not run in time never runs later. In WAL with
    ``synchronous=NORMAL`` a commit only appends to the WAL, and runs on the loop too, as does
    any write with ``durable=False`` in WAL: the loop's connection is ``NORMAL`` there.
    Connections are opened in the thread, and a WAL checkpoint runs there every
    :data:`CHECKPOINT_EVERY` changes, statements waiting for it (a few milliseconds) so that
    the WAL restarts and stays small; the first commit after it, which syncs the restarted
    WAL, runs there too. ``wal`` switches the file to WAL; otherwise its journal
    mode is left as it is. ``synchronous`` is the connections' sync level (``FULL``: a commit
    survives a power cut).
    """

    errors: tuple[type[Exception], ...] = (sqlite3.Error, SQLAlchemyError)

    def __init__(self, url: URL, *, wal: bool = True, synchronous: Synchronous = "FULL") -> None:
        self.dialect_name = "sqlite"
        self.on_callers_machine = True
        self.url = url
        self._path = url.database or ""
        self._sync_url = url.set(drivername="sqlite+pysqlite")
        self._wal = wal
        self._synchronous = synchronous
        self._writes_wait_for_disk = synchronous == "FULL" or not wal
        self._compile = CompileCache(sqlite.pysqlite.dialect())
        self._loop_connection: sqlite3.Connection | None = None
        self._worker_of_now: _Worker | None = None
        self._changes = 0
        #: "checkpointing" from a checkpoint's start; "restarting" from its end until the next
        #: commit ran (in the thread): in WAL even with NORMAL, that commit syncs the WAL.
        self._wal_state: WalState = "idle"

    @property
    def _worker(self) -> _Worker:
        if self._worker_of_now is None:
            self._worker_of_now = _Worker(self._connect)
        return self._worker_of_now

    def _connect(
        self, busy_seconds: float, synchronous: Synchronous | None = None
    ) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self._path, timeout=0, isolation_level=None, check_same_thread=False
        )
        _busy_wait(connection, busy_seconds)
        if self._wal:
            _switch_to_wal(connection, time.monotonic() + busy_seconds)
        connection.execute(f"PRAGMA synchronous={synchronous or self._synchronous}")
        return connection

    async def _on_loop(self, deadline: float) -> sqlite3.Connection:
        if self._loop_connection is None:

            def connect(seconds: float) -> sqlite3.Connection:
                # Its writes are those that need not wait for the disk: in WAL, NORMAL (the
                # durable ones run in the thread, whose connection syncs the WAL they follow).
                connection = self._connect(seconds, "NORMAL" if self._wal else None)
                _busy_wait(connection, 0)
                # Checkpoints write to disk: the worker thread runs them, never the event loop.
                connection.execute("PRAGMA wal_autocheckpoint=0")
                return connection

            connection = await self._worker.run(connect, deadline)
            if self._loop_connection is None:
                self._loop_connection = connection
            else:  # another call opened one meanwhile
                connection.close()
        return self._loop_connection

    async def _execute(
        self, statement: Executable, params: Mapping[str, Any], deadline: float, durable: bool
    ) -> tuple[Rows, int]:
        compiled = self._compile(statement)
        args = compiled.args(params)
        result: tuple[Rows, int] | None = None
        waits_for_disk = self._writes_wait_for_disk and (durable or not self._wal)
        if self._wal_state == "idle" and not (compiled.writes and waits_for_disk):
            try:
                cursor = (await self._on_loop(deadline)).execute(compiled.sql, args)
                result = cursor.fetchall(), cursor.rowcount
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF not in _BUSY:
                    raise
        if result is None:
            worker = self._worker

            def run(seconds: float) -> tuple[Rows, int]:
                cursor = worker.execute(compiled.sql, args, seconds)
                ran = cursor.fetchall(), cursor.rowcount
                if compiled.writes and self._wal_state == "restarting":
                    self._wal_state = "idle"
                return ran

            result = await worker.run(run, deadline)
        if compiled.writes:
            self._changed()
        return result

    async def fetch(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> Rows:
        return (await self._execute(statement, params, deadline, durable))[0]

    async def change(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> int:
        return (await self._execute(statement, params, deadline, durable))[1]

    def _changed(self) -> None:
        self._changes += 1
        # One checkpoint at a time: on a slow disk they would queue up behind each other.
        if self._changes >= CHECKPOINT_EVERY and self._wal_state == "idle":
            self._changes = 0
            self._wal_state = "checkpointing"
            worker = self._worker
            worker.submit(lambda: self._checkpoint(worker))

    def _checkpoint(self, worker: _Worker) -> None:
        # Meanwhile the store's statements queue up behind this one in the worker thread, so
        # that no commit of ours keeps the checkpoint from finishing: RESTART then has the next
        # commit start the WAL afresh. (Checkpoints that run beside commits never catch up
        # under steady load, and the WAL grows without bound.) Failing means another process
        # is busy with the file; the next round catches up.
        try:
            with contextlib.suppress(sqlite3.Error):
                worker.execute("PRAGMA wal_checkpoint(RESTART)", (), _RESTART_WAIT).fetchall()
        finally:
            self._wal_state = "restarting"

    async def run_sync(self, operation: Callable[[Connection], T], *, deadline: float) -> T:
        def run(seconds: float) -> T:
            engine = create_engine(self._sync_url, poolclass=NullPool)
            event.listen(engine, "connect", lambda conn, _: _busy_wait(conn, seconds))
            try:
                with engine.begin() as conn:
                    return operation(conn)
            finally:
                engine.dispose()

        return await self._worker.run(run, deadline)

    async def aclose(self) -> None:
        """Close both connections in the worker thread (the last to close a WAL file
        checkpoints it); the driver opens new ones if it is used again."""
        worker, self._worker_of_now = self._worker_of_now, None
        loop_connection, self._loop_connection = self._loop_connection, None
        if worker is not None:  # the loop's connection, if any, was opened by a worker
            await worker.aclose(also=loop_connection)


def _busy_wait(connection: Any, seconds: float) -> None:
    """How long ``connection`` waits for another's lock before it fails (SQLITE_BUSY)."""
    connection.execute(f"PRAGMA busy_timeout={_busy_milliseconds(seconds)}")


def _switch_to_wal(connection: sqlite3.Connection, deadline: float) -> None:
    """Put the file in WAL, retrying until ``deadline`` while another connection holds a lock:
    SQLite fails the switch at once then (its busy timeout does not apply), as when several
    processes open a new file together."""
    for attempt in itertools.count():
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            left = deadline - time.monotonic()
            if exc.sqlite_errorcode & 0xFF not in _BUSY or left <= 0:
                raise
            time.sleep(_WAL_SWITCH_RETRY.delay(attempt, limit=left))


def _busy_milliseconds(seconds: float) -> int:
    """``seconds`` of waiting for a lock, rounded down to whole steps: successive calls with
    about as much time left then need no new busy timeout."""
    steps = int(min(seconds, _LONGEST_BUSY_WAIT) / _BUSY_STEP)
    return max(0, steps) * int(_BUSY_STEP * 1000)
