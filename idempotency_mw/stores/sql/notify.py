"""SQLStore's settlement feed: PostgreSQL LISTEN on one asyncpg connection of the engine's.

``complete`` and ``release`` NOTIFY the digest of the record they settle in the very statement
that settles it (:func:`~idempotency_mw.stores.sql.statements.announced`); here a connection
that the engine opens, taken out of its pool for good, LISTENs for those digests. SQLite and
MariaDB/MySQL have no notifications.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from idempotency_mw.stores.feed import CHECK_AFTER
from idempotency_mw.stores.sql.statements import SETTLED_CHANNEL
from idempotency_mw.values.exceptions import SettlementFeedUnsupported

#: How the listening connection shows in ``pg_stat_activity``.
APPLICATION_NAME = "idempotency-mw settlements"

Connect = Callable[[], Awaitable[Any]]


def connector(engine: AsyncEngine, store: str) -> Connect:
    """How to open an asyncpg connection on ``engine``'s database, as the engine opens its own
    (the URL's options included), that the caller closes.

    Raises :class:`SettlementFeedUnsupported` where there is none: another database, or an
    engine on another PostgreSQL driver.
    """
    dialect = engine.dialect
    if dialect.name != "postgresql":
        raise SettlementFeedUnsupported(
            f"{store} cannot announce settled records: {dialect.name} has no "
            "notifications; requests that wait for a key poll the store"
        )
    if dialect.driver != "asyncpg":
        raise SettlementFeedUnsupported(
            f"{store} listens for settled records through asyncpg only, and its engine uses "
            f"{dialect.driver}; requests that wait for a key poll the store"
        )

    async def connect() -> Any:
        pooled = await engine.raw_connection()
        connection = pooled.driver_connection
        pooled.detach()
        return connection

    return connect


async def listen(
    connect: Connect, on_settled: Callable[[str], None], *, answer_within: float
) -> None:
    """Pass each digest announced on the channel to ``on_settled`` until the connection is lost
    (then raise), checking it after ``CHECK_AFTER`` seconds of silence. Opening it and each
    check get ``answer_within`` seconds."""

    def relay(connection: Any, pid: int, channel: str, digest: str) -> None:
        on_settled(digest)

    loop = asyncio.get_running_loop()
    lost: asyncio.Future[None] = loop.create_future()

    def on_lost(connection: Any) -> None:
        if not lost.done():
            lost.set_result(None)

    async with asyncio.timeout(answer_within):
        connection = await connect()
    try:
        connection.add_termination_listener(on_lost)
        async with asyncio.timeout(answer_within):
            await connection.execute(f"SET application_name = '{APPLICATION_NAME}'")
            await connection.add_listener(SETTLED_CHANNEL, relay)
        while True:
            await asyncio.wait({lost}, timeout=CHECK_AFTER)
            if lost.done():
                raise ConnectionError("the server closed the listening connection")
            async with asyncio.timeout(answer_within):
                await connection.fetchval("SELECT 1")
    finally:
        # At once and without a round trip: the connection may be dead, or the task cancelled.
        connection.terminate()
