"""PostgreSQL through asyncpg on the store's own :class:`StatementPool`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.sql.drivers.base import Rows
from idempotency_mw.stores.sql.drivers.pooled import PooledDriver
from idempotency_mw.stores.sql.drivers.statement_pool import StatementPool


class AsyncpgDriver(PooledDriver):
    """PostgreSQL through asyncpg, statements prepared once per connection."""

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

    async def fetch(
        self, statement: Executable, params: Mapping[str, Any], *, deadline: float
    ) -> Rows:
        compiled = self._compile(statement)
        args = compiled.args(params)
        return await self._on_pool(lambda pool: pool.fetch(compiled.sql, args), deadline)

    async def change(
        self, statement: Executable, params: Mapping[str, Any], *, deadline: float
    ) -> int:
        compiled = self._compile(statement)
        args = compiled.args(params)
        status: str = await self._on_pool(lambda pool: pool.execute(compiled.sql, args), deadline)
        return int(status.rsplit(" ", 1)[-1])
