"""How a command's caller waits for Redis's reply: yielding first, while replies come fast.

A nearby Redis answers within tens of microseconds: less than it takes an event loop asleep in
its poll to be woken (most of all on a virtual machine). So while a reply is awaited, a callback
keeps the loop from sleeping for a bounded time (the loop then polls without waiting, and runs
whatever else is ready), and only then does the loop wait asleep. The caller is suspended once,
however long it waits. Where replies are usually slower (a remote server), keeping the loop awake
would only burn the processor: after each reply that came too late, the next waits let the loop
sleep at once, twice as many each time (up to 63), and a reply in time makes every wait keep it
awake again.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest the loop is kept from sleeping while a reply is awaited, in seconds.
AWAKE_LIMIT = 100e-6
#: After this many replies in a row too late, the loop is kept awake once in 64 waits.
_MOST_MISSES = 6


class ReplyWait:
    """Waits for the replies of one connection: :meth:`reply` keeps the event loop from
    sleeping for up to ``limit`` seconds, and less often while replies come too late."""

    __slots__ = ("_limit", "_misses", "_skips")

    def __init__(self, limit: float = AWAKE_LIMIT) -> None:
        self._limit = limit
        #: Waits in a row whose reply came after the loop was let sleep.
        self._misses = 0
        #: Waits left that let the loop sleep at once.
        self._skips = 0

    def reply(self, pending: asyncio.Future[T]) -> asyncio.Future[T]:
        """``pending``, for its caller to await, with the loop kept awake for it."""
        if self._skips:
            self._skips -= 1
        elif not pending.done():
            self._keep_awake(pending)
        return pending

    def _keep_awake(self, pending: asyncio.Future[Any]) -> None:
        loop = pending.get_loop()
        until = loop.time() + self._limit

        def again() -> None:
            if pending.done():
                self._misses = 0
            elif loop.time() < until:
                loop.call_soon(again)
            else:
                self._misses = min(self._misses + 1, _MOST_MISSES)
                self._skips = 2**self._misses - 1

        loop.call_soon(again)
