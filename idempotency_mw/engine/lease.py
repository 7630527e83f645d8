"""The lease keeper: renews a claim while its work runs, and knows until when it is proven."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from idempotency_mw._backoff import Backoff

logger = logging.getLogger("idempotency_mw")

#: Renew: ``True`` while the token owns the key, ``False`` once taken over, ``None`` when the
#: store failed to answer.
Renew = Callable[[], Awaitable[bool | None]]
Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


def first_renewal_in(proven_at: float, lease: float, now: float) -> float:
    """Seconds from ``now`` until the first renewal of a lease proven at ``proven_at`` (when
    its claim or renewal was sent) is due: a third of the lease after it; 0 when due already."""
    return max(0.0, proven_at + lease / 3 - now)


class FirstRenewals:
    """When each claim held in one event loop is first due for renewal, watched by one loop
    timer rather than one per claim: most claims end before a third of their lease, and then
    they cost a dict entry, not a timer. ``start()`` of a claim still held when due is called
    once.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: When each is due, and when the timer fires, on the loop's clock.
        self._due: dict[Callable[[], None], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0

    def add(self, start: Callable[[], None], due_in: float) -> None:
        """Call ``start()`` in ``due_in`` seconds unless :meth:`discard` comes first."""
        due = self.loop.time() + due_in
        self._due[start] = due
        if self._timer is None or due < self._timer_due:
            self._set_timer(due)

    def discard(self, start: Callable[[], None]) -> None:
        """The claim ended: its renewals are not due any more."""
        self._due.pop(start, None)

    def _set_timer(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self.loop.call_at(due, self._fire)

    def _fire(self) -> None:
        # Due: what the loop found due with this timer.
        fired, self._timer = self._timer_due, None
        for start, due in list(self._due.items()):
            if due <= fired:
                del self._due[start]
                start()
        if self._due:
            self._set_timer(min(self._due.values()))


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
        clock: Clock = time.monotonic,
        sleep: Sleep = anyio.sleep,
    ) -> None:
        self._renew = renew
        self._lease = lease
        self._on_lost = on_lost
        self._key_id = key_id
        self._clock = clock
        self._sleep = sleep
        self.proven_until = claimed_at + lease
        self.lost = False

    def first_renewal_in(self) -> float:
        """Seconds until the first renewal is due: a third of the lease after the claim; 0
        when it is due already (work may start only once :meth:`renew_to_start` proved the
        lease again)."""
        return first_renewal_in(self.proven_until - self._lease, self._lease, self._clock())

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
        """One renewal; if the proof runs out before it answers, the work is told at once
        while the renewal goes on (its answer may yet restore the proof)."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._lose_when_unproven)
            owned = await self._renew_once()
            group.cancel_scope.cancel()
        if self.proven_until <= self._clock():
            self._lose()
        return owned

    async def _lose_when_unproven(self) -> None:
        await self._sleep(max(0.0, self.proven_until - self._clock()))
        self._lose()

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
