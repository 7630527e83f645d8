"""A driver's own connection pool per event loop, for the drivers that bypass SQLAlchemy."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import URL, Dialect
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from idempotency_mw.exceptions import describe
from idempotency_mw.stores.replies import ReplyWait
from idempotency_mw.stores.sql.drivers.base import CompileCache, T
from idempotency_mw.stores.sql.drivers.reruns import with_reruns

logger = logging.getLogger("idempotency_mw")

#: Seconds ``aclose`` waits for the pools of other event loops to close there.
_CLOSE_OTHERS_WITHIN = 5.0


class PooledDriver(abc.ABC):
    """A driver's own connection pool, opened on first use; statements compiled once.

    A pool's connections belong to the event loop that opened them. Used from another loop (a
    ``TestClient`` without ``with`` runs each request in a loop of its own), the driver opens a
    pool there and has the old one closed in its own loop if that loop still runs (``aclose``
    waits for that), else leaves it to go with its loop. Subclasses open and close the pool and
    run the compiled SQL on it. Anything that needs a SQLAlchemy connection (the start-up
    check) gets one from an engine without a pool.
    """

    errors: tuple[type[Exception], ...]

    def __init__(self, url: URL, dialect: Dialect, dialect_name: str) -> None:
        self.dialect_name = dialect_name
        self.on_callers_machine = False
        self.url = url
        self._compile = CompileCache(dialect)
        self._pool: Any = None
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._opening: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._engine: AsyncEngine | None = None
        self._leaving: set[concurrent.futures.Future[None]] = set()

    @abc.abstractmethod
    async def _open_pool(self) -> Any: ...

    @abc.abstractmethod
    async def _close_pool(self, pool: Any) -> None: ...

    @abc.abstractmethod
    def _may_rerun(self, exc: Exception) -> bool:
        """Whether a statement that failed with ``exc`` had no effect and may run again."""

    async def _on_pool(
        self, run: Callable[[Any], Awaitable[T]], deadline: float, replies: ReplyWait
    ) -> T:
        """``run(pool)``, run again when it fails in a way ``_may_rerun`` allows; ``replies``
        (the statement's) keeps the loop awake while it runs."""
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            await self._open_in(loop)
        pool = self._pool
        return await replies.wait(
            with_reruns(lambda: run(pool), self._may_rerun, deadline=deadline)
        )

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
            closing = asyncio.run_coroutine_threadsafe(self._close_pool(pool), loop)
            self._leaving.add(closing)
            closing.add_done_callback(self._left)

    def _left(self, closing: concurrent.futures.Future[None]) -> None:
        self._leaving.discard(closing)
        if not closing.cancelled() and (error := closing.exception()) is not None:
            logger.warning(
                "closing %s's pool of another event loop failed: %s", self.url, describe(error)
            )

    async def run_sync(self, operation: Callable[[Connection], T], *, deadline: float) -> T:
        if self._engine is None:
            self._engine = create_async_engine(
                self.url, poolclass=NullPool, isolation_level="AUTOCOMMIT"
            )
        async with self._engine.connect() as conn:
            return await conn.run_sync(operation)

    async def aclose(self) -> None:
        """Close this loop's pool, and wait (a few seconds at most) for those of other loops."""
        pool = self._pool
        if pool is not None and self._pool_loop is asyncio.get_running_loop():
            self._pool = self._pool_loop = None
            await self._close_pool(pool)
        else:
            self._leave()
        if self._leaving:
            await asyncio.wait(
                [asyncio.wrap_future(closing) for closing in self._leaving],
                timeout=_CLOSE_OTHERS_WITHIN,
            )
        if self._engine is not None:
            await self._engine.dispose()
