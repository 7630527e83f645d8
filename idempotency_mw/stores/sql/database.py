"""How SQLStore's statements reach its database: one SQLAlchemy ``AsyncEngine``, each statement
on its own in autocommit.

The engine is the application's own (used as it is, never disposed) or one made from a URL
(:func:`engine_for`). A statement that fails on a pooled connection the server had dropped
(an outage, a restart) runs once more on a fresh one, and a MariaDB/MySQL deadlock's victim
runs again: every statement of the store is safe to run twice.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool
from sqlalchemy.sql.expression import Executable

from idempotency_mw._backoff import Backoff
from idempotency_mw._urls import shown_url
from idempotency_mw.stores.sql.direct import Direct, Params, Rows
from idempotency_mw.stores.sql.sqlite import Synchronous, check_options, prepare_connections
from idempotency_mw.values.exceptions import ConfigurationError, install_extra

T = TypeVar("T")

#: The async driver used for each backend when a URL names none (or a sync one).
ASYNC_DRIVERS = {
    "sqlite": "aiosqlite",
    "postgresql": "asyncpg",
    "mysql": "asyncmy",
    "mariadb": "asyncmy",
}
_ASYNC_DRIVER_NAMES = {"aiosqlite", "asyncpg", "psycopg", "asyncmy", "aiomysql"}
#: The extra that installs each async driver the store uses by default.
_EXTRAS = {"aiosqlite": "sql", "asyncpg": "postgresql", "asyncmy": "mysql"}
_IN_MEMORY = (None, "", ":memory:")
#: How many connections a made engine's pool opens (as needed) and keeps, on a database server
#: and on a SQLite file. None beyond: a connection then goes back to the pool without I/O (none
#: is closed on its return, nor reset), so the direct path (direct.py) returns it outside
#: SQLAlchemy's greenlet; and a pool full at every peak opened and closed connections at a
#: steady load above its size.
SERVER_POOL_SIZE, SQLITE_POOL_SIZE = 20, 5
#: Seconds after which a made engine replaces a pooled connection (when it is next taken), so
#: that a server or proxy that drops old connections fails no statement.
POOL_RECYCLE = 300
#: What SQLAlchemy's asyncpg dialect takes from a URL itself.
_SQLALCHEMY_ASYNCPG_OPTIONS = ("prepared_statement_cache_size", "prepared_statement_name_func")
#: READ COMMITTED spares MariaDB/MySQL the gap locks that make concurrent purges deadlock.
READ_COMMITTED = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"
#: In the transaction of a ``durable=False`` write on PostgreSQL: its commit is answered before
#: the WAL reached the disk (a crash may lose it, never corrupt anything).
UNFLUSHED = "SET LOCAL synchronous_commit = off"
MYSQL_DEADLOCK = 1213
#: How often a deadlock's victim runs, and the pauses between: jittered so that two victims
#: do not meet again.
DEADLOCK_ATTEMPTS = 3
DEADLOCK_PAUSES = Backoff(first=0.005, cap=0.05)
#: What asyncio says when an object of one event loop is used from another.
_OTHER_LOOP = ("attached to a different loop", "bound to a different event loop")


def async_url(url: str | URL) -> URL:
    """``url`` with an async driver: ``sqlite:///x.db`` becomes ``sqlite+aiosqlite:///x.db``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {shown_url(url)!r}") from exc
    backend = parsed.get_backend_name()
    if backend not in ASYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() in _ASYNC_DRIVER_NAMES:
        return parsed
    return parsed.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")


def engine_for(
    url: str | URL,
    *,
    sqlite_wal: bool | None = None,
    sqlite_synchronous: Synchronous = "FULL",
    busy_timeout: float = 30.0,
) -> AsyncEngine:
    """The engine SQLStore makes (and owns) for ``url``: in autocommit, its pool sized for a
    server, a SQLite file's connections in WAL (unless ``sqlite_wal=False``) at
    ``sqlite_synchronous``, waiting ``busy_timeout`` seconds at most for another's lock.

    The URL's own options reach the driver as SQLAlchemy passes them (PgBouncer's
    ``prepared_statement_cache_size=0``, ``ssl``, ``application_name``...).
    """
    parsed = async_url(url)
    backend = parsed.get_backend_name()
    sqlite_file = backend == "sqlite" and parsed.database not in _IN_MEMORY
    check_options(sqlite_wal, sqlite_synchronous, sqlite_file=sqlite_file)
    # No reset on return: the store's connections are in autocommit, with nothing to roll back.
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    if backend != "sqlite":
        options |= {"pool_size": SERVER_POOL_SIZE, "max_overflow": 0, "pool_recycle": POOL_RECYCLE}
    elif sqlite_file:
        # As SQLAlchemy itself pools a file's connections since 2.0.38 (before: none pooled,
        # each statement a new connection and thread). In memory: one connection, static.
        options |= {
            "poolclass": AsyncAdaptedQueuePool,
            "pool_size": SQLITE_POOL_SIZE,
            "max_overflow": 0,
        }
    if backend in ("mysql", "mariadb") and "init_command" not in parsed.query:
        options["connect_args"] = {"init_command": READ_COMMITTED}
    try:
        if parsed.get_driver_name() == "asyncpg":
            parsed, options["connect_args"] = asyncpg_settings(parsed)
        engine = create_async_engine(parsed, **options)
    except ModuleNotFoundError as exc:
        name = parsed.get_driver_name()
        if (exc.name or "").partition(".")[0] != name:
            raise
        extra = _EXTRAS.get(name)
        how = install_extra(extra) if extra else f"pip install {name}"
        # Still a ModuleNotFoundError (which callers such as the CLI recognise), now saying
        # what to install.
        raise ModuleNotFoundError(f"SQLStore on {backend} needs {name}: {how}", name=name) from exc
    if parsed.get_driver_name() == "asyncmy":
        _check_asyncmy_options(engine)
    if sqlite_file:
        prepare_connections(
            engine, wal=sqlite_wal is not False, synchronous=sqlite_synchronous, busy=busy_timeout
        )
    return engine


def _check_asyncmy_options(engine: AsyncEngine) -> None:
    """Raise :class:`ConfigurationError` for a URL option that asyncmy's ``connect()`` does not
    take (it would fail every connection with a ``TypeError``): checked once, with the options
    as SQLAlchemy hands them to the driver."""
    import asyncmy

    _, given = engine.dialect.create_connect_args(engine.url)
    unknown = sorted(set(given) - set(inspect.signature(asyncmy.connect).parameters))
    if unknown:
        raise ConfigurationError(
            f"asyncmy does not take the URL option(s) {', '.join(unknown)} (a misspelling?); "
            "options it does not take go on an engine of your own (SQLStore(engine))"
        )


def asyncpg_settings(url: URL) -> tuple[URL, dict[str, Any]]:
    """``url`` without the options that asyncpg's ``connect`` does not take, and those options
    as its ``server_settings``: libpq, and asyncpg's own DSNs, read ``application_name``,
    ``search_path`` and any other server setting from a URL so. libpq's ``sslmode`` is asyncpg's
    ``ssl``. ``prepared_statement_cache_size=0`` (PgBouncer) turns asyncpg's own cache of named
    statements off too: the store's direct statements (see direct.py) would use it."""
    import asyncpg

    taken = {*inspect.signature(asyncpg.connect).parameters, *_SQLALCHEMY_ASYNCPG_OPTIONS}
    query = dict(url.query)
    if "sslmode" in query and "ssl" not in query:
        query["ssl"] = query.pop("sslmode")
    settings = {name: value for name, value in query.items() if name not in taken}
    kept = {name: value for name, value in query.items() if name in taken}
    connect_args: dict[str, Any] = {"server_settings": settings} if settings else {}
    if query.get("prepared_statement_cache_size") == "0" and "statement_cache_size" not in query:
        connect_args["statement_cache_size"] = 0
    return url.set(query=kept), connect_args


class Database:
    """The store's statements on ``engine``, each in autocommit.

    ``owned``: the store made the engine (and disposes of it). Used from another event loop
    than its connections belong to (a ``TestClient`` without ``with`` runs each request in a
    loop of its own), an owned engine starts a new pool there and leaves the old one to its
    loop; a given engine fails with the way out.

    On an owned engine the ``direct`` statements (the request path's) run on the driver's
    own connection (see :mod:`~idempotency_mw.stores.sql.direct`): every connection of that
    engine is in autocommit. A given engine's statements all run through SQLAlchemy, with its
    events and its isolation settings.
    """

    def __init__(
        self, engine: AsyncEngine, *, owned: bool, direct: Iterable[Executable] = ()
    ) -> None:
        self.engine = engine
        self.dialect_name = engine.dialect.name
        self.url = engine.url
        # Some drivers raise their own errors past SQLAlchemy (while a connection is set up).
        self.errors: tuple[type[Exception], ...] = (
            SQLAlchemyError,
            engine.dialect.loaded_dbapi.Error,
        )
        self._owned = owned
        self._direct = Direct.of(engine, direct) if owned else None
        #: The driver's own errors after which a direct statement runs again through SQLAlchemy.
        self._direct_errors: tuple[type[Exception], ...] = ()
        if self._direct is not None:
            if self._direct.reruns:
                self._direct_errors = (*self._direct.errors, OSError)
            self.errors += self._direct.errors
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Statements under way in this loop, and set when there are none.
        self._running = 0
        self._settled = asyncio.Event()
        # A made engine is in autocommit already; options made once share the engine's pool.
        self._autocommit = (
            engine if owned else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._in_transaction = (
            engine.execution_options(isolation_level="READ COMMITTED")
            if self.dialect_name == "postgresql"
            else None
        )

    async def fetch(
        self, statement: Executable, params: Params, *, deadline: float, durable: bool = True
    ) -> Rows:
        """Rows of one statement; ``durable=False``: on PostgreSQL, its commit waits for no
        flush of its own (elsewhere every commit waits for the disk)."""
        direct = self._direct_for(statement, durable)
        return await self._run(
            _reading(statement, params, CursorResult.all),
            deadline,
            durable,
            None if direct is None else functools.partial(direct.fetch, statement, params),
        )

    async def change(
        self, statement: Executable, params: Params, *, deadline: float, durable: bool = True
    ) -> int:
        """Rows changed by one statement (``durable`` as for :meth:`fetch`)."""
        direct = self._direct_for(statement, durable)
        return await self._run(
            _reading(statement, params, _rowcount),
            deadline,
            durable,
            None if direct is None else functools.partial(direct.change, statement, params),
        )

    async def run_sync(self, operation: Callable[[Connection], T], *, deadline: float) -> T:
        """``operation`` on a SQLAlchemy connection (the start-up check)."""
        return await self._run(lambda conn: conn.run_sync(operation), deadline, True)

    def _direct_for(self, statement: Executable, durable: bool) -> Direct | None:
        """The direct path, if ``statement`` takes it (a write that skips its own flush runs
        in a transaction, through SQLAlchemy)."""
        direct = self._direct
        if direct is None or not direct.runs(statement):
            return None
        return direct if durable or self._in_transaction is None else None

    async def _run(
        self,
        run: Callable[[AsyncConnection], Awaitable[T]],
        deadline: float,
        durable: bool,
        direct: Callable[[Any], Awaitable[T]] | None = None,
    ) -> T:
        """``run`` on a SQLAlchemy connection, or ``direct`` on a driver connection if given."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            await self._enter(loop)
        self._running += 1
        self._settled.clear()
        try:
            if direct is not None:
                try:
                    return await self._on_driver(direct)
                except self._direct_errors:
                    # SQLAlchemy tells a connection the server dropped (then it replaces every
                    # connection pooled before it) and a deadlock's victim from other failures:
                    # the statement runs again through it, if there is time left.
                    if time.monotonic() >= deadline:
                        raise
            return await self._with_reruns(run, deadline, durable)
        finally:
            self._running -= 1
            if not self._running:
                self._settled.set()

    async def _with_reruns(
        self, run: Callable[[AsyncConnection], Awaitable[T]], deadline: float, durable: bool
    ) -> T:
        attempt = 0
        while True:
            try:
                if durable or self._in_transaction is None:
                    async with self._autocommit.connect() as conn:
                        return await run(conn)
                async with self._in_transaction.begin() as conn:
                    await conn.exec_driver_sql(UNFLUSHED)
                    return await run(conn)
            except DBAPIError as exc:
                pause = _rerun_after(exc, attempt)
                if pause is None or time.monotonic() + pause >= deadline:
                    raise
            except RuntimeError as exc:
                if not any(sign in str(exc) for sign in _OTHER_LOOP):
                    raise
                # A failure of the store (503 and logged), with the way out, rather than a 500.
                raise ConnectionError(
                    "the engine's pooled connection belongs to another event loop: when requests "
                    "run in event loops of their own (a TestClient without `with`), give the "
                    "engine poolclass=NullPool"
                ) from exc
            await asyncio.sleep(pause)
            attempt += 1

    async def _on_driver(self, run: Callable[[Any], Awaitable[T]]) -> T:
        """``run`` on the driver connection of a connection of the engine's pool."""
        pooled = await self.engine.raw_connection()
        try:
            result = await run(pooled.driver_connection)
        except BaseException as exc:
            assert self._direct is not None
            if self._direct.keeps_connection(exc):
                pooled.close()
            else:
                # Cancelled or cut off mid-way, the connection may be in any state: never reused.
                pooled.invalidate()
            raise
        pooled.close()
        return result

    async def _enter(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use the engine from ``loop`` on: an owned engine's pool of another loop is left to
        that loop (SQLAlchemy's ``dispose(close=False)``), a new one opened here."""
        left, self._loop = self._loop, loop
        self._settled = asyncio.Event()
        if left is not None and self._owned:
            await self.engine.dispose(close=False)

    async def aclose(self) -> None:
        """Close an owned engine's connections once no statement is under way (a connection
        out of the pool when it is disposed would be left to the collector unclosed); it opens
        new ones if it is used again."""
        if self._owned:
            # A call of several statements may have started its next one by the time this
            # wakes up.
            while self._running:
                await self._settled.wait()
            await self.engine.dispose()


def _reading(
    statement: Executable, params: Params, read: Callable[[CursorResult[Any]], T]
) -> Callable[[AsyncConnection], Awaitable[T]]:
    """What runs ``statement`` on a connection and ``read``s its result there."""

    async def run(conn: AsyncConnection) -> T:
        return read(await conn.execute(statement, params))

    return run


def _rowcount(result: CursorResult[Any]) -> int:
    return result.rowcount


def _rerun_after(exc: DBAPIError, attempt: int) -> float | None:
    """The pause before statement that failed with ``exc`` runs again, or ``None`` if it may not.

    A connection the server had dropped (SQLAlchemy then replaces every connection pooled
    before it) runs the statement once more at once; a deadlock's victim, which InnoDB rolled
    back whole, runs again after a short pause.
    """
    if exc.connection_invalidated:
        return 0.0 if attempt == 0 else None
    if _mysql_error_code(exc) == MYSQL_DEADLOCK and attempt + 1 < DEADLOCK_ATTEMPTS:
        return DEADLOCK_PAUSES.delay(attempt)
    return None


def _mysql_error_code(exc: DBAPIError) -> object:
    args = getattr(exc.orig, "args", ())
    return args[0] if args else None
