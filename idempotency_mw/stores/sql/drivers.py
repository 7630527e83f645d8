"""How SQLStore's statements reach the database: the fastest safe driver for each backend.

Every driver runs the same SQLAlchemy Core statements. The generic one goes through an
``AsyncEngine``; the fast ones compile each statement once with SQLAlchemy and hand the SQL
straight to the driver: asyncpg for PostgreSQL, asyncmy for MariaDB/MySQL, and the standard
library's sqlite3 for a SQLite file. :func:`driver_for` chooses, by the rule its docstring
states.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, Literal, Protocol, TypeVar, cast

from sqlalchemy import Connection, create_engine, event
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool, StaticPool
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import Executable

from idempotency_mw.exceptions import ConfigurationError
from idempotency_mw.stores.sql.statement_pool import StatementPool

T = TypeVar("T")
#: SQLite's sync level for the store's connections.
Synchronous = Literal["FULL", "NORMAL"]
Rows = Sequence[Sequence[Any]]
#: When the store's operation under way must be over (``time.monotonic()``): set by SQLStore,
#: so that a statement waiting for a lock in a thread gives up before its caller does.
deadline: ContextVar[float] = ContextVar("idempotency_mw_deadline", default=math.inf)
#: Changes (about half the commits) between two WAL checkpoints, which the worker thread runs.
_CHECKPOINT_EVERY = 250
#: Seconds a checkpoint waits for other processes' readers and writers of the file.
_RESTART_WAIT = 0.1
#: What asyncio says when an object of one event loop is used from another.
_OTHER_LOOP = ("attached to a different loop", "bound to a different event loop")
#: Without a deadline (a driver used outside SQLStore), the longest wait for a SQLite lock.
_LONGEST_BUSY_WAIT = 30.0


#: The async driver used for each backend when a URL names none (or a sync one).
ASYNC_DRIVERS = {
    "sqlite": "aiosqlite",
    "postgresql": "asyncpg",
    "mysql": "asyncmy",
    "mariadb": "asyncmy",
}
_ASYNC_DRIVER_NAMES = {"aiosqlite", "asyncpg", "psycopg", "asyncmy", "aiomysql"}
_IN_MEMORY = (None, "", ":memory:")


def async_url(url: str | URL) -> URL:
    """``url`` with an async driver: ``sqlite:///x.db`` becomes ``sqlite+aiosqlite:///x.db``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {url!r}") from exc
    backend = parsed.get_backend_name()
    if backend not in ASYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() in _ASYNC_DRIVER_NAMES:
        return parsed
    return parsed.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")


class Driver(Protocol):
    """What SQLStore needs from a database connection."""

    dialect_name: str
    #: Where the driver connects (shown, without its password, in errors).
    url: URL
    #: Exceptions that mean "the database failed" (wrapped into StoreError by the store).
    errors: tuple[type[Exception], ...]

    async def fetch(self, statement: Executable, params: Mapping[str, Any]) -> Rows:
        """Rows of one statement, run on its own (autocommit)."""
        ...

    async def change(self, statement: Executable, params: Mapping[str, Any]) -> int:
        """Rows changed by one statement, run on its own (autocommit)."""
        ...

    async def run_sync(self, operation: Callable[[Connection], T]) -> T:
        """``operation`` on a SQLAlchemy connection (autocommit)."""
        ...

    async def aclose(self) -> None:
        """Close what the driver opened."""
        ...


class _Compiled:
    """A statement compiled once for a dialect, with its parameters in driver order."""

    def __init__(self, statement: Executable, dialect: Dialect) -> None:
        compiled = cast(SQLCompiler, cast(ClauseElement, statement).compile(dialect=dialect))
        self.sql = str(compiled)
        self._names = tuple(compiled.positiontup or ())
        self._defaults = compiled.params

    def args(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(
            params[name] if name in params else self._defaults[name] for name in self._names
        )


class _CompileCache:
    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._compiled: dict[int, tuple[Executable, _Compiled]] = {}

    def __len__(self) -> int:
        return len(self._compiled)

    def __call__(self, statement: Executable) -> _Compiled:
        # Keyed by identity: the store's statements are module-level and live forever; the
        # statement is kept in the entry so its id is never reused by another object.
        entry = self._compiled.get(id(statement))
        if entry is None:
            entry = (statement, _Compiled(statement, self._dialect))
            self._compiled[id(statement)] = entry
        return entry[1]


class SQLAlchemyDriver:
    """Any dialect through SQLAlchemy's async engine, every statement in autocommit.

    ``in_autocommit`` says the engine was made with ``isolation_level="AUTOCOMMIT"``; any other
    engine is switched to it on each connection. The engine is disposed only if ``owned``.
    """

    errors: tuple[type[Exception], ...] = (SQLAlchemyError,)

    def __init__(self, engine: AsyncEngine, *, owned: bool, in_autocommit: bool = False) -> None:
        self.dialect_name = engine.dialect.name
        self.driver_name = engine.dialect.driver
        self.url = engine.url
        # Some drivers raise their own errors past SQLAlchemy (while a connection is set up).
        self.errors = (SQLAlchemyError, engine.dialect.loaded_dbapi.Error)
        self._owned = owned
        self._engine = (
            engine if in_autocommit else engine.execution_options(isolation_level="AUTOCOMMIT")
        )

    async def fetch(self, statement: Executable, params: Mapping[str, Any]) -> Rows:
        def rows(conn: Connection) -> Rows:
            return list(conn.execute(statement, params).all())

        return await self.run_sync(rows)

    async def change(self, statement: Executable, params: Mapping[str, Any]) -> int:
        def count(conn: Connection) -> int:
            return int(conn.execute(statement, params).rowcount)

        return await self.run_sync(count)

    async def run_sync(self, operation: Callable[[Connection], T]) -> T:
        async def run() -> T:
            async with self._engine.connect() as conn:
                return await conn.run_sync(operation)

        try:
            return await _with_reruns(run, _deadlock)
        except RuntimeError as exc:
            if not any(sign in str(exc) for sign in _OTHER_LOOP):
                raise
            # A failure of the store (503 and logged), with the way out, rather than a 500.
            raise ConnectionError(
                "the engine's pooled connection belongs to another event loop: when requests "
                "run in event loops of their own (a TestClient without `with`), give the "
                "engine poolclass=NullPool"
            ) from exc

    async def detached_connection(self) -> Any:
        """The driver's own connection, made as the engine makes its connections, taken out of
        its pool for good: the caller closes it."""
        pooled = await self._engine.raw_connection()
        connection = pooled.driver_connection
        pooled.detach()
        return connection

    async def aclose(self) -> None:
        if self._owned:
            await self._engine.dispose()


class _PooledDriver(abc.ABC):
    """A driver's own connection pool, opened on first use; statements compiled once.

    A pool's connections belong to the event loop that opened them. Used from another loop (a
    ``TestClient`` without ``with`` runs each request in a loop of its own), the driver opens a
    pool there and leaves the old one to its loop: closed there if that loop still runs, else
    gone with it. Subclasses open and close the pool and run the compiled SQL on it. Anything
    that needs a SQLAlchemy connection (the start-up check) gets one from an engine without a
    pool.
    """

    errors: tuple[type[Exception], ...]

    def __init__(self, url: URL, dialect: Dialect, dialect_name: str) -> None:
        self.dialect_name = dialect_name
        self.url = url
        self._compile = _CompileCache(dialect)
        self._pool: Any = None
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._engine: AsyncEngine | None = None

    @abc.abstractmethod
    async def _open_pool(self) -> Any: ...

    @abc.abstractmethod
    async def _close_pool(self, pool: Any) -> None: ...

    @abc.abstractmethod
    def _may_rerun(self, exc: Exception) -> bool:
        """Whether a statement that failed with ``exc`` had no effect and may run again."""

    async def _on_pool(self, run: Callable[[Any], Awaitable[T]]) -> T:
        """``run(pool)``, run again when it fails in a way ``_may_rerun`` allows."""
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            await self._open_in(loop)
        pool = self._pool
        return await _with_reruns(lambda: run(pool), self._may_rerun)

    async def _open_in(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open this event loop's pool, once however many callers wait for it."""
        if self._opening is None or self._opening[0] is not loop:
            self._opening = (loop, asyncio.Lock())
        async with self._opening[1]:
            if self._pool is not None and self._pool_loop is loop:
                return
            pool = await self._open_pool()
            self._leave()
            self._pool, self._pool_loop = pool, loop

    def _leave(self) -> None:
        """Forget the pool of another event loop, closing it there if that loop still runs."""
        pool, loop = self._pool, self._pool_loop
        self._pool = self._pool_loop = None
        if pool is not None and loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._close_pool(pool), loop)

    async def run_sync(self, operation: Callable[[Connection], T]) -> T:
        if self._engine is None:
            self._engine = create_async_engine(
                self.url, poolclass=NullPool, isolation_level="AUTOCOMMIT"
            )
        async with self._engine.connect() as conn:
            return await conn.run_sync(operation)

    async def aclose(self) -> None:
        pool = self._pool
        if pool is not None and self._pool_loop is asyncio.get_running_loop():
            self._pool = self._pool_loop = None
            await self._close_pool(pool)
        else:
            self._leave()
        if self._engine is not None:
            await self._engine.dispose()


class AsyncpgDriver(_PooledDriver):
    """PostgreSQL through asyncpg on a :class:`StatementPool`, statements prepared once per
    connection."""

    def __init__(self, url: URL) -> None:
        import asyncpg

        super().__init__(url, postgresql.asyncpg.dialect(), "postgresql")  # type: ignore[no-untyped-call]
        self.errors = (asyncpg.PostgresError, asyncpg.InterfaceError, SQLAlchemyError)
        self._dsn = url.set(drivername="postgresql").render_as_string(False)

    async def _open_pool(self) -> StatementPool:
        return StatementPool(self.connect, max_size=10)

    async def connect(self) -> Any:
        """An asyncpg connection of its own, outside the pool: the caller closes it."""
        import asyncpg

        return await asyncpg.connect(self._dsn)

    async def _close_pool(self, pool: StatementPool) -> None:
        await pool.aclose()

    def _may_rerun(self, exc: Exception) -> bool:
        import asyncpg

        return isinstance(exc, (asyncpg.ConnectionDoesNotExistError, ConnectionError))

    async def fetch(self, statement: Executable, params: Mapping[str, Any]) -> Rows:
        compiled = self._compile(statement)
        args = compiled.args(params)
        return await self._on_pool(lambda pool: pool.fetch(compiled.sql, args))

    async def change(self, statement: Executable, params: Mapping[str, Any]) -> int:
        compiled = self._compile(statement)
        args = compiled.args(params)
        status: str = await self._on_pool(lambda pool: pool.execute(compiled.sql, args))
        return int(status.rsplit(" ", 1)[-1])


class AsyncmyDriver(_PooledDriver):
    """MariaDB/MySQL through an asyncmy pool, in autocommit at READ COMMITTED."""

    def __init__(self, url: URL) -> None:
        import asyncmy.errors

        dialect = mysql.asyncmy.dialect()
        super().__init__(url, dialect, url.get_backend_name())
        self._connect_args = dialect.create_connect_args(url)[1]
        self._driver_error: type[Exception] = asyncmy.errors.Error
        self.errors = (asyncmy.errors.Error, SQLAlchemyError)

    async def _open_pool(self) -> Any:
        import asyncmy

        # The URL's own options (charset, ssl, an init_command of its own...) come last.
        options = {"init_command": READ_COMMITTED, **self._connect_args}
        return await asyncmy.create_pool(minsize=1, maxsize=10, autocommit=True, **options)

    async def _close_pool(self, pool: Any) -> None:
        pool.close()
        await pool.wait_closed()

    def _may_rerun(self, exc: Exception) -> bool:
        return isinstance(exc, self._driver_error) and _mysql_error_code(exc) in _MYSQL_RERUN

    async def _execute(
        self, statement: Executable, params: Mapping[str, Any], *, fetch: bool
    ) -> tuple[Rows, int]:
        compiled = self._compile(statement)
        args = compiled.args(params)

        async def run(pool: Any) -> tuple[Rows, int]:
            async with pool.acquire() as conn, conn.cursor() as cursor:
                await cursor.execute(compiled.sql, args)
                return (await cursor.fetchall() if fetch else ()), int(cursor.rowcount)

        return await self._on_pool(run)

    async def fetch(self, statement: Executable, params: Mapping[str, Any]) -> Rows:
        return (await self._execute(statement, params, fetch=True))[0]

    async def change(self, statement: Executable, params: Mapping[str, Any]) -> int:
        return (await self._execute(statement, params, fetch=False))[1]


class SQLiteDriver:
    """A SQLite file through the standard library's driver.

    Statements run on the event loop itself on a connection that never waits for a lock
    (busy timeout 0): tens of microseconds, less than one hop to a thread. When another
    connection holds the lock, the statement runs instead in one worker thread whose connection
    waits for it, but only until the operation's :data:`deadline`: a statement that could not
    run in time never runs later. Connections are opened in that thread, and a WAL checkpoint
    runs there every :data:`_CHECKPOINT_EVERY` changes, statements waiting for it (a few
    milliseconds) so that the WAL restarts and stays small. ``wal`` switches the file to WAL;
    otherwise its journal mode is left as it is.
    ``synchronous`` is the connections' sync level (``FULL``: a commit survives a power cut).
    """

    errors: tuple[type[Exception], ...] = (sqlite3.Error, SQLAlchemyError)

    def __init__(self, url: URL, *, wal: bool = True, synchronous: Synchronous = "FULL") -> None:
        self.dialect_name = "sqlite"
        self.url = url
        self._path = url.database or ""
        self._sync_url = url.set(drivername="sqlite+pysqlite")
        self._wal = wal
        self._synchronous = synchronous
        self._compile = _CompileCache(sqlite.pysqlite.dialect())
        self._loop_connection: sqlite3.Connection | None = None
        self._worker_connection: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._commits = 0
        self._checkpointing = False

    @property
    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="idempotency-mw-sqlite")
        return self._executor

    async def _in_worker(self, operation: Callable[[float], T]) -> T:
        """``operation(seconds left)`` in the worker thread, within the operation's deadline."""
        ends = deadline.get()

        def run() -> T:
            return operation(ends - time.monotonic())

        return await asyncio.get_running_loop().run_in_executor(self._worker, run)

    def _connect(self, busy_seconds: float) -> sqlite3.Connection:
        connection = sqlite3.connect(
            self._path, timeout=0, isolation_level=None, check_same_thread=False
        )
        _busy_wait(connection, busy_seconds)
        if self._wal:
            connection.execute("PRAGMA journal_mode=WAL")
        connection.execute(f"PRAGMA synchronous={self._synchronous}")
        return connection

    def _worker_execute(self, sql: str, args: tuple[Any, ...], seconds: float) -> sqlite3.Cursor:
        if self._worker_connection is None:
            self._worker_connection = self._connect(seconds)
        _busy_wait(self._worker_connection, seconds)
        return self._worker_connection.execute(sql, args)

    async def _on_loop(self) -> sqlite3.Connection:
        if self._loop_connection is None:

            def connect(seconds: float) -> sqlite3.Connection:
                connection = self._connect(seconds)
                _busy_wait(connection, 0)
                # Checkpoints write to disk: the worker thread runs them, never the event loop.
                connection.execute("PRAGMA wal_autocheckpoint=0")
                return connection

            connection = await self._in_worker(connect)
            if self._loop_connection is None:
                self._loop_connection = connection
            else:  # another call opened one meanwhile
                connection.close()
        return self._loop_connection

    async def _execute(self, statement: Executable, params: Mapping[str, Any]) -> Any:
        compiled = self._compile(statement)
        args = compiled.args(params)
        if not self._checkpointing:
            try:
                cursor = (await self._on_loop()).execute(compiled.sql, args)
                return cursor.fetchall(), cursor.rowcount
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    raise

        def run(seconds: float) -> tuple[Rows, int]:
            cursor = self._worker_execute(compiled.sql, args, seconds)
            return cursor.fetchall(), cursor.rowcount

        return await self._in_worker(run)

    async def fetch(self, statement: Executable, params: Mapping[str, Any]) -> Rows:
        rows: Rows = (await self._execute(statement, params))[0]
        return rows

    async def change(self, statement: Executable, params: Mapping[str, Any]) -> int:
        count: int = (await self._execute(statement, params))[1]
        self._commits += 1
        # One checkpoint at a time: on a slow disk they would queue up behind each other.
        if self._commits >= _CHECKPOINT_EVERY and not self._checkpointing:
            self._commits = 0
            self._checkpointing = True
            self._worker.submit(self._checkpoint)
        return count

    def _checkpoint(self) -> None:
        # Meanwhile the store's statements queue up behind this one in the worker thread, so
        # that no commit of ours keeps the checkpoint from finishing: RESTART then has the next
        # commit start the WAL afresh. (Checkpoints that run beside commits never catch up
        # under steady load, and the WAL grows without bound.) Failing means another process
        # is busy with the file; the next round catches up.
        try:
            with contextlib.suppress(sqlite3.Error):
                self._worker_execute("PRAGMA wal_checkpoint(RESTART)", (), _RESTART_WAIT).fetchall()
        finally:
            self._checkpointing = False

    async def run_sync(self, operation: Callable[[Connection], T]) -> T:
        def run(seconds: float) -> T:
            engine = create_engine(self._sync_url, poolclass=NullPool)
            event.listen(engine, "connect", lambda conn, _: _busy_wait(conn, seconds))
            try:
                with engine.begin() as conn:
                    return operation(conn)
            finally:
                engine.dispose()

        return await self._in_worker(run)

    async def aclose(self) -> None:
        """Close both connections; the driver opens new ones if it is used again."""
        if self._executor is not None:

            def close() -> None:
                if self._worker_connection is not None:
                    self._worker_connection.close()
                    self._worker_connection = None

            await asyncio.get_running_loop().run_in_executor(self._executor, close)
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._loop_connection is not None:
            self._loop_connection.close()
            self._loop_connection = None


def _busy_wait(connection: Any, seconds: float) -> None:
    """How long ``connection`` waits for another's lock before it fails (SQLITE_BUSY)."""
    milliseconds = max(0, int(min(seconds, _LONGEST_BUSY_WAIT) * 1000))
    connection.execute(f"PRAGMA busy_timeout={milliseconds}")


def driver_for(
    database: str | URL | AsyncEngine,
    *,
    sqlite_wal: bool | None = None,
    sqlite_synchronous: Synchronous = "FULL",
) -> Driver:
    """The driver for ``database``: a given engine as it is; from a URL, the fastest safe one.

    A SQLite file gets :class:`SQLiteDriver` (in WAL unless ``sqlite_wal=False``),
    ``postgresql`` (or ``+asyncpg``) :class:`AsyncpgDriver`, ``mysql``/``mariadb`` (or
    ``+asyncmy``) :class:`AsyncmyDriver`; any other async driver named in the URL (psycopg,
    aiomysql, an in-memory SQLite) goes through SQLAlchemy's engine.
    """
    if sqlite_synchronous not in ("FULL", "NORMAL"):
        raise ConfigurationError("sqlite_synchronous must be 'FULL' or 'NORMAL'")
    url = None if isinstance(database, AsyncEngine) else async_url(database)
    if url is not None and url.get_backend_name() == "sqlite" and url.database not in _IN_MEMORY:
        if sqlite_synchronous == "NORMAL" and sqlite_wal is False:
            # Outside WAL, NORMAL can corrupt the file on a power cut.
            raise ConfigurationError("sqlite_synchronous='NORMAL' needs WAL (sqlite_wal=False)")
        return SQLiteDriver(url, wal=sqlite_wal is not False, synchronous=sqlite_synchronous)
    if sqlite_wal or sqlite_synchronous != "FULL":
        raise ConfigurationError(
            "sqlite_wal=True and sqlite_synchronous apply to a SQLite file URL only"
        )
    if url is None:
        return SQLAlchemyDriver(cast(AsyncEngine, database), owned=False)
    backend, driver = url.get_backend_name(), url.get_driver_name()
    if backend == "postgresql" and driver == "asyncpg":
        return AsyncpgDriver(url)
    if backend in ("mysql", "mariadb") and driver == "asyncmy":
        return AsyncmyDriver(url)
    if backend == "sqlite":
        # An in-memory SQLite database exists once per connection: keep one connection.
        return SQLAlchemyDriver(create_async_engine(url, poolclass=StaticPool), owned=True)
    # READ COMMITTED spares MariaDB/MySQL the gap locks that make concurrent purges deadlock.
    # Pre-ping: a connection pooled before an outage is replaced, not handed out dead.
    options: dict[str, Any] = {"pool_pre_ping": True}
    if backend in ("mysql", "mariadb"):
        options["connect_args"] = {"init_command": READ_COMMITTED}
    return SQLAlchemyDriver(
        create_async_engine(url, isolation_level="AUTOCOMMIT", **options),
        owned=True,
        in_autocommit=True,
    )


_ATTEMPTS = 3
_MYSQL_DEADLOCK = 1213
#: Deadlock victim, and the codes of a connection that is gone (as SQLAlchemy reads them).
_MYSQL_RERUN = frozenset({_MYSQL_DEADLOCK, 1927, 2006, 2013, 2014, 2045, 2055, 4031})
READ_COMMITTED = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"


async def _with_reruns(
    run: Callable[[], Awaitable[T]], may_rerun: Callable[[Exception], bool]
) -> T:
    """``run()``, run again (up to three times in all) when it fails as ``may_rerun`` allows.

    Every statement of the store is safe to run twice; this covers a pooled connection that
    died unnoticed (an outage, a server restart) and a deadlock's victim, which InnoDB rolls
    back whole.
    """
    attempts = 1
    while True:
        try:
            return await run()
        except Exception as exc:
            if attempts >= _ATTEMPTS or not may_rerun(exc):
                raise
            attempts += 1


def _deadlock(exc: Exception) -> bool:
    return isinstance(exc, DBAPIError) and _mysql_error_code(exc) == _MYSQL_DEADLOCK


def _mysql_error_code(exc: Exception) -> object:
    """The MySQL error code of a driver error, or of the one SQLAlchemy wrapped."""
    error = exc.orig if isinstance(exc, DBAPIError) else exc
    args = getattr(error, "args", ())
    return args[0] if args else None
