"""What the stores' settlement feeds share: a listening connection kept open until the store
closes, opened again with capped backoff whenever it is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from idempotency_mw._backoff import Backoff
from idempotency_mw.values.exceptions import describe

logger = logging.getLogger("idempotency_mw")

#: The pauses before opening a lost connection again: doubling up to 5 s, jittered so that
#: the workers that lost their connections together do not all come back together.
RETRIES = Backoff(first=0.1, cap=5.0)
#: How long a listening connection may stay silent before it is asked to prove it still works:
#: a connection that a firewall or NAT dropped without a word would otherwise wait forever.
CHECK_AFTER = 30.0

Listen = Callable[[], Awaitable[None]]


class Feeds:
    """The settlement feeds of one store; :meth:`close` (from the store's ``aclose``) ends them."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Future[None], asyncio.Future[None]] = {}

    async def run(self, store: str, listen: Listen) -> None:
        """Run ``listen()`` until the store closes, again after each failure, logged.

        ``listen`` opens its connection, subscribes and relays notifications; it only ever ends
        by raising (its connection was lost) or by being cancelled (the feed ends).
        """
        loop = asyncio.get_running_loop()
        closed, ended = loop.create_future(), loop.create_future()
        self._running[closed] = ended
        failures = 0
        try:
            while not closed.done():
                began = time.monotonic()
                attempt = asyncio.ensure_future(listen())
                try:
                    await asyncio.wait({attempt, closed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not attempt.done():
                        attempt.cancel()
                        await asyncio.wait({attempt})
                error = None if attempt.cancelled() else attempt.exception()
                if closed.done():
                    break
                if time.monotonic() - began > RETRIES.cap:
                    failures = 0  # it had been working: retry soon
                pause = RETRIES.delay(failures)
                logger.warning(
                    "the settlement feed of %s lost its connection (%s); trying again in %.1f s",
                    store,
                    "it ended" if error is None else describe(error),
                    pause,
                )
                await asyncio.wait({closed}, timeout=pause)
                failures += 1
        finally:
            del self._running[closed]
            ended.set_result(None)

    async def close(self) -> None:
        """End the feeds running in this event loop, once their connections are closed."""
        loop = asyncio.get_running_loop()
        ending = []
        for closed, ended in list(self._running.items()):
            if closed.get_loop() is loop:
                if not closed.done():
                    closed.set_result(None)
                ending.append(ended)
        if ending:
            await asyncio.wait(ending)
