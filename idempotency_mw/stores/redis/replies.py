"""How a command's caller waits for Redis's reply: yielding first, while replies come fast.

A nearby Redis answers within tens of microseconds: less than it takes an event loop asleep in
its poll to be woken (most of all on a virtual machine). So the caller first yields to the loop
(which then polls without sleeping, and runs whatever else is ready) for a bounded time, and only
then waits asleep. Where replies are usually slower (a remote server), yielding would only burn
the processor: after each wait whose reply came too late, the next waits skip the yielding, twice
as many each time (up to 63), and a reply in time makes every wait yield again.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")

#: The longest a waiting caller keeps yielding before it waits asleep, in seconds.
YIELD_LIMIT = 100e-6
#: After this many replies in a row too late for the yielding, it is tried once in 64 waits.
_MOST_MISSES = 6


class ReplyWait:
    """Waits for the replies of one connection: :meth:`reply` yields to the loop for up to
    ``limit`` seconds, then waits asleep, and yields less often while replies come too late."""

    __slots__ = ("_limit", "_misses", "_skips")

    def __init__(self, limit: float = YIELD_LIMIT) -> None:
        self._limit = limit
        #: Waits in a row whose reply came after the yielding ended.
        self._misses = 0
        #: Waits left that go asleep at once.
        self._skips = 0

    async def reply(self, pending: asyncio.Future[T]) -> T:
        """``pending``'s result (or exception); cancelling the caller cancels ``pending``."""
        if self._skips:
            self._skips -= 1
        elif not pending.done():
            await self._yield_until_settled(pending)
        return await pending

    async def _yield_until_settled(self, pending: asyncio.Future[T]) -> None:
        loop = pending.get_loop()
        until = loop.time() + self._limit
        try:
            while not pending.done():
                if loop.time() >= until:
                    self._misses = min(self._misses + 1, _MOST_MISSES)
                    self._skips = 2**self._misses - 1
                    return
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        self._misses = 0
