"""``wait=``: requests waiting for a key in progress, woken when it is settled."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from contextvars import Context

from idempotency_mw._backoff import Backoff
from idempotency_mw.stores.base import SettlementFeed, Store
from idempotency_mw.values.exceptions import SettlementFeedUnsupported

logger = logging.getLogger("idempotency_mw")

#: The first pause between two polls of a waiting request.
_FIRST_POLL = 0.02
#: The longest pause between two polls of a waiting request: without a settlement feed, and
#: with one, when polling only makes up for news that got lost.
_LAST_POLL = 0.5
_LAST_POLL_FED = 2.0
#: How long a settlement is remembered for a claim that was on its way when the news came.
_REMEMBERED = 1.0


class Settlements:
    """Requests of this worker waiting for a key in progress, woken when it is settled.

    A request of this worker that settles a key wakes its waiters itself. When the store offers
    a :class:`~idempotency_mw.stores.base.SettlementFeed`, the first request that waits starts
    one watcher per event loop, which wakes them when any worker settles their key. Keys are
    known by their digest (:func:`~idempotency_mw.values.metrics.key_hash`).
    """

    def __init__(self, store: Store) -> None:
        self._feed = store if isinstance(store, SettlementFeed) else None
        self._watcher: asyncio.Task[None] | None = None
        self._waiting: dict[str, tuple[asyncio.Event, int]] = {}
        self._recent: dict[str, float] = {}

    @property
    def polling(self) -> Backoff:
        """The pauses between two polls of a waiting request: longer while a feed brings the
        news, since polling then only makes up for news that got lost."""
        return Backoff(_FIRST_POLL, _LAST_POLL if self._feed is None else _LAST_POLL_FED, jitter=0)

    async def wait(self, digest: str, seconds: float, *, since: float) -> None:
        """Until ``digest`` is settled, or ``seconds`` have passed; not at all if it was settled
        after ``since`` (``time.monotonic()`` when the claim that found it in progress began)."""
        self._watch()
        if self._recent.get(digest, -math.inf) >= since:
            return
        event, waiters = self._waiting.get(digest, (asyncio.Event(), 0))
        self._waiting[digest] = (event, waiters + 1)
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            current = self._waiting.get(digest)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._waiting[digest]
                else:
                    self._waiting[digest] = (event, current[1] - 1)

    def settled(self, digest: str) -> None:
        """Wake whoever waits for ``digest``."""
        now = time.monotonic()
        recent = self._recent
        recent.pop(digest, None)
        recent[digest] = now  # last in order: the oldest come first
        while (oldest := next(iter(recent))) != digest and recent[oldest] < now - _REMEMBERED:
            del recent[oldest]
        entry = self._waiting.pop(digest, None)
        if entry is not None:
            entry[0].set()

    def _watch(self) -> None:
        """Start the feed's watcher in this event loop, unless it runs already."""
        if self._feed is None:
            return
        loop = asyncio.get_running_loop()
        watcher = self._watcher
        if watcher is None or watcher.done() or watcher.get_loop() is not loop:
            # A context of its own: the watcher outlives the request that starts it.
            self._watcher = loop.create_task(self._follow(self._feed), context=Context())

    async def _follow(self, feed: SettlementFeed) -> None:
        try:
            await feed.watch_settlements(self.settled)
        except SettlementFeedUnsupported as exc:
            logger.info("%s", exc)
            self._feed = None
        except Exception:
            logger.exception("the settlement feed of %r failed; waiting requests poll it", feed)
            self._feed = None

    async def stop(self) -> None:
        """Stop the watcher of this event loop (at shutdown)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher.get_loop() is asyncio.get_running_loop():
            watcher.cancel()
            await asyncio.wait({watcher})
