"""The claim engine that every entry shares: claim, hold (lease and fence hand-off), settle.

The HTTP middleware, the idempotent functions and the MCP integration each turn their call
into a :class:`ClaimRequest`; what happens to a key from there on is decided here, once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import anyio

from idempotency_mw.engine.fence import CurrentClaim
from idempotency_mw.engine.lease import Clock, FirstRenewals, LeaseKeeper, first_renewal_in
from idempotency_mw.engine.waiting import Settlements
from idempotency_mw.stores.base import Store, takes_keyword
from idempotency_mw.values.exceptions import ConfigurationError, StoreError
from idempotency_mw.values.metrics import Event, EventHook, EventKind, key_hash
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse
from idempotency_mw.values.settings import LeaseLostAction

logger = logging.getLogger("idempotency_mw")

T = TypeVar("T")

_OUTCOME_EVENTS = {
    ClaimOutcome.ACQUIRED: EventKind.FIRST_RUN,
    ClaimOutcome.REPLAY: EventKind.REPLAY,
    ClaimOutcome.IN_PROGRESS: EventKind.IN_PROGRESS,
    ClaimOutcome.MISMATCH: EventKind.MISMATCH,
    ClaimOutcome.UNREPLAYABLE: EventKind.NOT_REPLAYABLE,
    ClaimOutcome.CREDENTIAL_MISMATCH: EventKind.CREDENTIAL_MISMATCH,
    ClaimOutcome.COMMITTED_WITHOUT_RESPONSE: EventKind.COMMITTED_WITHOUT_RESPONSE,
    ClaimOutcome.EXPIRED: EventKind.EXPIRED_KEY,
}

#: A store call's keywords: ``durable=False`` when its flush may be skipped; never changed.
_DURABLE: Mapping[str, bool] = {}
_NOT_DURABLE: Mapping[str, bool] = {"durable": False}


class ClaimRequest(NamedTuple):
    """What one call asks of the engine: its key in its scope, the fingerprint of what it
    means, the digest of its credentials, and its times in seconds. (A named tuple: one is
    made for every call, immutable and cheaper to make than a frozen dataclass.)"""

    scope: str
    key: str
    fingerprint: str
    ttl: float
    lease: float
    wait: float = 0.0
    binding: str = ""
    #: The call declares it commits its effect with ``fence()``: its claim and completion
    #: need not wait for their own flush (see :class:`~idempotency_mw.stores.base.Store`).
    fenced: bool = False
    #: When its caller first sent it (Unix seconds), if it said: the store refuses it
    #: (``EXPIRED``) when the key is free and that is longer ago than ``ttl``.
    first_sent: float | None = None


class LeaseUnproven(Exception):
    """The claim took so long that its lease may already be another's: nothing may run."""


class ClaimEngine:
    """One store's claims, shared by every entry that protects calls with it.

    ``on_event`` receives an :class:`~idempotency_mw.values.metrics.Event` per outcome and store
    call (guarded by the caller); ``on_lease_lost`` says whether work whose lease could not be
    proven is stopped (``"cancel"``, unless its answer began or its effect committed) or goes
    on unprotected; ``clock`` is the monotonic clock leases are proven on.
    """

    def __init__(
        self,
        store: Store,
        *,
        on_event: EventHook | None = None,
        on_lease_lost: LeaseLostAction = "cancel",
        clock: Clock = time.monotonic,
    ) -> None:
        self.store = store
        self.on_event = on_event
        self.on_lease_lost = on_lease_lost
        self.clock = clock
        self.settlements = Settlements(store)
        self._first_renewals: FirstRenewals | None = None
        #: Whether the store takes ``durable=`` (one written for an earlier protocol may not).
        self.skips_flushes = takes_keyword(store.claim, "durable") and takes_keyword(
            store.complete, "durable"
        )
        #: Whether the store decides first-sent times (one written for an earlier protocol
        #: may not: a call that gives one is then refused with a ConfigurationError).
        self.decides_first_sent = takes_keyword(store.claim, "first_sent")
        #: The routes declared fenced that returned without ``fence()``, logged once each.
        self._unfenced: set[tuple[str, str]] = set()

    async def aclose(self) -> None:
        """Stop the settlement feed's watcher."""
        await self.settlements.stop()

    def first_renewals(self) -> FirstRenewals:
        """The first renewals of the claims held in the running event loop (a TestClient
        without `with` runs each request in a loop of its own)."""
        loop = asyncio.get_running_loop()
        renewals = self._first_renewals
        if renewals is None or renewals.loop is not loop:
            renewals = self._first_renewals = FirstRenewals(loop)
        return renewals

    def answered_unfenced(self, method: str, route: str) -> None:
        """Say that a call of a route declared fenced answered without ``fence()``: once per
        route, since one that fences only on some paths would say it on every call."""
        if (method, route) not in self._unfenced:
            self._unfenced.add((method, route))
            logger.warning(
                "%s %s declares fenced=True but answered without fence(): its response is "
                "recorded durably, the only proof of its effect (said once for this route)",
                method,
                route,
            )

    def call(self, request: ClaimRequest, *, method: str, route: str) -> Call:
        """The way of one call through the engine (``method`` and ``route`` name it in events:
        an HTTP method and route template, or ``"CALL"`` and a function's name)."""
        return Call(self, request, method, route)

    def hold(
        self,
        *,
        answered: Callable[[], bool],
        on_stopped: Callable[[], Awaitable[None]] | None = None,
    ) -> Hold:
        """A block (``async with``) in which one call's work runs, its claim taken inside it
        (before the work, or at an endpoint's door) with :meth:`Hold.claim`, its lease then
        kept until the block ends.

        When the lease cannot be proven any more and the engine cancels, the block is
        stopped, unless ``answered()`` (its answer began) or its effect committed (``fence``):
        then it goes on, since nothing can take the key over any more. A stopped block ends
        quietly with ``hold.stopped`` set, once ``on_stopped`` answered its caller (before the
        renewal still in flight ends).
        """
        return Hold(self, answered, on_stopped)


class Hold:
    """One call's work, and the claim it holds once taken (see :meth:`ClaimEngine.hold`).

    The block's body is the work. Its lease keeper starts a third of the lease after the claim
    (most work ends sooner: until then the engine's :class:`FirstRenewals` only notes when it
    is due), in a task that the block cancels and waits for when the work ends.
    """

    def __init__(
        self,
        engine: ClaimEngine,
        answered: Callable[[], bool],
        on_stopped: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.engine = engine
        self._answered = answered
        self._on_stopped = on_stopped
        #: The work's deadline: none, until the lease is lost (then now, which stops it).
        self._work = asyncio.timeout(None)
        #: Where the first renewal is noted once the claim is held.
        self._renewals: FirstRenewals | None = None
        #: The lease keeper once it is needed, and its task.
        self._keeper: LeaseKeeper | None = None
        self._keeping: asyncio.Task[None] | None = None
        self.call: Call | None = None
        #: The claim ``fence()`` is handed, once acquired.
        self.claim_held: CurrentClaim | None = None
        #: The work was stopped because its lease could not be proven.
        self.stopped = False

    async def __aenter__(self) -> Hold:
        await self._work.__aenter__()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        stopped = False
        try:
            await self._work.__aexit__(kind, error, traceback)
        except TimeoutError:
            if not (self.stopped and self._work.expired()):
                raise  # the work's own
            stopped = True
        finally:
            if self._renewals is not None:
                self._renewals.discard(self._start_keeping)
            if self._keeping is not None:
                self._keeping.cancel()
                # The work's own exception goes on as it was raised: the wait only ends the
                # keeper (which never raises but its cancellation).
                await asyncio.wait({self._keeping})
            # The keeper and its task refer back to the block: let go of them.
            self._keeper, self._keeping, self._renewals = None, None, None
            if self.claim_held is not None:
                assert self.call is not None
                self.call.emit(EventKind.CLAIM_ENDED)
        if stopped and self._on_stopped is not None:
            await self._on_stopped()
        return stopped

    async def claim(self, call: Call) -> Claim:
        """Claim ``call``'s key; once acquired, its lease is kept until the block ends (raises
        as :meth:`keep` and :meth:`Call.claim` do)."""
        claim = await call.claim()
        if claim.outcome is ClaimOutcome.ACQUIRED:
            await self.keep(call, claim)
        return claim

    async def keep(self, call: Call, claim: Claim) -> CurrentClaim:
        """Keep the lease of ``claim``, acquired by ``call``, until the block ends: the claim
        to hand ``fence()``.

        Raises :class:`LeaseUnproven` when the claim took so long that its lease is not proven
        for long enough to start the work (nothing may run).
        """
        self.call = call
        token = claim.token
        assert token is not None
        request = call.request
        due_in = first_renewal_in(call.claimed_at, request.lease, self.engine.clock())
        if due_in == 0:
            # The claim took a third of the lease: proven again before the work starts.
            keeper = self._keeper = self._keeper_of(call, token)
            if not await keeper.renew_to_start():
                raise LeaseUnproven
            due_in = keeper.first_renewal_in()
        self.claim_held = CurrentClaim(
            self.engine.store,
            request.scope,
            request.key,
            token,
            request.ttl,
            fingerprint=request.fingerprint,
            binding=request.binding,
            lease=request.lease,
        )
        call.emit(EventKind.CLAIM_STARTED)
        self._renewals = self.engine.first_renewals()
        self._renewals.add(self._start_keeping, due_in)
        return self.claim_held

    def _keeper_of(self, call: Call, token: str) -> LeaseKeeper:
        return LeaseKeeper(
            lambda: call.renew(token),
            call.request.lease,
            claimed_at=call.claimed_at,
            on_lost=self._lost,
            key_id=lambda: call.key_id,  # hashed only if a log line needs it
            clock=self.engine.clock,
        )

    def _start_keeping(self) -> None:
        # A loop timer's callback runs outside any task, where anyio cannot tell which library
        # runs the loop: the keeper's task is asyncio's own.
        assert self.call is not None
        assert self.claim_held is not None
        if self._keeper is None:
            self._keeper = self._keeper_of(self.call, self.claim_held.token)
        self._keeping = asyncio.get_running_loop().create_task(self._keep(self._keeper))

    async def _keep(self, keeper: LeaseKeeper) -> None:
        """The keeper, until the work ends; its failure is logged (the work goes on)."""
        try:
            await keeper.keep()
        except Exception:
            assert self.call is not None
            logger.exception("the lease keeper of key %s failed", self.call.key_id)

    def _lost(self) -> None:
        call, claim = self.call, self.claim_held
        assert call is not None
        assert claim is not None
        call.emit(EventKind.LEASE_LOST)
        if claim.fenced:
            logger.error(
                "key %s: the store did not confirm the lease in time, but the effect is "
                "committed: the call goes on and answers",
                call.key_id,
            )
        elif self.engine.on_lease_lost == "cancel" and not self._answered():
            self.stopped = True
            logger.error(
                "key %s: the store did not confirm the lease in time; the call is stopped "
                "and its key left to lapse",
                call.key_id,
            )
            self._work.reschedule(asyncio.get_running_loop().time())
        else:
            logger.error(
                "key %s: the store did not confirm the lease in time; the call goes on "
                "unprotected (a retry may run it again once the lease lapses)",
                call.key_id,
            )


class Call:
    """One key's way through the engine: claim, then hold and settle, or replay, or refuse."""

    def __init__(self, engine: ClaimEngine, request: ClaimRequest, method: str, route: str):
        self.engine = engine
        self.request = request
        self.method = method
        self.route = route
        #: The engine's ``on_event`` hook; without one, no event is made and no store call
        #: is timed.
        self._hook = engine.on_event
        #: Whether the store calls of this call may skip their own flush (``durable=False``).
        self._flush_skippable = request.fenced and engine.skips_flushes
        self._key_id = ""
        #: When (monotonic) the claim that decided the outcome was sent.
        self.claimed_at = 0.0

    @property
    def key_id(self) -> str:
        """A short hash of scope and key, for logs and events (raw keys are never logged);
        made once, when first used."""
        if not self._key_id:
            self._key_id = key_hash(self.request.scope, self.request.key)
        return self._key_id

    def emit(self, kind: EventKind, **details: Any) -> None:
        """Report an event to the ``on_event`` hook, if there is one."""
        if self._hook is not None:
            self._hook(Event(kind, self.key_id, self.method, self.route, **details))

    def _store_call(self, operation: str, call: Awaitable[T]) -> Awaitable[T]:
        """A store call: ``call`` itself, or timed and reported when there is a hook."""
        return call if self._hook is None else self._reported(operation, call)

    async def _reported(self, operation: str, call: Awaitable[T]) -> T:
        started_at, started = time.time(), time.perf_counter()
        error = None
        try:
            return await call
        except StoreError as exc:
            error = str(exc)
            self.emit(EventKind.STORE_ERROR, operation=operation, error=error)
            raise
        finally:
            self.emit(
                EventKind.STORE_CALL,
                operation=operation,
                started_at=started_at,
                duration=time.perf_counter() - started,
                error=error,
            )

    async def claim(self) -> Claim:
        """The claim's outcome (raises :class:`StoreError`).

        A duplicate that finds the key in progress waits up to ``wait`` for its outcome: woken
        at once when a call of this process settles the key, or of any process when the store
        offers a settlement feed, and polling with backoff (holding no connection in between)
        in case no news comes.
        """
        request, engine = self.request, self.engine
        deadline = engine.clock() + request.wait
        polls = 0
        keywords: Mapping[str, Any] = _NOT_DURABLE if self._flush_skippable else _DURABLE
        if request.first_sent is not None:
            if not engine.decides_first_sent:
                raise ConfigurationError(
                    f"{engine.store!r} takes no first_sent= in claim(), so it cannot refuse a "
                    "call first sent longer ago than its key is kept"
                )
            keywords = {**keywords, "first_sent": request.first_sent}
        while True:
            self.claimed_at = claimed_at = engine.clock()
            claim = await self._store_call(
                "claim",
                engine.store.claim(
                    request.scope,
                    request.key,
                    request.fingerprint,
                    ttl=request.ttl,
                    lease=request.lease,
                    binding=request.binding,
                    **keywords,
                ),
            )
            if claim.outcome is not ClaimOutcome.IN_PROGRESS or claimed_at >= deadline:
                self.emit(_OUTCOME_EVENTS[claim.outcome])
                return claim
            pause = min(engine.settlements.polling.delay(polls), deadline - claimed_at)
            await engine.settlements.wait(self.key_id, pause, since=claimed_at)
            polls += 1

    async def renew(self, token: str) -> bool | None:
        """Renew the lease: whether ``token`` still owns the key (``None``: the store failed)."""
        request = self.request
        try:
            return await self._store_call(
                "renew",
                self.engine.store.renew(request.scope, request.key, token, lease=request.lease),
            )
        except StoreError as exc:
            logger.warning("could not renew the lease of key %s: %s", self.key_id, exc)
            return None

    async def complete(
        self, token: str, response: StoredResponse | None, *, fenced: bool = False
    ) -> None:
        """Record the outcome (``None``: the call ran, but its answer cannot be replayed);
        ``fenced``: whether the call's effect was fenced (or refused by a fence), which lets
        a call declared fenced skip the completion's own flush.

        The store call runs to its end even when the caller is cancelled meanwhile. A store
        failure is logged: the claim stays in progress until its lease lapses, so a retry
        meanwhile is told so, never run a second time or given a wrong answer.
        """
        request = self.request
        if request.fenced and not fenced:
            self.engine.answered_unfenced(self.method, self.route)
        flush = _NOT_DURABLE if self._flush_skippable and fenced else _DURABLE

        async def record() -> None:
            try:
                owned = await self._store_call(
                    "complete",
                    self.engine.store.complete(
                        request.scope, request.key, token, response, ttl=request.ttl, **flush
                    ),
                )
            except StoreError as exc:
                logger.error("could not record the response of key %s: %s", self.key_id, exc)
                return
            if not owned:
                logger.warning("key %s was taken over before its outcome was recorded", self.key_id)

        await self._to_the_end(record)

    async def release(self, token: str) -> None:
        """Forget the claim, so that a retry runs the call again (its effect provably did not
        happen). The store call runs to its end even when the caller is cancelled meanwhile."""
        request = self.request

        async def release() -> None:
            try:
                released = await self._store_call(
                    "release", self.engine.store.release(request.scope, request.key, token)
                )
            except StoreError as exc:
                logger.error(
                    "could not release key %s (its lease will lapse): %s", self.key_id, exc
                )
                return
            if released:
                self.emit(EventKind.RELEASED)

        await self._to_the_end(release)

    async def _to_the_end(self, settle: Callable[[], Awaitable[None]]) -> None:
        """Run ``settle()`` (a settlement that answers, logs its failure and raises nothing
        but a cancellation) to its end even when the caller is cancelled meanwhile.

        Shielded only when a cancellation arrives: it is then sent again, shielded, and the
        cancellation goes on once it answered. Every store call may be delivered twice and
        answers its own earlier delivery alike, so the interrupted one does no harm.
        """
        try:
            await settle()
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):
                await settle()
            raise
        finally:
            self._settled()

    def _settled(self) -> None:
        if self.request.wait:
            # Calls of this route may be waiting (one of another route polls).
            self.engine.settlements.settled(self.key_id)
