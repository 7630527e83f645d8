"""A request's statements on the driver's own connection, for an engine the store made: their
SQL compiled once by SQLAlchemy for the engine's dialect, each run by one call of the driver on
the ``driver_connection`` of a connection taken from the engine's pool.

SQLAlchemy's execution path (a ``Connection``, an execution context, a result, a switch of
greenlet around each driver call; on aiosqlite a thread hop each for the cursor, the execute,
the fetch and the close) costs more than a claim's statement itself on a nearby server. Here a
statement is asyncpg's ``fetch`` or ``execute`` (prepared once per connection by asyncpg's own
statement cache, unnamed when the URL turns prepared statements off), one aiosqlite call, or an
asyncmy cursor.

The connection comes from, and goes back to, the engine's one pool, whose settings and events
still apply (recycling, the ``connect`` event that sets SQLite's PRAGMAs, the URL's options);
the engine's statement events (``before_cursor_execute``...) do not see these statements.
"""

from __future__ import annotations

import abc
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import Executable

Rows = Sequence[Sequence[Any]]
Params = Mapping[str, Any]


class Compiled:
    """A statement compiled for one dialect, with its arguments in the order the SQL takes
    them (SQLAlchemy's public ``compile()``, ``positiontup`` and ``params``)."""

    def __init__(self, statement: Executable, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, cast(ClauseElement, statement).compile(dialect=dialect))
        self.sql = compiled.string
        self._names = tuple(compiled.positiontup or ())
        #: The values the statement binds itself (a status it compares with, say).
        self._own = compiled.params

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        values = {**self._own, **params}
        return tuple(values[name] for name in self._names)


class Driver(abc.ABC):
    """One driver's way to run a compiled statement on its own connection."""

    #: Whether a statement that failed runs once more through SQLAlchemy, which tells a
    #: connection the server dropped (and a deadlock's victim) from other failures. Not on
    #: SQLite: there is no server, and a lock was already waited for as long as the deadline
    #: allows (a second wait would outlast the caller, and its write land after it gave up).
    reruns = True

    @abc.abstractmethod
    def errors(self) -> tuple[type[Exception], ...]:
        """The driver's own errors (SQLAlchemy wraps them on its own path)."""

    def keeps_connection(self, error: BaseException) -> bool:
        """Whether a connection on which a statement failed with ``error`` is as good as
        before (the database refused the statement); else it is never reused."""
        return False

    @abc.abstractmethod
    async def fetch(self, connection: Any, sql: str, args: tuple[Any, ...]) -> Rows:
        """The rows of one statement."""

    @abc.abstractmethod
    async def change(self, connection: Any, sql: str, args: tuple[Any, ...]) -> int:
        """How many rows one statement changed."""


#: The SQLSTATEs of PostgreSQL's errors that end the connection they come on.
_CONNECTION_ENDED = ("08", "57P")


class _Asyncpg(Driver):
    def errors(self) -> tuple[type[Exception], ...]:
        import asyncpg

        # InternalClientError: a connection whose server went away mid-protocol.
        return asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError

    def keeps_connection(self, error: BaseException) -> bool:
        import asyncpg

        # The server's answer to the statement; not one that ends the connection (class 08,
        # or 57P01-57P03: shut down, crashed, starting up).
        return isinstance(error, asyncpg.PostgresError) and not str(error.sqlstate).startswith(
            _CONNECTION_ENDED
        )

    async def fetch(self, connection: Any, sql: str, args: tuple[Any, ...]) -> Rows:
        rows: Rows = await connection.fetch(sql, *args)
        return rows

    async def change(self, connection: Any, sql: str, args: tuple[Any, ...]) -> int:
        status: str = await connection.execute(sql, *args)  # such as "UPDATE 1"
        return int(status.rpartition(" ")[2])


class _Aiosqlite(Driver):
    reruns = False

    def errors(self) -> tuple[type[Exception], ...]:
        return (sqlite3.Error,)

    def keeps_connection(self, error: BaseException) -> bool:
        return isinstance(error, sqlite3.Error)

    async def fetch(self, connection: Any, sql: str, args: tuple[Any, ...]) -> Rows:
        rows: Rows = await connection.execute_fetchall(sql, args)
        return rows

    async def change(self, connection: Any, sql: str, args: tuple[Any, ...]) -> int:
        async with connection.execute(sql, args) as cursor:
            return int(cursor.rowcount)


class _Asyncmy(Driver):
    def errors(self) -> tuple[type[Exception], ...]:
        import asyncmy.errors

        return (asyncmy.errors.Error,)

    async def fetch(self, connection: Any, sql: str, args: tuple[Any, ...]) -> Rows:
        async with connection.cursor() as cursor:
            await cursor.execute(sql, args)
            rows: Rows = await cursor.fetchall()
            return rows

    async def change(self, connection: Any, sql: str, args: tuple[Any, ...]) -> int:
        async with connection.cursor() as cursor:
            return int(await cursor.execute(sql, args))


#: The drivers the store runs statements on directly: those it picks for a URL.
_DRIVERS: dict[str, Driver] = {
    "asyncpg": _Asyncpg(),
    "aiosqlite": _Aiosqlite(),
    "asyncmy": _Asyncmy(),
}


class Direct:
    """``statements`` run on ``driver``'s connections, compiled for ``dialect``."""

    def __init__(self, driver: Driver, dialect: Dialect, statements: Iterable[Executable]) -> None:
        self.errors = driver.errors()
        self.reruns = driver.reruns
        self._driver = driver
        self._dialect = dialect
        self._statements = dict.fromkeys(statements)
        self._compiled: dict[Executable, Compiled] | None = None

    @classmethod
    def of(cls, engine: AsyncEngine, statements: Iterable[Executable]) -> Direct | None:
        """The direct path on ``engine``'s driver, or ``None`` for a driver it does not know."""
        driver = _DRIVERS.get(engine.dialect.driver)
        return None if driver is None else cls(driver, engine.dialect, statements)

    def keeps_connection(self, error: BaseException) -> bool:
        """See :meth:`Driver.keeps_connection`."""
        return self._driver.keeps_connection(error)

    def runs(self, statement: Executable) -> bool:
        return statement in self._statements

    async def fetch(self, statement: Executable, params: Params, connection: Any) -> Rows:
        """The rows of ``statement`` on ``connection``, a driver connection."""
        compiled = self._compile()[statement]
        return await self._driver.fetch(connection, compiled.sql, compiled.args(params))

    async def change(self, statement: Executable, params: Params, connection: Any) -> int:
        """How many rows ``statement`` changed on ``connection``, a driver connection."""
        compiled = self._compile()[statement]
        return await self._driver.change(connection, compiled.sql, compiled.args(params))

    def _compile(self) -> dict[Executable, Compiled]:
        # Once a connection was made: the dialect has met its server then, and compiles as it
        # does for its own statements (MySQL from 8.0.20 on, say, gets another upsert).
        if self._compiled is None:
            self._compiled = {
                statement: Compiled(statement, self._dialect) for statement in self._statements
            }
        return self._compiled
