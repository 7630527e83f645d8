"""How a store waits for its server's reply: with the event loop kept awake for a moment.

A nearby Redis answers a command, and a database a read, within tens of microseconds: less than
it takes an event loop asleep in its poll to be woken (most of all on a virtual machine). So
while a reply is awaited, a callback keeps the loop from sleeping for a bounded time (the loop
then polls without waiting, and runs whatever else is ready), and only then does the loop wait
asleep. Where replies are usually slower (a commit that waits for the disk, a remote server),
keeping the loop awake would only burn the processor: after each reply that came too late, the
next waits let the loop sleep at once, twice as many each time (up to 63), and a reply in time
makes every wait keep it awake again. Not for a worker thread's result (SQLite's commits): a
loop kept awake would hold the interpreter's lock that the thread needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

#: The longest the loop is kept from sleeping while a reply is awaited, in seconds.
AWAKE_LIMIT = 250e-6
#: After this many replies in a row too late, the loop is kept awake once in 64 waits.
_MOST_MISSES = 6


class ReplyWait:
    """Waits for the replies of one kind (one connection's, one statement's): :meth:`wait`
    keeps the event loop from sleeping for up to ``limit`` seconds, and less often while
    replies come too late."""

    __slots__ = ("_limit", "_misses", "_skips")

    def __init__(self, limit: float = AWAKE_LIMIT) -> None:
        self._limit = limit
        #: Waits in a row whose reply came after the loop was let sleep.
        self._misses = 0
        #: Waits left that let the loop sleep at once.
        self._skips = 0

    async def wait(self, reply: Awaitable[T]) -> T:
        """``await reply``, with the loop kept awake for it."""
        if self._skips:
            self._skips -= 1
            return await reply
        awake = _KeptAwake(self, self._limit)
        try:
            return await reply
        finally:
            awake.settled = True

    def _came_in_time(self) -> None:
        self._misses = 0

    def _came_too_late(self) -> None:
        self._misses = min(self._misses + 1, _MOST_MISSES)
        self._skips = 2**self._misses - 1


class _KeptAwake:
    """The callback that keeps the loop awake for one wait: run on every turn of the loop
    until the reply came or the limit passed (an object, not a closure that schedules
    itself, so that nothing is left in a reference cycle)."""

    __slots__ = ("_loop", "_until", "_wait", "settled")

    def __init__(self, wait: ReplyWait, limit: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._until = self._loop.time() + limit
        self._wait = wait
        self.settled = False
        self._loop.call_soon(self)

    def __call__(self) -> None:
        if self.settled:
            self._wait._came_in_time()
        elif self._loop.time() < self._until:
            self._loop.call_soon(self)
        else:
            self._wait._came_too_late()
