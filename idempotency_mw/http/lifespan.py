"""Start-up and shutdown work: the store check, the background purge, closing the store.

:func:`store_lifespan` is the async context manager the middleware enters during the app's ASGI
lifespan; a service with a lifespan of its own can enter it there instead (and give the
middleware ``lifespan=False``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw.engine.cleanup import PurgeSchedule, background_purge
from idempotency_mw.stores.base import Store
from idempotency_mw.stores.checks import check_store

logger = logging.getLogger("idempotency_mw")


@asynccontextmanager
async def store_lifespan(
    store: Store,
    *,
    purge: PurgeSchedule | None = PurgeSchedule(),  # noqa: B008  (frozen, so shareable)
    server_checks: bool = True,
) -> AsyncIterator[None]:
    """Check ``store`` (see :func:`check_store`), purge it on ``purge``'s schedule while the
    block runs, close it after.

    The store is closed and the purge stopped however the block ends.
    """
    async with AsyncExitStack() as stack:
        stack.push_async_callback(store.aclose)
        await check_store(store, server_checks=server_checks)
        if purge is not None:
            await stack.enter_async_context(background_purge(store, purge))
        yield


async def run_lifespan(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    work: Callable[[], AbstractAsyncContextManager[None]],
) -> None:
    """Run the app's ASGI lifespan with ``work`` entered after its start-up, left after its end.

    A failure to enter ``work`` fails the start-up. ``work`` is left before
    the shutdown is reported, also when the app's own shutdown failed or its lifespan ended
    without one.
    """
    stack = AsyncExitStack()

    async def wrapped_send(message: Message) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            # Raising here fails the start-up: the app reports it (Starlette sends
            # lifespan.startup.failed with the error), or the server sees the exception.
            await stack.enter_async_context(work())
        elif kind in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            await stack.aclose()
        await send(message)

    try:
        await app(scope, receive, wrapped_send)
    finally:
        await stack.aclose()
