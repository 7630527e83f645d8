"""MariaDB/MySQL through an asyncmy pool, in autocommit at READ COMMITTED."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.sql.drivers.base import Rows
from idempotency_mw.stores.sql.drivers.pooled import PooledDriver
from idempotency_mw.stores.sql.drivers.reruns import MYSQL_RERUN, READ_COMMITTED, mysql_error_code


class AsyncmyDriver(PooledDriver):
    """MariaDB/MySQL through asyncmy's own pool, statements compiled once."""

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
        return isinstance(exc, self._driver_error) and mysql_error_code(exc) in MYSQL_RERUN

    async def _execute(
        self, statement: Executable, params: Mapping[str, Any], deadline: float, *, fetch: bool
    ) -> tuple[Rows, int]:
        compiled = self._compile(statement)
        args = compiled.args(params)

        async def run(pool: Any) -> tuple[Rows, int]:
            async with pool.acquire() as conn, conn.cursor() as cursor:
                await cursor.execute(compiled.sql, args)
                return (await cursor.fetchall() if fetch else ()), int(cursor.rowcount)

        return await self._on_pool(run, deadline, compiled.replies)

    async def fetch(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,  # InnoDB's flush is global only
    ) -> Rows:
        return (await self._execute(statement, params, deadline, fetch=True))[0]

    async def change(
        self,
        statement: Executable,
        params: Mapping[str, Any],
        *,
        deadline: float,
        durable: bool = True,  # InnoDB's flush is global only
    ) -> int:
        return (await self._execute(statement, params, deadline, fetch=False))[1]
