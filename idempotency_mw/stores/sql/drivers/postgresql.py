"""PostgreSQL through asyncpg on the store's own :class:`StatementPool` (two: one of them for
writes that need not wait for their own flush)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.sql.drivers.base import Rows
from idempotency_mw.stores.sql.drivers.pooled import PooledDriver
from idempotency_mw.stores.sql.drivers.statement_pool import StatementPool


class _Pools:
    """The pool of durable statements, and the one of ``durable=False`` statements, whose
    connections run with ``synchronous_commit=off``: such a commit is answered before the WAL
    reached the disk (a crash may lose it, never corrupt anything). The WAL is written in order,
    so the next durable commit on the database (a fenced transaction) makes it last too."""

    def __init__(self, connect: Callable[..., Awaitable[Any]]) -> None:
        self.durable = StatementPool(connect, max_size=10)
        self.fast = StatementPool(
            functools.partial(connect, server_settings={"synchronous_commit": "off"}), max_size=10
        )

    def of(self, durable: bool) -> StatementPool:
        return self.durable if durable else self.fast

    async def aclose(self) -> None:
        await asyncio.gather(self.durable.aclose(), self.fast.aclose())


class AsyncpgDriver(PooledDriver):
    """PostgreSQL through asyncpg, statements prepared once per connection."""

    def __init__(self, url: URL) -> None:
        import asyncpg

        super().__init__(url, postgresql.asyncpg.dialect(), "postgresql")  # type: ignore[no-untyped-call]
        self.errors = (asyncpg.PostgresError, asyncpg.InterfaceError, SQLAlchemyError)
        self._dsn = url.set(drivername="postgresql").render_as_string(False)

    async def _open_pool(self) -> _Pools:
        return _Pools(self.connect)

    async def connect(self, **options: Any) -> Any:
        """An asyncpg connection of its own, outside the pool: the caller closes it."""
        import asyncpg

        return await asyncpg.connect(self._dsn, **options)

    async def _close_pool(self, pool: _Pools) -> None:
        await pool.aclose()

    def _may_rerun(self, exc: Exception) -> bool:
        import asyncpg

        return isinstance(exc, (asyncpg.ConnectionDoesNotExistError, ConnectionError))

    async def fetch(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> Rows:
        compiled = self._compile(statement)
        args = compiled.args(params)
        return await self._on_pool(
            lambda pools: pools.of(durable).fetch(compiled.sql, args), deadline, compiled.replies
        )

    async def change(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,
    ) -> int:
        compiled = self._compile(statement)
        args = compiled.args(params)
        status: str = await self._on_pool(
            lambda pools: pools.of(durable).execute(compiled.sql, args),
            deadline,
            compiled.replies,
        )
        return int(status.rsplit(" ", 1)[-1])
