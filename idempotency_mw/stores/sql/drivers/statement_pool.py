"""A small pool of asyncpg connections for statements that each stand alone."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger("idempotency_mw")

#: Seconds a connection has to close politely before it is cut.
_CLOSE_TIMEOUT = 5.0
#: Milliseconds between the server's checks that a connection running a statement is still
#: there (``client_connection_check_interval``).
CHECK_CLIENT_EVERY = 200


class StatementPool:
    """Up to ``max_size`` asyncpg connections, each running one statement at a time.

    The store's statements run in autocommit and set no session state, so a connection goes
    back to the idle list the moment its statement ends: no reset, no proxy and no task per
    release, which asyncpg's own pool spends on every statement (benchmarks/overhead.py puts
    ``driver="native"`` beside ``driver="sqlalchemy"`` in one run).

    A connection whose statement was interrupted (cancelled, timed out) or failed other than by
    the server's answer (``PostgresError``) is never reused: it is cut at once, and the server
    ends the statement within :data:`CHECK_CLIENT_EVERY` (PostgreSQL 14 and later check that
    the client is still there while a statement runs; before 14 it runs to its end). Nothing is
    left running: no cancel request on a second connection, which a stalled server would leave
    hanging, and which an event loop shutting down would leave open.
    Connections idle longer than ``max_idle`` seconds are terminated, as asyncpg's pool does,
    so that a server or proxy that drops idle connections does not fail a statement later: a
    timer watches the oldest idle connection, whether traffic comes or not.
    """

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        *,
        max_size: int = 10,
        max_idle: float = 300.0,
    ) -> None:
        import asyncpg

        self._connect = connect
        self._answered = asyncpg.PostgresError
        self._max_idle = max_idle
        self._slots = asyncio.Semaphore(max_size)
        #: Idle connections, each with when it became idle; the most recent last.
        self._idle: list[tuple[Any, float]] = []
        self._reaper: asyncio.TimerHandle | None = None
        self._closed = False
        #: The server refused the client check (said once).
        self._check_refused = False

    async def fetch(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """The rows of one statement."""
        rows: list[Any] = await self._run("fetch", sql, args)
        return rows

    async def execute(self, sql: str, args: tuple[Any, ...]) -> str:
        """The status of one statement, e.g. ``UPDATE 1``."""
        status: str = await self._run("execute", sql, args)
        return status

    async def _run(self, method: str, sql: str, args: tuple[Any, ...]) -> Any:
        if self._closed:
            raise ConnectionError("the store's connection pool is closed")
        async with self._slots:
            connection = self._take_idle()
            if connection is None:
                connection = await self._open()
            try:
                result = await getattr(connection, method)(sql, *args)
            except self._answered:
                self._give_back(connection)
                raise
            except BaseException:
                connection.terminate()
                raise
            self._give_back(connection)
            return result

    async def _open(self) -> Any:
        """A new connection, whose server ends its statement when it is cut (from 14 on;
        a server that refuses the check, as one on a platform without it does, runs an
        interrupted statement to its end)."""
        connection = await self._connect()
        try:
            if connection.get_server_version().major >= 14:
                await connection.execute(
                    f"SET client_connection_check_interval = '{CHECK_CLIENT_EVERY}ms'"
                )
        except self._answered as exc:
            if not self._check_refused:
                self._check_refused = True
                logger.warning("the server refuses client_connection_check_interval: %s", exc)
        except BaseException:
            connection.terminate()
            raise
        return connection

    def _take_idle(self) -> Any:
        """The most recently used idle connection still open and fresh, or ``None``."""
        stale_before = time.monotonic() - self._max_idle
        while self._idle:
            connection, since = self._idle.pop()
            if not connection.is_closed() and since > stale_before:
                return connection
            connection.terminate()
        return None

    def _give_back(self, connection: Any) -> None:
        if self._closed or connection.is_closed():
            connection.terminate()
            return
        self._idle.append((connection, time.monotonic()))
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().call_later(self._max_idle, self._reap)

    def _reap(self) -> None:
        """Terminate the connections idle past ``max_idle``; watch the oldest of the others."""
        self._reaper = None
        stale_before = time.monotonic() - self._max_idle
        # The least recently used connection is first.
        while self._idle and self._idle[0][1] <= stale_before:
            self._idle.pop(0)[0].terminate()
        if self._idle:
            wait = self._idle[0][1] - stale_before
            self._reaper = asyncio.get_running_loop().call_later(wait, self._reap)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their statement ends."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = self._idle, []
        await asyncio.gather(*(_close(connection) for connection, _ in idle))


async def _close(connection: Any) -> None:
    """Close ``connection`` politely, or abruptly when that fails."""
    try:
        await connection.close(timeout=_CLOSE_TIMEOUT)
    except Exception:
        connection.terminate()
