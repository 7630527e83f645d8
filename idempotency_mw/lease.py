"""The lease keeper: renews a claim while its work runs, and knows until when it is proven."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from idempotency_mw._backoff import Backoff

logger = logging.getLogger("idempotency_mw")

#: Renew: ``True`` while the token owns the key, ``False`` once taken over, ``None`` when the
#: store failed to answer.
Renew = Callable[[], Awaitable[bool | None]]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class LeaseKeeper:
    """Keeps one claim's lease, proven until the moment the last successful claim or renewal
    was *sent* plus the lease, on the monotonic ``clock``.

    Renewals begin after a third of the lease and retry quickly when the store fails, so a
    store pause shorter than a third of the lease costs nothing. When the proof runs out, or
    another request took the key over, ``on_lost`` is called once; the keeper then goes on
    renewing, so protection resumes if the store answers again (``lost`` stays true: the work
    was told). :meth:`keep` runs as a child of the work's task group, cancelled when it ends.
    ``key_id()`` names the key in its log lines.
    """

    def __init__(
        self,
        renew: Renew,
        lease: float,
        *,
        claimed_at: float,
        on_lost: Callable[[], None],
        key_id: Callable[[], str],
        outlive: Callable[[asyncio.Future[bool | None]], None],
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._renew = renew
        self._lease = lease
        self._on_lost = on_lost
        self._key_id = key_id
        self._outlive = outlive
        self._clock = clock
        self._sleep = sleep
        self.proven_until = claimed_at + lease
        self.lost = False

    def first_renewal_in(self) -> float:
        """Seconds until the first renewal is due: a third of the lease after the claim; 0
        when it is due already (work may start only once :meth:`renew_to_start` proved the
        lease again)."""
        return max(0.0, self.proven_until - self._lease * 2 / 3 - self._clock())

    async def renew_to_start(self) -> bool:
        """One renewal before the work starts: whether it proved the lease (work never starts
        on a lease that may already be another request's)."""
        return await self._renew_once() is True

    async def keep(self) -> None:
        """Renew every third of the lease until cancelled (the work ended)."""
        await self._sleep(self.first_renewal_in())
        failures = 0
        while True:
            owned = await self._renewal_within_proof()
            if owned is False:
                logger.warning("lost the lease of key %s to another request", self._key_id())
                self._lose()
                return
            if owned is None:
                retry = Backoff(max(0.05, self._lease / 20), self._lease / 3, jitter=0.5)
                await self._sleep(retry.delay(failures))
                failures += 1
            else:
                failures = 0
                await self._sleep(self._lease / 3)

    async def _renewal_within_proof(self) -> bool | None:
        """One renewal; if the proof runs out before it answers, the work is told at once,
        and the renewal still runs to its end: cut short, it would throw away the store's
        connection mid-call for an answer that may yet restore the proof."""
        renewal = asyncio.ensure_future(self._renew_once())
        try:
            remaining = self.proven_until - self._clock()
            if remaining > 0:
                await asyncio.wait({renewal}, timeout=remaining)
            if not renewal.done() or self.proven_until <= self._clock():
                self._lose()
            return await asyncio.shield(renewal)
        except asyncio.CancelledError:
            if not renewal.done():
                self._outlive(renewal)  # the work ended: its answer no longer matters
            raise

    async def _renew_once(self) -> bool | None:
        sent_at = self._clock()
        owned = await self._renew()
        if owned:
            self.proven_until = sent_at + self._lease
        return owned

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self._on_lost()


class KeeperStarts:
    """Starts lease keepers a third of their lease after the claim, with one event loop timer
    for all the work in flight on a loop: most work ends long before, and a loop timer per
    call (made, ordered among the loop's others, cancelled) would cost more than the rest of
    its lease's bookkeeping. Each event loop has its own (an engine may serve the loops of
    several test clients)."""

    def __init__(self) -> None:
        self._current: LoopStarts | None = None
        self._by_loop: dict[asyncio.AbstractEventLoop, LoopStarts] = {}

    def on_this_loop(self) -> LoopStarts:
        """The running event loop's starts."""
        loop = asyncio.get_running_loop()
        current = self._current
        if current is None or current.loop is not loop:
            self._by_loop = {
                other: starts for other, starts in self._by_loop.items() if not other.is_closed()
            }
            current = self._current = self._by_loop.setdefault(loop, LoopStarts(loop))
        return current

    def close(self) -> None:
        """Start nothing more (the engine closed)."""
        for starts in self._by_loop.values():
            starts.close()
        self._by_loop.clear()
        self._current = None


class LoopStarts:
    """The keeper starts of one event loop: one timer, at the earliest start due."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._now = loop.time
        self._waiting: dict[object, tuple[float, Callable[[], None]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, work: object, delay: float, start: Callable[[], None]) -> None:
        """Call ``start()`` in ``delay`` seconds, unless ``work`` is discarded before."""
        when = self._now() + delay
        self._waiting[work] = (when, start)
        if when < self._timer_at:
            self._set_timer(when)

    def discard(self, work: object) -> None:
        """``work`` ended: its keeper does not start."""
        self._waiting.pop(work, None)

    def close(self) -> None:
        self._set_timer(math.inf)
        self._waiting.clear()

    def _set_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if when == math.inf else self.loop.call_at(when, self._fire)
        self._timer_at = when

    def _fire(self) -> None:
        when, self._timer, self._timer_at = self._timer_at, None, math.inf
        # Earliest first (the timer may fire late, several starts due); n breaks ties.
        due = sorted(
            (at, n, work) for n, (work, (at, _)) in enumerate(self._waiting.items()) if at <= when
        )
        for _, _, work in due:
            _, start = self._waiting.pop(work)
            start()
        if self._waiting:
            self._set_timer(min(at for at, _ in self._waiting.values()))
