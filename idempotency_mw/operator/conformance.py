"""The Store contract as cases that any store can run: :func:`conformance`.

Each case builds a store with the caller's factory, starts it, works on names of its own (a
scope unique to the run and the case, so stores that share a server never meet), deletes the
records it wrote where the store is :class:`~idempotency_mw.stores.base.Inspectable`, and closes
the store. Times are judged on the store's clock: the cases only sleep, and one moves this
process's clocks to play a worker whose clock is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import anyio

from idempotency_mw.stores.base import ClaimsWithToken, Inspectable, Store, takes_keyword
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse, new_token

__all__ = ["CASES", "CaseResult", "CaseStatus", "ConformanceResult", "conformance"]

#: A TTL and a lease that never end while a case runs.
LONG = 600.0
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"2")), b'{"id":1}'
)
#: How far the wall clock of the worker with a wrong clock is off, either way.
_SKEW = 86400.0


class CaseFailed(Exception):
    """What a case expected and what the store did instead."""


class _Skip(Exception):
    """The store lacks what a case needs."""


class CaseStatus(enum.StrEnum):
    """How a case ended."""

    PASSED = "passed"
    FAILED = "failed"
    #: The store lacks what the case needs (a capability named in the message).
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case: its name, how it ended, why (a failure's or a skip's message), how long."""

    name: str
    status: CaseStatus
    message: str
    seconds: float

    def __str__(self) -> str:
        shown = f"{self.status.name:<7} {self.name} ({self.seconds:.2f} s)"
        return f"{shown}: {self.message}" if self.message else shown


@dataclass(frozen=True, slots=True)
class ConformanceResult:
    """What :func:`conformance` found, case by case in the order they ran."""

    cases: tuple[CaseResult, ...]

    @property
    def ok(self) -> bool:
        """Whether no case failed (skipped ones do not count)."""
        return not self.failed

    @property
    def passed(self) -> tuple[str, ...]:
        """The names of the cases that passed."""
        return tuple(case.name for case in self.cases if case.status is CaseStatus.PASSED)

    @property
    def failed(self) -> tuple[CaseResult, ...]:
        """The cases that failed, each with its message."""
        return tuple(case for case in self.cases if case.status is CaseStatus.FAILED)

    @property
    def skipped(self) -> tuple[CaseResult, ...]:
        """The cases the store could not run, each with the reason."""
        return tuple(case for case in self.cases if case.status is CaseStatus.SKIPPED)

    @property
    def summary(self) -> str:
        """How many cases passed, failed and were skipped, in a line."""
        return ", ".join(
            f"{sum(case.status is status for case in self.cases)} {status}" for status in CaseStatus
        )

    def __str__(self) -> str:
        return "\n".join([*(str(case) for case in self.cases), self.summary])


# --- what a case works with ---------------------------------------------------------------------


@dataclass(slots=True)
class _Bench:
    """One case's store and names; every store call goes through it, so that the names it used
    are known when the records are deleted afterwards."""

    store: Store
    scope: str
    tick: float
    used: set[tuple[str, str]] = dataclasses.field(default_factory=set)

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
        return await self.store.claim(
            scope, key, fingerprint, ttl=ttl, lease=lease, binding=binding, **given
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
            raise CaseFailed(f"{what} was acquired without a token")
        return claim.token

    async def renew(self, key: str, token: str, *, lease: float = LONG) -> bool:
        return await self.store.renew(*self._named(key, None), token, lease=lease)

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
        return await self.store.complete(*self._named(key, None), token, response, ttl=ttl, **flush)

    async def release(self, key: str, token: str) -> bool:
        return await self.store.release(*self._named(key, None), token)

    async def lapse(self) -> None:
        """Wait until leases and TTLs of one tick have passed on the store's clock."""
        await anyio.sleep(2 * self.tick)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CaseFailed(message)


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


# --- the cases ----------------------------------------------------------------------------------


async def first_claim_acquires_and_a_repeat_is_in_progress(bench: _Bench) -> None:
    await bench.acquire("k")
    again = await bench.claim("k")
    _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim of a key held within its lease")
    _expect(again.token is None, "a claim that found the key in progress was given a token")


async def a_completed_record_replays_its_exact_response(bench: _Bench) -> None:
    token = await bench.acquire("k")
    _expect(await bench.complete("k", token), "the holder's completion was refused")
    replay = await bench.claim("k")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a completed key")
    _expect(
        replay.response == RESPONSE,
        f"the replayed response {replay.response!r} is not the recorded {RESPONSE!r}",
    )


async def a_large_binary_response_round_trips(bench: _Bench) -> None:
    body = os.urandom(3 << 20) + bytes(range(256))
    response = StoredResponse(200, ((b"content-type", b"application/octet-stream"),), body)
    token = await bench.acquire("k")
    _expect(await bench.complete("k", token, response), "the completion was refused")
    replay = await bench.claim("k")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a completed key")
    _expect(replay.response == response, "a 3 MiB binary response did not replay byte for byte")


async def a_record_without_response_is_unreplayable(bench: _Bench) -> None:
    token = await bench.acquire("k")
    _expect(await bench.complete("k", token, None), "the completion without response was refused")
    again = await bench.claim("k")
    _expect_outcome(again, ClaimOutcome.UNREPLAYABLE, "a claim of a key completed without response")


async def another_fingerprint_is_a_mismatch(bench: _Bench) -> None:
    token = await bench.acquire("k")
    other = await bench.claim("k", "other")
    _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim of a key in progress")
    _expect(await bench.complete("k", token), "the holder's completion was refused")
    other = await bench.claim("k", "other")
    _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim of a completed key")


async def a_record_is_bound_to_its_callers_credentials(bench: _Bench) -> None:
    await bench.acquire("k", binding="alice", lease=bench.tick)
    bob = await bench.claim("k", binding="bob")
    _expect_outcome(bob, ClaimOutcome.CREDENTIAL_MISMATCH, "another caller's claim in progress")
    await bench.lapse()
    # A lapsed lease is taken over by the same request of the same caller only.
    for other in ("bob", ""):
        late = await bench.claim("k", binding=other)
        _expect_outcome(
            late, ClaimOutcome.CREDENTIAL_MISMATCH, f"caller {other!r}'s claim of a lapsed lease"
        )
    token = await bench.acquire("k", binding="alice", what="its own caller's retry")
    _expect(await bench.complete("k", token), "the completion was refused")
    # Checked before the fingerprint: another caller learns nothing of the request.
    other_body = await bench.claim("k", "other", binding="bob")
    _expect_outcome(other_body, ClaimOutcome.CREDENTIAL_MISMATCH, "another caller's other request")
    replay = await bench.claim("k", binding="alice")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "its own caller's repeat")


async def a_release_lets_the_next_claim_run(bench: _Bench) -> None:
    token = await bench.acquire("k")
    _expect(await bench.release("k", token), "the holder's release was refused")
    await bench.acquire("k", "another request", what="a claim after the release")


async def a_strangers_token_changes_nothing(bench: _Bench) -> None:
    token = await bench.acquire("k")
    stranger = new_token()
    _expect(not await bench.renew("k", stranger), "a stranger's token renewed the lease")
    _expect(not await bench.complete("k", stranger), "a stranger's token completed the record")
    _expect(not await bench.complete("k", stranger, None), "a stranger's token settled the record")
    _expect(not await bench.release("k", stranger), "a stranger's token released the record")
    again = await bench.claim("k")
    _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim after a stranger's calls")
    _expect(await bench.complete("k", token), "the holder's completion was refused")


async def a_lapsed_lease_is_taken_over_and_the_stale_holder_changes_nothing(
    bench: _Bench,
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


async def a_lapsed_lease_is_not_taken_over_by_another_request(bench: _Bench) -> None:
    # justonce #40: an expired lease reclaimed by a different payload.
    await bench.acquire("k", lease=bench.tick)
    await bench.lapse()
    other = await bench.claim("k", "other")
    _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim of a lapsed lease")
    await bench.acquire("k", what="the same request's claim of a lapsed lease")


async def a_renewed_lease_is_never_taken_over(bench: _Bench) -> None:
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
    raise CaseFailed(f"this machine stalled past a {lease:g} s lease in every attempt")


async def a_late_writer_never_revives_an_expired_record(bench: _Bench) -> None:
    token = await bench.acquire("k", ttl=bench.tick, lease=bench.tick)
    await bench.lapse()
    _expect(not await bench.renew("k", token), "renew revived a record past its lease and TTL")
    _expect(not await bench.complete("k", token), "complete revived a record past lease and TTL")
    _expect(not await bench.release("k", token), "release acted on a record past lease and TTL")
    await bench.acquire("k", "any request", what="a claim of a key past its lease and TTL")


async def a_completed_record_keeps_its_retention(bench: _Bench) -> None:
    # justonce #39: terminal records that expired with the lease instead of their TTL.
    token = await bench.acquire("k", lease=bench.tick)
    _expect(await bench.complete("k", token, ttl=LONG), "the holder's completion was refused")
    token = await bench.acquire("u", lease=bench.tick)
    _expect(await bench.complete("u", token, None, ttl=LONG), "the holder's completion was refused")
    await bench.lapse()
    replay = await bench.claim("k")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim within the TTL, past the lease")
    kept = await bench.claim("u")
    _expect_outcome(kept, ClaimOutcome.UNREPLAYABLE, "a claim within the TTL, past the lease")


async def an_expired_record_is_absent(bench: _Bench) -> None:
    token = await bench.acquire("k")
    _expect(await bench.complete("k", token, ttl=bench.tick), "the completion was refused")
    await bench.lapse()
    await bench.acquire("k", "a different request", what="a claim of a key past its TTL")


async def a_claim_delivered_twice_acquires_both_times(bench: _Bench) -> None:
    # A claim whose reply was lost is delivered again: it must not find itself in the way.
    store = bench.store
    if not isinstance(store, ClaimsWithToken):
        raise _Skip("the store is no ClaimsWithToken: a claim cannot be delivered again")
    scope, key = bench._named("k", None)
    token = new_token()
    first = await store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token)
    again = await store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token)
    expected = Claim(ClaimOutcome.ACQUIRED, token=token)
    _expect(first == again == expected, f"delivered twice, a claim answered {first}, {again}")
    _expect_outcome(await bench.claim("k"), ClaimOutcome.IN_PROGRESS, "any other claim")
    _expect(await bench.complete("k", token), "the completion was refused")
    replay = await store._claim(scope, key, "f", ttl=LONG, lease=LONG, token=token)
    _expect_outcome(replay, ClaimOutcome.REPLAY, "the claim delivered after the completion")


async def a_completion_delivered_twice_is_acknowledged_both_times(bench: _Bench) -> None:
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
        _expect(await bench.claim(key) == again, "the record changed after a refused completion")


async def of_concurrent_claims_exactly_one_acquires(bench: _Bench) -> None:
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


async def steps_that_skip_their_flush_have_the_same_outcomes(bench: _Bench) -> None:
    store = bench.store
    if not (takes_keyword(store.claim, "durable") and takes_keyword(store.complete, "durable")):
        raise _Skip("the store's claim and complete take no durable keyword")
    token = await bench.acquire("k", durable=False)
    again = await bench.claim("k", durable=False)
    _expect_outcome(again, ClaimOutcome.IN_PROGRESS, "a claim of a key held within its lease")
    other = await bench.claim("k", "other", durable=False)
    _expect_outcome(other, ClaimOutcome.MISMATCH, "another request's claim")
    _expect(await bench.complete("k", token, durable=False), "the completion was refused")
    _expect(await bench.complete("k", token, durable=False), "the completion sent again failed")
    _expect(not await bench.complete("k", new_token(), durable=False), "a stranger completed it")
    replay = await bench.claim("k")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of the completed key")
    _expect(replay.response == RESPONSE, "the replay is not the recorded response")


async def a_purge_never_touches_live_records(bench: _Bench) -> None:
    # Of its own scope only: the store may hold other callers' expired records, not ours to
    # delete.
    if not takes_keyword(bench.store.purge_expired, "scope"):
        raise _Skip("purge_expired() takes no scope=, so a purge could delete others' records")
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
    deleted = await store.purge_expired(batch_size=1, scope=bench.scope)
    _expect(deleted is None or deleted <= 1, f"a purge of batch_size=1 deleted {deleted} records")
    for _ in range(10):
        deleted = await store.purge_expired(batch_size=1000, scope=bench.scope)
        _expect(deleted is None or deleted <= 1000, f"a purge of 1000 deleted {deleted}")
        if deleted is None or deleted < 1000:
            break
    busy = await bench.claim("held")
    _expect_outcome(busy, ClaimOutcome.IN_PROGRESS, "a claim of a live lease after a purge")
    _expect(await bench.renew("held", held), "the purge took a live lease from its holder")
    replay = await bench.claim("kept")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a record within its TTL after a purge")
    for key in ("done", "dead"):
        await bench.acquire(key, "another request", what=f"a claim of the expired {key!r}")
    _expect(await bench.complete("held", held), "the live lease could not complete after a purge")


async def scopes_are_isolated(bench: _Bench) -> None:
    token = await bench.acquire("k")
    _expect(await bench.complete("k", token), "the completion was refused")
    other = await bench.claim("k", scope=f"{bench.scope}/other")
    _expect_outcome(other, ClaimOutcome.ACQUIRED, "the same key's claim in another scope")


async def keys_are_exact(bench: _Bench) -> None:
    # Names that a collation, a trim or a normalisation would make one: each is its own record.
    for key in ("Key-A", "key-a", "key-a ", "key-a\u00a0", "cafe\u0301", "caf\u00e9"):
        await bench.acquire(key, what=f"the first claim of {key!r}")


async def long_keys_are_never_truncated_into_one(bench: _Bench) -> None:
    # justonce #50: long keys truncated, so two of them shared a record. A store that keeps a
    # digest of a long name must also tell it from a name that spells that digest.
    prefix = "k" * 1000
    longs = [prefix + "1", prefix + "2", "x" * 256, "x" * 255, "y" * 254 + "1", "y" * 254 + "2"]
    spelled = [f"sha256:{hashlib.sha256(name.encode()).hexdigest()}" for name in longs]
    for key in [*longs, *spelled]:
        token = await bench.acquire(key, what=f"the first claim of a key of {len(key)} characters")
        _expect(
            await bench.complete(key, token, StoredResponse(200, (), key.encode())),
            "the completion was refused",
        )
    for key in [*longs, *spelled]:
        replay = await bench.claim(key)
        _expect_outcome(replay, ClaimOutcome.REPLAY, f"a claim of a key of {len(key)} characters")
        _expect(
            replay.response is not None and replay.response.body == key.encode(),
            f"a key of {len(key)} characters replayed another key's response",
        )
    scope = bench.scope + "s" * 300
    await bench.acquire("k", scope=scope + "1", what="a claim in a scope of 300 characters")
    await bench.acquire("k", scope=scope + "2", what="a claim in a scope sharing its prefix")


async def leases_and_ttls_run_on_the_stores_clock(bench: _Bench) -> None:
    # A worker whose clock is a day ahead must still see a lease as held; one a day behind
    # must not make a lease or a TTL that has already ended.
    await bench.acquire("ahead")
    with _clocks_moved(_SKEW):
        held = await bench.claim("ahead")
    _expect_outcome(held, ClaimOutcome.IN_PROGRESS, "a claim from a worker a day ahead")
    with _clocks_moved(-_SKEW):
        behind = await bench.acquire("behind", what="a claim from a worker a day behind")
        replay_token = await bench.acquire("retained", what="a claim from a worker a day behind")
        completed = await bench.complete("retained", replay_token)
    _expect(completed, "a completion from a worker a day behind was refused")
    held = await bench.claim("behind")
    _expect_outcome(held, ClaimOutcome.IN_PROGRESS, "a claim of a lease a worker a day behind took")
    replay = await bench.claim("retained")
    _expect_outcome(replay, ClaimOutcome.REPLAY, "a claim of a record a worker a day behind made")
    _expect(await bench.renew("behind", behind), "the holder's renewal was refused")


class _PurgesOneScope(Protocol):
    """A store whose purge can be kept to one scope (this package's stores)."""

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None: ...


async def first_sent_times_are_judged_on_the_stores_clock(bench: _Bench) -> None:
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


Case = Callable[[_Bench], Awaitable[None]]

_CASES: dict[str, Case] = {
    case.__name__: case
    for case in (
        first_claim_acquires_and_a_repeat_is_in_progress,
        a_completed_record_replays_its_exact_response,
        a_large_binary_response_round_trips,
        a_record_without_response_is_unreplayable,
        another_fingerprint_is_a_mismatch,
        a_record_is_bound_to_its_callers_credentials,
        a_release_lets_the_next_claim_run,
        a_strangers_token_changes_nothing,
        a_lapsed_lease_is_taken_over_and_the_stale_holder_changes_nothing,
        a_lapsed_lease_is_not_taken_over_by_another_request,
        a_renewed_lease_is_never_taken_over,
        a_late_writer_never_revives_an_expired_record,
        a_completed_record_keeps_its_retention,
        an_expired_record_is_absent,
        a_claim_delivered_twice_acquires_both_times,
        a_completion_delivered_twice_is_acknowledged_both_times,
        of_concurrent_claims_exactly_one_acquires,
        steps_that_skip_their_flush_have_the_same_outcomes,
        a_purge_never_touches_live_records,
        scopes_are_isolated,
        keys_are_exact,
        long_keys_are_never_truncated_into_one,
        leases_and_ttls_run_on_the_stores_clock,
        first_sent_times_are_judged_on_the_stores_clock,
    )
}
#: The names of the cases, in the order they run.
CASES = tuple(_CASES)


# --- running ------------------------------------------------------------------------------------


async def conformance(
    make_store: Callable[[], Store | Awaitable[Store]],
    *,
    cases: Iterable[str] | None = None,
    tick: float = 0.1,
    case_timeout: float = 30.0,
    on_result: Callable[[CaseResult], object] | None = None,
) -> ConformanceResult:
    """Run the Store contract's cases on stores that ``make_store`` builds.

    ``make_store()`` (sync or async) is called once per case and returns a store as the app
    would build it, not yet started: the suite calls its ``startup()``, runs the case, deletes
    the records the case wrote (through :class:`~idempotency_mw.stores.base.Inspectable` where
    the store offers it) and calls its ``aclose()``. It may return one store every time if that
    store can be started again once closed (this package's stores can). Stores may share a
    server, a table or a prefix: each case works in a scope of its own, unique to the run.

    ``cases`` names the cases to run (all of :data:`CASES` by default). ``tick`` is the
    shortest lease and TTL the cases give, in seconds (they wait twice that for it to end);
    raise it for a store whose clock counts coarser than a tenth of a second. A case that runs
    longer than ``case_timeout`` seconds fails. ``on_result`` is called with each case's
    result as soon as it ends. What ``make_store`` raises is raised.

    One case moves this process's clocks a day either way while it calls the store (the wall
    clock both ways, the monotonic clock back only), to stand for a worker whose clock is wrong:
    run the suite in a process of its own (a test, the ``idempotency-mw conformance`` command),
    never inside a serving app. The cases need real time: about two seconds in all.
    """
    chosen = list(CASES) if cases is None else list(cases)
    unknown = [name for name in chosen if name not in CASES]
    if unknown:
        raise ValueError(f"no such conformance case: {', '.join(unknown)}")
    run = uuid.uuid4().hex[:12]
    results = []
    for name in chosen:
        started = time.monotonic()
        bench = _Bench(await _made(make_store), f"conformance/{run}/{name}", tick)
        status, message = CaseStatus.FAILED, "interrupted"
        try:
            status, message = await _outcome(_CASES[name], bench, case_timeout)
        finally:
            # Shielded: an interrupted run still deletes what it wrote.
            with anyio.CancelScope(shield=True):
                status, message = await _cleaned_up(bench, status, message, case_timeout)
        result = CaseResult(name, status, message, time.monotonic() - started)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return ConformanceResult(tuple(results))


async def _made(make_store: Callable[[], Store | Awaitable[Store]]) -> Store:
    made = make_store()
    return await made if inspect.isawaitable(made) else made


async def _outcome(case: Case, bench: _Bench, case_timeout: float) -> tuple[CaseStatus, str]:
    """How ``case`` ended on ``bench``'s store, and its message."""
    try:
        with anyio.fail_after(case_timeout):
            await bench.store.startup()
            await case(bench)
    except _Skip as exc:
        return CaseStatus.SKIPPED, str(exc)
    except CaseFailed as exc:
        return CaseStatus.FAILED, str(exc)
    except TimeoutError:
        return CaseStatus.FAILED, f"the case did not end within {case_timeout:g} s"
    except Exception as exc:
        return CaseStatus.FAILED, f"the store raised {type(exc).__name__}: {exc}"
    return CaseStatus.PASSED, ""


async def _cleaned_up(
    bench: _Bench, status: CaseStatus, message: str, case_timeout: float
) -> tuple[CaseStatus, str]:
    """Delete the records ``bench`` wrote, whatever their state, where the store can, and close
    the store; a case whose records stay behind fails."""
    store = bench.store
    try:
        with anyio.fail_after(case_timeout):
            if isinstance(store, Inspectable):
                for scope, key in bench.used:
                    record = await store.find_record(store.record_ref(scope, key))
                    if record is not None:
                        await store.force_release(record)
    except Exception as exc:
        if status is not CaseStatus.FAILED:
            return CaseStatus.FAILED, f"its records could not be deleted: {exc!r}"
    finally:
        await store.aclose()
    return status, message
