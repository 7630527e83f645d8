"""The Store contract as pytest cases that any store can run: :class:`StoreConformance`.

Each case starts the store that the test's ``store`` fixture gives, works on names of its own
(a scope unique to the case, so stores that share a server never meet), deletes the records it
wrote where the store is :class:`~idempotency_mw.stores.base.Inspectable`, and closes the
store. Times are judged on the store's clock: the cases only sleep, and two move this process's
clocks to play a worker whose clock is wrong. ``idempotency-mw conformance`` runs the same
cases through pytest on the store at a URL (:func:`run`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import anyio
import pytest

from idempotency_mw.stores.base import ClaimsWithToken, Inspectable, Store, takes_keyword
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse, new_token

__all__ = ["CASES", "StoreConformance"]

T = TypeVar("T")

#: A TTL and a lease that never end while a case runs.
LONG = 600.0
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"2")), b'{"id":1}'
)
#: How far the wall clock of the worker with a wrong clock is off, either way.
_SKEW = 86400.0


# --- what a case works with ---------------------------------------------------------------------


@dataclass(slots=True)
class _Bench:
    """One case's store and names; every store call goes through it, so that the names it used
    are known when the records are deleted afterwards, and no call outlasts the case's time."""

    store: Store
    scope: str
    tick: float
    timeout: float
    used: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    #: When the case's time (or its clean-up's) is up, on the event loop's clock.
    deadline: float = 0.0

    async def start(self) -> None:
        self.deadline = anyio.current_time() + self.timeout
        await self.call(self.store.startup())

    async def call(self, step: Awaitable[T]) -> T:
        """``step`` awaited, or the case failed if its time ends first."""
        with anyio.move_on_at(self.deadline):
            return await step
        pytest.fail(f"the case did not end within {self.timeout:g} s (case_timeout)")

    def _named(self, key: str, scope: str | None) -> tuple[str, str]:
        name = (self.scope if scope is None else scope, key)
        self.used.add(name)
        return name

    async def claim(
        self,
        key: str,
        fingerprint: str = "f",
        *,
        ttl: float = LONG,
        lease: float = LONG,
        scope: str | None = None,
        binding: str = "",
        durable: bool | None = None,
        first_sent: float | None = None,
    ) -> Claim:
        scope, key = self._named(key, scope)
        given: dict[str, Any] = {} if durable is None else {"durable": durable}
        if first_sent is not None:
            given["first_sent"] = first_sent
        return await self.call(
            self.store.claim(
                scope, key, fingerprint, ttl=ttl, lease=lease, binding=binding, **given
            )
        )

    async def acquire(
        self,
        key: str,
        fingerprint: str = "f",
        *,
        what: str = "a claim of a free key",
        ttl: float = LONG,
        lease: float = LONG,
        scope: str | None = None,
        binding: str = "",
        durable: bool | None = None,
    ) -> str:
        """The token of a claim that must be ``ACQUIRED``."""
        claim = await self.claim(
            key, fingerprint, ttl=ttl, lease=lease, scope=scope, binding=binding, durable=durable
        )
        _expect_outcome(claim, ClaimOutcome.ACQUIRED, what)
        if claim.token is None:
            pytest.fail(f"{what} was acquired without a token")
        return claim.token

    async def renew(self, key: str, token: str, *, lease: float = LONG) -> bool:
        return await self.call(self.store.renew(*self._named(key, None), token, lease=lease))

    async def complete(
        self,
        key: str,
        token: str,
        response: StoredResponse | None = RESPONSE,
        *,
        ttl: float = LONG,
        durable: bool | None = None,
    ) -> bool:
        flush: dict[str, Any] = {} if durable is None else {"durable": durable}
        name = self._named(key, None)
        return await self.call(self.store.complete(*name, token, response, ttl=ttl, **flush))

    async def release(self, key: str, token: str) -> bool:
        return await self.call(self.store.release(*self._named(key, None), token))

    async def lapse(self) -> None:
        """Wait until leases and TTLs of one tick have passed on the store's clock."""
        await anyio.sleep(2 * self.tick)

    async def clean_up(self) -> None:
        """Delete the records the case wrote, whatever their state (where the store can), and
        close the store."""
        store = self.store
        self.deadline = anyio.current_time() + self.timeout
        try:
            if isinstance(store, Inspectable):
                for scope, key in self.used:
                    record = await self.call(store.find_record(store.record_ref(scope, key)))
                    if record is not None:
                        await self.call(store.force_release(record))
        finally:
            await store.aclose()


def _expect(condition: bool, message: str) -> None:
    if not condition:
        pytest.fail(message)


def _expect_outcome(claim: Claim, expected: ClaimOutcome, what: str) -> None:
    _expect(claim.outcome is expected, f"{what} answered {claim.outcome.name}, not {expected.name}")


def _proved_within(sent: float, lease: float) -> bool:
    """Whether a call that was sent at ``sent`` (this process's monotonic clock) has already
    returned within ``lease`` seconds of it: it then reached the store before a lease that a
    call sent at ``sent`` granted could end, whatever the store's clock reads."""
    return time.monotonic() - sent < lease


@contextmanager
def _clocks_moved(seconds: float) -> Iterator[None]:
    """This process's clocks off by ``seconds``, as another worker's would be: the wall clock
    (``time.time``, ``time.time_ns``) either way, the monotonic one (``time.monotonic``,
    ``time.monotonic_ns``, the event loop's time) only back. Moved ahead, it would fire every
    timer of the event loop at once; moved back, it holds them for the call only."""
    moved = {"time": (time.time, seconds), "time_ns": (time.time_ns, int(seconds * 1e9))}
    if seconds < 0:
        moved |= {
            "monotonic": (time.monotonic, seconds),
            "monotonic_ns": (time.monotonic_ns, int(seconds * 1e9)),
        }
    for name, (real, offset) in moved.items():
        setattr(time, name, functools.partial(_offset, real, offset))
    try:
        yield
    finally:
        for name, (real, _) in moved.items():
            setattr(time, name, real)


def _offset(clock: Callable[[], Any], offset: Any) -> Any:
    return clock() + offset


class _PurgesOneScope(Protocol):
    """A store whose purge can be kept to one scope (this package's stores)."""

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None: ...


class StoreConformance:
    """The Store contract's cases, one test each, for a store of yours.

    Subclass it in a test module as ``class Test...(StoreConformance)`` and give the tests a
    ``store`` fixture (in the class, the module or a conftest) that returns or yields a store
    as the app builds it, not yet started: each case calls its ``startup()``, runs, deletes the
    records it wrote (through :class:`~idempotency_mw.stores.base.Inspectable` where the store
    offers it) and calls its ``aclose()``. The fixture may hand out one store every time if it
    can be started again once closed (this package's stores can). Stores may share a server, a
    table or a prefix: each case works in a scope of its own.

    Override the ``tick`` fixture in the subclass for a store whose clock counts coarser than
    a tenth of a second, ``case_timeout`` for a slow one, and ``anyio_backend`` for another
    event loop than asyncio's. Two cases move this process's clocks while they call the store,
    to stand for a worker whose clock is wrong: run them in a test process, never inside a
    serving app.
    """

    pytestmark = pytest.mark.anyio

    @pytest.fixture
    def anyio_backend(self) -> str:
        return "asyncio"

    @pytest.fixture
    def tick(self) -> float:
        """The shortest lease and TTL the cases give, in seconds: they wait twice that."""
        return 0.1

    @pytest.fixture
    def case_timeout(self) -> float:
        """Seconds a case may take before it fails (and as many for its clean-up)."""
        return 30.0

    @pytest.fixture(name="bench")
    async def _bench(
        self, store: Store, tick: float, case_timeout: float, request: pytest.FixtureRequest
    ) -> AsyncIterator[_Bench]:
        """The case's store, started, in a scope of the case's own; cleaned up afterwards."""
        case = request.function.__name__.removeprefix("test_")
        bench = _Bench(store, f"conformance/{uuid.uuid4().hex[:12]}/{case}", tick, case_timeout)
        try:
            await bench.start()
            yield bench
        finally:
            # Shielded: an interrupted case still deletes what it wrote.
            with anyio.CancelScope(shield=True):
                await bench.clean_up()

    async def test_first_claim_acquires_and_a_repeat_is_in_progress(self, bench: _Bench) -> None:
        await bench.acquire("k")
        again = await bench.claim("k")
        _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim of a key held within its lease")
        _expect(again.token is None, "a claim that found the key in progress was given a token")

    async def test_a_completed_record_replays_its_exact_response(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        _expect(await bench.complete("k", token), "the holder's completion was refused")
        replay = await bench.claim("k")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a completed key")
        _expect(
            replay.response == RESPONSE,
            f"the replayed response {replay.response!r} is not the recorded {RESPONSE!r}",
        )

    async def test_a_large_binary_response_round_trips(self, bench: _Bench) -> None:
        body = os.urandom(3 << 20) + bytes(range(256))
        response = StoredResponse(200, ((b"content-type", b"application/octet-stream"),), body)
        token = await bench.acquire("k")
        _expect(await bench.complete("k", token, response), "the completion was refused")
        replay = await bench.claim("k")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a completed key")
        _expect(replay.response == response, "a 3 MiB binary response did not replay byte for byte")

    async def test_a_record_without_response_is_unreplayable(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        _expect(
            await bench.complete("k", token, None), "the completion without response was refused"
        )
        again = await bench.claim("k")
        _expect_outcome(
            again, ClaimOutcome.UNREPLAYABLE, "a claim of a key completed without response"
        )

    async def test_another_fingerprint_is_a_mismatch(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        other = await bench.claim("k", "other")
        _expect_outcome(
            other, ClaimOutcome.MISMATCH, "another request's claim of a key in progress"
        )
        _expect(await bench.complete("k", token), "the holder's completion was refused")
        other = await bench.claim("k", "other")
        _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim of a completed key")

    async def test_a_record_is_bound_to_its_callers_credentials(self, bench: _Bench) -> None:
        await bench.acquire("k", binding="alice", lease=bench.tick)
        bob = await bench.claim("k", binding="bob")
        _expect_outcome(bob, ClaimOutcome.CREDENTIAL_MISMATCH, "another caller's claim in progress")
        await bench.lapse()
        # A lapsed lease is taken over by the same request of the same caller only.
        for other in ("bob", ""):
            late = await bench.claim("k", binding=other)
            _expect_outcome(
                late,
                ClaimOutcome.CREDENTIAL_MISMATCH,
                f"caller {other!r}'s claim of a lapsed lease",
            )
        token = await bench.acquire("k", binding="alice", what="its own caller's retry")
        _expect(await bench.complete("k", token), "the completion was refused")
        # Checked before the fingerprint: another caller learns nothing of the request.
        other_body = await bench.claim("k", "other", binding="bob")
        _expect_outcome(
            other_body, ClaimOutcome.CREDENTIAL_MISMATCH, "another caller's other request"
        )
        replay = await bench.claim("k", binding="alice")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "its own caller's repeat")

    async def test_a_release_lets_the_next_claim_run(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        _expect(await bench.release("k", token), "the holder's release was refused")
        await bench.acquire("k", "another request", what="a claim after the release")

    async def test_a_strangers_token_changes_nothing(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        stranger = new_token()
        _expect(not await bench.renew("k", stranger), "a stranger's token renewed the lease")
        _expect(not await bench.complete("k", stranger), "a stranger's token completed the record")
        _expect(
            not await bench.complete("k", stranger, None), "a stranger's token settled the record"
        )
        _expect(not await bench.release("k", stranger), "a stranger's token released the record")
        again = await bench.claim("k")
        _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim after a stranger's calls")
        _expect(await bench.complete("k", token), "the holder's completion was refused")

    async def test_a_lapsed_lease_is_taken_over_and_the_stale_holder_changes_nothing(
        self, bench: _Bench
    ) -> None:
        # A stale writer never overwrites the record of the worker that took over (Powertools
        # TypeScript #5714), before or after that worker completes.
        stale = await bench.acquire("k", lease=bench.tick)
        await bench.lapse()
        fresh = await bench.acquire("k", what="the same request's claim of a lapsed lease")
        _expect(fresh != stale, "the takeover was given the stale holder's token")
        _expect(not await bench.complete("k", stale), "the stale holder completed the record")
        _expect(not await bench.renew("k", stale), "the stale holder renewed the lease")
        _expect(not await bench.release("k", stale), "the stale holder released the record")
        held = await bench.claim("k")
        _expect_outcome(held, ClaimOutcome.IN_PROGRESS, "a claim after the stale holder's calls")
        theirs = StoredResponse(200, (), b"the new holder's")
        _expect(await bench.complete("k", fresh, theirs), "the new holder's completion was refused")
        _expect(not await bench.complete("k", stale), "the stale holder overwrote the completion")
        _expect(not await bench.release("k", stale), "the stale holder released the completion")
        replay = await bench.claim("k")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim after the new holder completed")
        _expect(replay.response == theirs, "the replay is not the new holder's response")

    async def test_a_lapsed_lease_is_not_taken_over_by_another_request(self, bench: _Bench) -> None:
        # justonce #40: an expired lease reclaimed by a different payload.
        await bench.acquire("k", lease=bench.tick)
        await bench.lapse()
        other = await bench.claim("k", "other")
        _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim of a lapsed lease")
        await bench.acquire("k", what="the same request's claim of a lapsed lease")

    async def test_a_renewed_lease_is_never_taken_over(self, bench: _Bench) -> None:
        # Powertools #8386/#5678: a live record reclaimed as an orphan while its holder worked.
        # A claim counts only when it provably reached the store within the lease the renewal
        # before it gave; a stall longer than that starts the attempt again on another key.
        lease = max(3 * bench.tick, 0.3)
        for attempt in range(5):
            key = f"k{attempt}"
            token = await bench.acquire(key, lease=lease)
            started = time.monotonic()  # past the first lease's end once 1.5 leases have passed
            while time.monotonic() - started < 1.5 * lease:
                await anyio.sleep(lease / 3)
                sent = time.monotonic()
                renewed = await bench.renew(key, token, lease=lease)
                other = await bench.claim(key)
                if not _proved_within(sent, lease):
                    break
                _expect(renewed, "the holder's renewal of its live lease was refused")
                _expect_outcome(other, ClaimOutcome.IN_PROGRESS, "a claim while the holder renews")
            else:
                _expect(await bench.complete(key, token), "the holder's completion was refused")
                return
        pytest.fail(f"this machine stalled past a {lease:g} s lease in every attempt")

    async def test_a_late_writer_never_revives_an_expired_record(self, bench: _Bench) -> None:
        token = await bench.acquire("k", ttl=bench.tick, lease=bench.tick)
        await bench.lapse()
        _expect(not await bench.renew("k", token), "renew revived a record past its lease and TTL")
        _expect(
            not await bench.complete("k", token), "complete revived a record past lease and TTL"
        )
        _expect(not await bench.release("k", token), "release acted on a record past lease and TTL")
        await bench.acquire("k", "any request", what="a claim of a key past its lease and TTL")

    async def test_a_completed_record_keeps_its_retention(self, bench: _Bench) -> None:
        # justonce #39: terminal records that expired with the lease instead of their TTL.
        token = await bench.acquire("k", lease=bench.tick)
        _expect(await bench.complete("k", token, ttl=LONG), "the holder's completion was refused")
        token = await bench.acquire("u", lease=bench.tick)
        _expect(
            await bench.complete("u", token, None, ttl=LONG), "the holder's completion was refused"
        )
        await bench.lapse()
        replay = await bench.claim("k")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim within the TTL, past the lease")
        kept = await bench.claim("u")
        _expect_outcome(kept, ClaimOutcome.UNREPLAYABLE, "a claim within the TTL, past the lease")

    async def test_an_expired_record_is_absent(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        _expect(await bench.complete("k", token, ttl=bench.tick), "the completion was refused")
        await bench.lapse()
        await bench.acquire("k", "a different request", what="a claim of a key past its TTL")

    async def test_a_claim_delivered_twice_acquires_both_times(self, bench: _Bench) -> None:
        # A claim whose reply was lost is delivered again: it must not find itself in the way.
        store = bench.store
        if not isinstance(store, ClaimsWithToken):
            pytest.skip("the store is no ClaimsWithToken: a claim cannot be delivered again")
        scope, key = bench._named("k", None)
        token = new_token()
        first = await bench.call(store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token))
        again = await bench.call(store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token))
        expected = Claim(ClaimOutcome.ACQUIRED, token=token)
        _expect(first == again == expected, f"delivered twice, a claim answered {first}, {again}")
        _expect_outcome(await bench.claim("k"), ClaimOutcome.IN_PROGRESS, "any other claim")
        _expect(await bench.complete("k", token), "the completion was refused")
        replay = await bench.call(store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token))
        _expect_outcome(replay, ClaimOutcome.REPLAY, "the claim delivered after the completion")

    async def test_a_completion_delivered_twice_is_acknowledged_both_times(
        self, bench: _Bench
    ) -> None:
        # Run again after its reply was lost, a completion must not read as a takeover.
        for key, response, outcome in (
            ("replayable", RESPONSE, ClaimOutcome.REPLAY),
            ("unreplayable", None, ClaimOutcome.UNREPLAYABLE),
        ):
            token = await bench.acquire(key)
            _expect(await bench.complete(key, token, response), "the completion was refused")
            _expect(await bench.complete(key, token, response), f"a {key} completion sent again")
            again = await bench.claim(key)
            _expect_outcome(again, outcome, f"a claim after a {key} completion sent twice")
            _expect(again.response == response, "the replay is not the recorded response")
            # Another token, or the other kind of outcome, still changes nothing.
            _expect(not await bench.complete(key, new_token()), "a stranger completed the record")
            other_kind = None if response else RESPONSE
            _expect(
                not await bench.complete(key, token, other_kind),
                f"a {key} record was settled again as the other kind",
            )
            _expect(
                await bench.claim(key) == again, "the record changed after a refused completion"
            )

    async def test_of_concurrent_claims_exactly_one_acquires(self, bench: _Bench) -> None:
        outcomes: list[ClaimOutcome] = []

        async def claim() -> None:
            outcomes.append((await bench.claim("hot")).outcome)

        async with anyio.create_task_group() as group:
            for _ in range(50):
                group.start_soon(claim)
        acquired = outcomes.count(ClaimOutcome.ACQUIRED)
        _expect(acquired == 1, f"of 50 concurrent claims of one key, {acquired} were ACQUIRED")
        busy = outcomes.count(ClaimOutcome.IN_PROGRESS)
        _expect(busy == 49, f"of 50 concurrent claims of one key, {busy} were IN_PROGRESS, not 49")

    async def test_steps_that_skip_their_flush_have_the_same_outcomes(self, bench: _Bench) -> None:
        store = bench.store
        if not (takes_keyword(store.claim, "durable") and takes_keyword(store.complete, "durable")):
            pytest.skip("the store's claim and complete take no durable keyword")
        token = await bench.acquire("k", durable=False)
        again = await bench.claim("k", durable=False)
        _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim of a key held within its lease")
        other = await bench.claim("k", "other", durable=False)
        _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim")
        _expect(await bench.complete("k", token, durable=False), "the completion was refused")
        _expect(await bench.complete("k", token, durable=False), "the completion sent again failed")
        _expect(
            not await bench.complete("k", new_token(), durable=False), "a stranger completed it"
        )
        replay = await bench.claim("k")
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of the completed key")
        _expect(replay.response == RESPONSE, "the replay is not the recorded response")

    async def test_a_purge_never_touches_live_records(self, bench: _Bench) -> None:
        # Of its own scope only: the store may hold other callers' expired records, not ours to
        # delete.
        if not takes_keyword(bench.store.purge_expired, "scope"):
            pytest.skip("purge_expired() takes no scope=, so a purge could delete others' records")
        store = cast(_PurgesOneScope, bench.store)
        tick = bench.tick
        # In progress past its TTL but within its lease: live.
        held = await bench.acquire("held", ttl=tick)
        kept = await bench.acquire("kept")
        _expect(await bench.complete("kept", kept), "the completion was refused")
        done = await bench.acquire("done")
        _expect(await bench.complete("done", done, ttl=tick), "the completion was refused")
        await bench.acquire("dead", ttl=tick, lease=tick)
        await bench.lapse()
        deleted = await bench.call(store.purge_expired(batch_size=1, scope=bench.scope))
        _expect(
            deleted is None or deleted <= 1, f"a purge of batch_size=1 deleted {deleted} records"
        )
        for _ in range(10):
            deleted = await bench.call(store.purge_expired(batch_size=1000, scope=bench.scope))
            _expect(deleted is None or deleted <= 1000, f"a purge of 1000 deleted {deleted}")
            if deleted is None or deleted < 1000:
                break
        busy = await bench.claim("held")
        _expect_outcome(busy, ClaimOutcome.IN_PROGRESS, "a claim of a live lease after a purge")
        _expect(await bench.renew("held", held), "the purge took a live lease from its holder")
        replay = await bench.claim("kept")
        _expect_outcome(
            replay, ClaimOutcome.REPLAY, "a claim of a record within its TTL after a purge"
        )
        for key in ("done", "dead"):
            await bench.acquire(key, "another request", what=f"a claim of the expired {key!r}")
        _expect(
            await bench.complete("held", held), "the live lease could not complete after a purge"
        )

    async def test_scopes_are_isolated(self, bench: _Bench) -> None:
        token = await bench.acquire("k")
        _expect(await bench.complete("k", token), "the completion was refused")
        other = await bench.claim("k", scope=f"{bench.scope}/other")
        _expect_outcome(other, ClaimOutcome.ACQUIRED, "the same key's claim in another scope")

    async def test_keys_are_exact(self, bench: _Bench) -> None:
        # Names that a collation, a trim or a normalisation would make one: each is its own record.
        for key in ("Key-A", "key-a", "key-a ", "key-a\u00a0", "cafe\u0301", "caf\u00e9"):
            await bench.acquire(key, what=f"the first claim of {key!r}")

    async def test_long_keys_are_never_truncated_into_one(self, bench: _Bench) -> None:
        # justonce #50: long keys truncated, so two of them shared a record. A store that keeps a
        # digest of a long name must also tell it from a name that spells that digest.
        prefix = "k" * 1000
        longs = [prefix + "1", prefix + "2", "x" * 256, "x" * 255, "y" * 254 + "1", "y" * 254 + "2"]
        spelled = [f"sha256:{hashlib.sha256(name.encode()).hexdigest()}" for name in longs]
        for key in [*longs, *spelled]:
            token = await bench.acquire(
                key, what=f"the first claim of a key of {len(key)} characters"
            )
            _expect(
                await bench.complete(key, token, StoredResponse(200, (), key.encode())),
                "the completion was refused",
            )
        for key in [*longs, *spelled]:
            replay = await bench.claim(key)
            _expect_outcome(
                replay, ClaimOutcome.REPLAY, f"a claim of a key of {len(key)} characters"
            )
            _expect(
                replay.response is not None and replay.response.body == key.encode(),
                f"a key of {len(key)} characters replayed another key's response",
            )
        scope = bench.scope + "s" * 300
        await bench.acquire("k", scope=scope + "1", what="a claim in a scope of 300 characters")
        await bench.acquire("k", scope=scope + "2", what="a claim in a scope sharing its prefix")

    async def test_leases_and_ttls_run_on_the_stores_clock(self, bench: _Bench) -> None:
        # A worker whose clock is a day ahead must still see a lease as held; one a day behind
        # must not make a lease or a TTL that has already ended.
        await bench.acquire("ahead")
        with _clocks_moved(_SKEW):
            held = await bench.claim("ahead")
        _expect_outcome(held, ClaimOutcome.IN_PROGRESS, "a claim from a worker a day ahead")
        with _clocks_moved(-_SKEW):
            behind = await bench.acquire("behind", what="a claim from a worker a day behind")
            replay_token = await bench.acquire(
                "retained", what="a claim from a worker a day behind"
            )
            completed = await bench.complete("retained", replay_token)
        _expect(completed, "a completion from a worker a day behind was refused")
        held = await bench.claim("behind")
        _expect_outcome(
            held, ClaimOutcome.IN_PROGRESS, "a claim of a lease a worker a day behind took"
        )
        replay = await bench.claim("retained")
        _expect_outcome(
            replay, ClaimOutcome.REPLAY, "a claim of a record a worker a day behind made"
        )
        _expect(await bench.renew("behind", behind), "the holder's renewal was refused")

    async def test_first_sent_times_are_judged_on_the_stores_clock(self, bench: _Bench) -> None:
        # A worker 25 s behind the store retries a call first sent longer ago than the TTL on the
        # store's clock (not on its own): no record, so nothing is taken and it is refused.
        now, ttl = time.time(), 60.0
        with _clocks_moved(-25):
            stale = await bench.claim("stale", ttl=ttl, first_sent=now - ttl - 10)
            ahead = await bench.claim("ahead", ttl=ttl, first_sent=now + 120)
        _expect_outcome(stale, ClaimOutcome.EXPIRED, "a claim first sent longer ago than its ttl")
        _expect_outcome(ahead, ClaimOutcome.EXPIRED, "a claim first sent two minutes ahead")
        await bench.acquire("stale", what="a claim of the key an EXPIRED claim left", ttl=ttl)
        token = await bench.claim("recent", ttl=ttl, first_sent=now - 5)
        _expect_outcome(token, ClaimOutcome.ACQUIRED, "a claim first sent 5 s ago")
        assert token.token is not None
        _expect(await bench.complete("recent", token.token), "the completion was refused")
        replay = await bench.claim("recent", ttl=ttl, first_sent=now - 10 * ttl)
        _expect_outcome(replay, ClaimOutcome.REPLAY, "a stale first-sent retry of a recorded key")


#: The names of the cases, in the order they run.
CASES = tuple(
    name.removeprefix("test_") for name in vars(StoreConformance) if name.startswith("test_")
)


# --- the command --------------------------------------------------------------------------------


@dataclass
class _AtURL:
    """A pytest plugin: the store URL and settings given to ``idempotency-mw conformance``,
    and a line for each case as it ends (how, in how long, and why)."""

    url: str
    prefix: str
    tick: float
    case_timeout: float
    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("passed", "failed", "skipped"), 0)
    )
    _ended: pytest.TestReport | None = dataclasses.field(default=None, init=False)
    _seconds: float = dataclasses.field(default=0.0, init=False)

    @pytest.fixture
    def at_url(self) -> _AtURL:
        return self

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A case ends as its first phase (setup, call, clean-up) that did not pass.
        if self._ended is None or (self._ended.passed and not report.passed):
            self._ended = report
        self._seconds += report.duration
        if report.when != "teardown":
            return
        ended, seconds, self._ended, self._seconds = self._ended, self._seconds, None, 0.0
        self.counts[ended.outcome] += 1
        case = report.nodeid.rpartition("::test_")[2]
        line = f"{ended.outcome.upper():<7} {case} ({seconds:.2f} s)"
        print(f"{line}: {_why(ended)}" if not ended.passed else line, flush=True)

    def pytest_sessionfinish(self) -> None:
        print(", ".join(f"{count} {outcome}" for outcome, count in self.counts.items()))


def _why(report: pytest.TestReport) -> str:
    """What a case that did not pass said: a skip's reason, a failure's or a crash's line."""
    if isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    return str(crash.message) if crash is not None else report.longreprtext


class TestStoreAtURL(StoreConformance):
    """The cases on the store at a URL, as :func:`run` gives it."""

    @pytest.fixture
    async def store(self, at_url: _AtURL) -> Store:
        from idempotency_mw.operator.admin import build_store

        return await build_store(at_url.url, prefix=at_url.prefix)

    @pytest.fixture
    def tick(self, at_url: _AtURL) -> float:
        return at_url.tick

    @pytest.fixture
    def case_timeout(self, at_url: _AtURL) -> float:
        return at_url.case_timeout


def run(
    url: str,
    *,
    prefix: str,
    cases: Sequence[str],
    tick: float,
    case_timeout: float,
) -> int:
    """Run ``cases`` on the store at ``url`` (as :func:`~idempotency_mw.operator.admin.build_store`
    builds it, Redis keys under ``prefix``) through pytest, which reports each case as it ends;
    pytest's exit code."""
    where = f"{__file__}::{TestStoreAtURL.__name__}"
    # This module's tests only, under none of the settings, conftest files or plugins of the
    # folder it is run in: anyio's plugin runs the cases, no cache is written into the
    # installed package, and _AtURL's lines stand for pytest's terminal report.
    settings = ["-c", os.devnull, "--rootdir", str(Path(__file__).parent), "--noconftest"]
    plugins = ["--disable-plugin-autoload", "-p", "anyio", "-p", "no:cacheprovider"]
    quiet = ["-p", "no:terminal", "--assert=plain"]
    chosen = [f"{where}::test_{case}" for case in cases]
    plugin = _AtURL(url, prefix, tick, case_timeout)
    return int(pytest.main([*settings, *plugins, *quiet, *chosen], plugins=[plugin]))
