"""Any dialect through SQLAlchemy's async engine: an engine given, or one made from a URL."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.sql.drivers.base import Rows, T
from idempotency_mw.stores.sql.drivers.reruns import READ_COMMITTED, deadlock, with_reruns

#: What asyncio says when an object of one event loop is used from another.
_OTHER_LOOP = ("attached to a different loop", "bound to a different event loop")
_IN_MEMORY = (None, "", ":memory:")


def engine_for(url: URL) -> AsyncEngine:
    """The engine the store makes (and owns) for ``url``, in autocommit."""
    if url.get_backend_name() == "sqlite" and url.database in _IN_MEMORY:
        # An in-memory SQLite database exists once per connection: keep one connection.
        return create_async_engine(url, poolclass=StaticPool, isolation_level="AUTOCOMMIT")
    # Pre-ping: a connection pooled before an outage is replaced, not handed out dead.
    options: dict[str, Any] = {"pool_pre_ping": True}
    if url.get_backend_name() in ("mysql", "mariadb"):
        options["connect_args"] = {"init_command": READ_COMMITTED}
    return create_async_engine(url, isolation_level="AUTOCOMMIT", **options)


class SQLAlchemyDriver:
    """Statements through an ``AsyncEngine``, each in autocommit.

    ``in_autocommit`` says the engine was made with ``isolation_level="AUTOCOMMIT"``; any other
    engine is switched to it on each connection. The engine is disposed only if ``owned``.
    """

    errors: tuple[type[Exception], ...] = (SQLAlchemyError,)

    def __init__(self, engine: AsyncEngine, *, owned: bool, in_autocommit: bool = False) -> None:
        self.dialect_name = engine.dialect.name
        self.on_callers_machine = self.dialect_name == "sqlite"
        self.driver_name = engine.dialect.driver
        self.url = engine.url
        # Some drivers raise their own errors past SQLAlchemy (while a connection is set up).
        self.errors = (SQLAlchemyError, engine.dialect.loaded_dbapi.Error)
        self._owned = owned
        self._engine = (
            engine if in_autocommit else engine.execution_options(isolation_level="AUTOCOMMIT")
        )

    async def fetch(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,  # any engine's commits wait for the disk
    ) -> Rows:
        def rows(conn: Connection) -> Rows:
            return list(conn.execute(statement, params).all())

        return await self.run_sync(rows, deadline=deadline)

    async def change(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,  # any engine's commits wait for the disk
    ) -> int:
        def count(conn: Connection) -> int:
            return int(conn.execute(statement, params).rowcount)

        return await self.run_sync(count, deadline=deadline)

    async def run_sync(self, operation: Callable[[Connection], T], *, deadline: float) -> T:
        async def run() -> T:
            async with self._engine.connect() as conn:
                return await conn.run_sync(operation)

        try:
            return await with_reruns(run, deadlock, deadline=deadline)
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
