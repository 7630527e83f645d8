"""The retry protocol, written once and free of I/O.

Each operation is a generator that yields the I/O it needs (send a request, sleep, read or
write the journal, take the operation's lease, ask a probe) and receives its result;
:class:`~idempotency_mw.client.IdempotentClient` and
:class:`~idempotency_mw.client.SyncIdempotentClient` only perform those steps.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import re
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TypeAlias, TypedDict, TypeVar

import httpx

from idempotency_mw.client._renewal import Renewal
from idempotency_mw.client.classify import (
    COMMITTED_WITHOUT_RESPONSE,
    Verdict,
    classify,
    problem_type,
    retry_after,
)
from idempotency_mw.client.errors import (
    CommittedWithoutResponse,
    IdempotencyKeyMismatch,
    NeedsConfirmation,
    NotSent,
    OperationError,
    OutcomeUnknown,
    ResponseNotReplayable,
)
from idempotency_mw.client.journals import Journal, needing_attention, open_journal
from idempotency_mw.client.values import (
    MAYBE_DELIVERED,
    JournalEntry,
    Operation,
    OperationState,
    RequestParts,
    RetryPolicy,
)
from idempotency_mw.exceptions import ConfigurationError, describe

logger = logging.getLogger("idempotency_mw.client")

T = TypeVar("T")

MAX_KEY_LENGTH = 255
KEY_PART = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

#: The server's default TTL is 24 hours: an hour of margin for clocks and slow reconciles.
DEFAULT_RETENTION = timedelta(hours=23)
DEFAULT_LEASE = timedelta(seconds=30)

_STATE_AFTER = {
    Verdict.SUCCEEDED: OperationState.CONFIRMED,
    Verdict.REJECTED: OperationState.FAILED,
    Verdict.MISMATCH: OperationState.FAILED,
    Verdict.NOT_REPLAYABLE: OperationState.CONFIRMED,
}

#: Errors that end one operation of reconcile() without stopping the others.
RECONCILE_ERRORS = (OperationError, httpx.HTTPError)


def key_digest(key: str) -> str:
    """A short digest that names a key in logs and listings (the key itself is never logged)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


# --- The steps a driver performs --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``request``; renew the lease on ``lease`` (a key) while it is in flight.
    Reply: the response (body read) or the exception."""

    request: httpx.Request
    lease: str


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``. Reply: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Save:
    """Journal ``entry``. Reply: None."""

    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class Get:
    """Read the entry with ``key``. Reply: the entry or None."""

    key: str


@dataclass(frozen=True, slots=True)
class Acquire:
    """Take or renew the lease on ``key`` (and release it when the operation ends).
    Reply: whether it is held."""

    key: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Look ``entry``'s effect up with the probe of its name. Reply: the response found, None
    when not found, or the exception the probe raised."""

    entry: JournalEntry


Step: TypeAlias = Send | Sleep | Save | Get | Acquire | Probe
Reply: TypeAlias = httpx.Response | Exception | JournalEntry | bool | None
Steps: TypeAlias = Generator[Step, Reply, T]


def _get(key: str) -> Steps[JournalEntry | None]:
    reply = yield Get(key)
    assert reply is None or isinstance(reply, JournalEntry)
    return reply


def _acquire(key: str) -> Steps[bool]:
    reply = yield Acquire(key)
    assert isinstance(reply, bool)
    return reply


def _attempt(request: httpx.Request, key: str) -> Steps[httpx.Response | Exception]:
    reply = yield Send(request, key)
    assert isinstance(reply, httpx.Response | Exception)
    return reply


def _probe(entry: JournalEntry) -> Steps[httpx.Response | Exception | None]:
    reply = yield Probe(entry)
    assert reply is None or isinstance(reply, httpx.Response | Exception)
    return reply


class CoreOptions(TypedDict, total=False):
    """The options both clients take and hand to :class:`Core` unchanged."""

    policy: RetryPolicy | None
    header_name: str
    key_prefix: str
    session_id: str | None
    rng: random.Random | None
    retention: timedelta
    keyless: bool
    lease: timedelta


class Core:
    """Everything the two clients share: keys, request encoding, classification, retries,
    leases and confirmation."""

    def __init__(
        self,
        http: httpx.Client | httpx.AsyncClient,
        *,
        owns_http: bool,
        journal: Journal | str | os.PathLike[str],
        clock: Callable[[], float],
        probed: frozenset[str],
        policy: RetryPolicy | None = None,
        header_name: str = "Idempotency-Key",
        key_prefix: str = "op",
        session_id: str | None = None,
        rng: random.Random | None = None,
        retention: timedelta = DEFAULT_RETENTION,
        keyless: bool = False,
        lease: timedelta = DEFAULT_LEASE,
    ) -> None:
        if key_prefix and not KEY_PART.fullmatch(key_prefix):
            raise ConfigurationError(f"key_prefix must match {KEY_PART.pattern}")
        session = session_id if session_id is not None else secrets.token_hex(4)
        if not KEY_PART.fullmatch(session):
            raise ConfigurationError(f"session_id must match {KEY_PART.pattern}")
        if not _HEADER_NAME.fullmatch(header_name):
            raise ConfigurationError("header_name must be a non-empty HTTP header name")
        if retention <= timedelta(0):
            raise ConfigurationError("retention must be positive")
        if lease <= timedelta(0):
            raise ConfigurationError("lease must be positive")
        self.http = http
        self.owns_http = owns_http
        self.owns_journal = not isinstance(journal, Journal)
        self.journal: Journal = journal if isinstance(journal, Journal) else open_journal(journal)
        self.policy = policy or RetryPolicy()
        self.header_name = header_name
        self.key_prefix = key_prefix
        self.session = f"{key_prefix}-{session}" if key_prefix else session
        self.clock = clock
        self.rng = rng or random.Random()
        self.probed = probed
        self.retention = retention.total_seconds()
        self.keyless = keyless
        self.lease = lease.total_seconds()
        #: Who holds this client's leases: unique per client, at most 64 characters.
        self.holder = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._sequence = itertools.count(1)

    # --- Blocking helpers both drivers call (the async one in a worker thread) --------------

    def take_lease(self, key: str, held: set[str]) -> bool:
        """Take or renew the lease on ``key``; remember it in ``held`` to release it later."""
        taken = self.journal.acquire(key, self.holder, self.lease)
        if taken:
            held.add(key)
        return taken

    def renewal(self, key: str) -> Renewal:
        """Renew the lease on ``key`` while a request is in flight, until stopped."""
        return Renewal(
            self.journal,
            key,
            holder=self.holder,
            seconds=self.lease,
            every=self.lease / 3,
            name=key_digest(key),
        )

    def release(self, held: set[str]) -> None:
        """Release the leases in ``held``; one that cannot be released lapses by itself."""
        for key in held:
            try:
                self.journal.release(key, self.holder)
            except Exception as exc:
                logger.warning(
                    "releasing the lease on %s failed: %s", key_digest(key), describe(exc)
                )

    def mark(self, key: str, state: OperationState) -> None:
        """Journal ``state`` for the entry ``key`` (a saga's verdict on it)."""
        entry = self.journal.get(key)
        if entry is not None:
            self.journal.save(replace(entry, state=state))

    def resendable(self) -> list[JournalEntry]:
        """The unsettled entries reconcile() settles: those with a request, except the ones a
        saga handed to a person."""
        return [
            entry
            for entry in self.journal.unsettled()
            if entry.method is not None and entry.state is not OperationState.NEEDS_INTERVENTION
        ]

    def attention(self) -> list[JournalEntry]:
        """Entries a person has to look at."""
        return needing_attention(self.journal)

    # --- Keys and requests -------------------------------------------------------------------

    def new_entry(self, name: str, ref: str | None) -> JournalEntry:
        """A pending entry for a new operation, with a fresh key."""
        check_name(name)
        key = f"{self.session}:{name}:{next(self._sequence):06d}:{secrets.token_hex(8)}"
        return JournalEntry(key=_checked_key(key), name=name, ref=ref, state=OperationState.PENDING)

    def derived_entry(self, name: str, ref: str) -> JournalEntry:
        """A pending entry whose key follows from ``name`` and ``ref`` alone, so that any
        process that runs the same saga again arrives at it."""
        check_name(name)
        prefix = f"{self.key_prefix}-saga" if self.key_prefix else "saga"
        digest = hashlib.sha256(ref.encode()).hexdigest()[:32]
        key = _checked_key(f"{prefix}:{name}:{digest}")
        return JournalEntry(key=key, name=name, ref=ref, state=OperationState.PENDING)

    def prepare(
        self, operation: Operation, method: str, url: str, parts: RequestParts, keyless: bool
    ) -> JournalEntry:
        """The pending entry of ``operation`` with its request encoded once, for every attempt."""
        request = self.http.build_request(
            method,
            url,
            params=parts.get("params"),
            headers=parts.get("headers"),
            content=parts.get("content"),
            data=parts.get("data"),
            json=parts.get("json"),
        )
        given = httpx.Headers(parts.get("headers"))
        unsent = {self.header_name.lower(), "host", "content-length", "transfer-encoding"}
        headers = [(name, value) for name, value in given.multi_items() if name not in unsent]
        content_type = request.headers.get("content-type")
        if content_type is not None and "content-type" not in given:
            headers.append(("content-type", content_type))
        return JournalEntry(
            key=operation.key,
            name=operation.name,
            ref=operation.ref,
            state=OperationState.PENDING,
            method=request.method,
            url=str(request.url),
            headers=tuple(headers),
            body=request.read(),
            keyless=keyless or self.keyless,
        )

    # --- One operation -----------------------------------------------------------------------

    def exchange(
        self, request: JournalEntry, box: list[JournalEntry] | None = None
    ) -> Steps[httpx.Response]:
        """Settle ``request`` (a pending entry with its request): its response, once known.

        Under the operation's lease (or after waiting for another holder's outcome): a
        journaled final response is returned without sending; an attempt that may have
        reached the server is confirmed by probe before re-sending when the server forgot the
        key or never knew keys; otherwise the request is sent until its outcome is known or
        attempts or time run out. ``box``, when given, holds the latest journaled entry.
        """
        if request.method is None or request.url is None:
            raise ConfigurationError(f"operation {request.name!r} has no request to send")
        deadline = self.clock() + self.policy.deadline

        def journaled(new: JournalEntry) -> Save:
            if box is not None:
                box[0] = new
            return Save(new)

        stored = yield from self._take(request, deadline)
        attempt = 0
        last: httpx.Response | Exception | None = None
        probes = 0  # probes that failed
        at_once = True  # the first retry after a request that never left goes at once
        while True:
            if box is not None:
                box[0] = stored
            if _holds_outcome(stored):
                if not stored.same_request(request):
                    raise IdempotencyKeyMismatch(
                        "the journal holds a different request for this key", request.key
                    )
                return _conclude(stored)
            entry = replace(
                request,
                state=stored.state,
                status=stored.status,
                first_sent_at=stored.first_sent_at,
                keyless=request.keyless or stored.keyless,
            )
            maybe = stored.state in MAYBE_DELIVERED
            if maybe and not stored.same_request(request):
                raise IdempotencyKeyMismatch(
                    "the journal holds a different request for this key", request.key
                )
            while True:
                if maybe and self._must_confirm(entry):
                    if entry.name not in self.probed:
                        entry = replace(entry, state=OperationState.NEEDS_CONFIRMATION)
                        yield journaled(entry)
                        raise NeedsConfirmation(entry.key, attempt, last, why=self._why(entry))
                    found = yield from _probe(entry)
                    if isinstance(found, httpx.Response):
                        entry = entry.with_response(OperationState.CONFIRMED, found)
                        yield journaled(entry)
                        return found
                    if isinstance(found, Exception):
                        logger.warning(
                            "probe of %s failed: %s", key_digest(entry.key), _describe(found)
                        )
                        last = found
                        probes += 1
                        delay = self._delay(found, probes, deadline)
                        if delay is None:
                            raise OutcomeUnknown(entry.key, attempt, found) from found
                        yield Sleep(delay)
                        continue
                    # Not found: it never took effect. A new send starts the retention anew.
                    maybe = False
                    entry = replace(entry, first_sent_at=None)
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise (yield from self._give_up(entry, attempt, last, maybe, journaled))
                if not (yield from _acquire(entry.key)):
                    logger.warning("lease on %s lost to another caller", key_digest(entry.key))
                    break  # wait for the new holder, then look at the journal again
                attempt += 1
                if not maybe or entry.first_sent_at is None:  # from now on it may have arrived
                    sent_at = entry.first_sent_at or time.time()
                    entry = replace(entry, state=OperationState.SENT, first_sent_at=sent_at)
                    yield journaled(entry)
                last = yield from _attempt(self._request(entry, remaining), entry.key)
                verdict = classify(last)
                if verdict is Verdict.RAISE:
                    assert isinstance(last, Exception)
                    raise last
                if isinstance(last, httpx.Response) and verdict in _STATE_AFTER:
                    entry = entry.with_response(_STATE_AFTER[verdict], last)
                    yield journaled(entry)
                    return _conclude(entry)
                status = last.status_code if isinstance(last, httpx.Response) else entry.status
                if verdict is Verdict.UNSENDABLE:
                    assert isinstance(last, Exception)
                    state = OperationState.UNKNOWN if maybe else OperationState.FAILED
                    yield journaled(replace(entry, state=state))
                    raise last
                immediate = verdict is Verdict.NOT_SENT and at_once
                at_once = verdict is not Verdict.NOT_SENT
                maybe = maybe or verdict is Verdict.RETRY
                state = OperationState.UNKNOWN if maybe else OperationState.PENDING
                entry = replace(entry, state=state, status=status)
                yield journaled(entry)
                if maybe and self._must_confirm(entry) and entry.name not in self.probed:
                    continue  # nothing to wait for: a person has to confirm it
                delay = self._delay(last, attempt, deadline, immediate=immediate)
                if delay is None:
                    raise (yield from self._give_up(entry, attempt, last, maybe, journaled))
                logger.info(
                    "retrying %s in %.2fs after %s", key_digest(entry.key), delay, _describe(last)
                )
                yield Sleep(delay)
            stored = yield from self._take(request, deadline)

    def settle(self, entry: JournalEntry) -> Steps[JournalEntry]:
        """Re-send (or confirm) an unsettled entry; its journaled entry afterwards, whatever
        the outcome."""
        box = [entry]
        try:
            yield from self.exchange(entry, box)
        except RECONCILE_ERRORS as exc:
            # The error's message holds the key: name only its kind.
            logger.warning(
                "reconcile could not settle %s: %s", key_digest(entry.key), type(exc).__name__
            )
        return box[0]

    def _take(self, request: JournalEntry, deadline: float) -> Steps[JournalEntry]:
        """Hold the lease on ``request``'s operation, or wait until its holder settles it or
        lets go; the journaled entry (settled, when another holder settled it)."""
        waited = False
        while True:
            held = yield from _acquire(request.key)
            stored = yield from _get(request.key)
            if stored is None:  # an Operation journaled elsewhere, or not at all: journal it
                yield Save(request)
                continue
            if held or _holds_outcome(stored):
                return stored
            if self.clock() >= deadline:
                raise OutcomeUnknown(
                    request.key, 0, why="another caller holds the operation and has not settled it"
                )
            if not waited:
                logger.info("waiting for another caller's outcome of %s", key_digest(request.key))
                waited = True
            yield Sleep(min(self.lease / 4, 1.0, max(deadline - self.clock(), 0.0)))

    def _give_up(
        self,
        entry: JournalEntry,
        attempts: int,
        last: httpx.Response | Exception | None,
        maybe: bool,
        journaled: Callable[[JournalEntry], Save],
    ) -> Steps[OperationError]:
        """The error to end with once attempts or time ran out (journaled ``failed`` when no
        attempt left the caller; ``unknown`` is journaled already otherwise)."""
        error: OperationError
        if maybe:
            error = OutcomeUnknown(entry.key, attempts, last)
        else:
            yield journaled(replace(entry, state=OperationState.FAILED))
            error = NotSent(f"no attempt left the caller in {attempts} attempt(s)", entry.key)
        error.__cause__ = last if isinstance(last, Exception) else None
        return error

    def _must_confirm(self, entry: JournalEntry) -> bool:
        """Whether a lost attempt must be looked up instead of re-sent."""
        sent = entry.first_sent_at
        return entry.keyless or (sent is not None and time.time() - sent > self.retention)

    def _why(self, entry: JournalEntry) -> str:
        reason = (
            "the server does not understand keys"
            if entry.keyless
            else "its first attempt is older than the client's retention"
        )
        return f"needs confirmation: {reason}, and no probe is configured for {entry.name!r}"

    def _request(self, entry: JournalEntry, remaining: float) -> httpx.Request:
        assert entry.method is not None
        assert entry.url is not None
        return self.http.build_request(
            entry.method,
            entry.url,
            content=entry.body,
            headers=[*entry.headers, (self.header_name, entry.key)],
            timeout=self.policy.timeout(remaining),
        )

    def _delay(
        self,
        last: httpx.Response | Exception,
        attempt: int,
        deadline: float,
        *,
        immediate: bool = False,
    ) -> float | None:
        """How long to wait before the next attempt; ``None`` to give up."""
        remaining = deadline - self.clock()
        if attempt >= self.policy.max_attempts or remaining <= 0:
            return None
        if immediate:
            return 0.0
        hint = retry_after(last) if isinstance(last, httpx.Response) else None
        if hint is not None:
            return hint if hint < remaining else None
        return self.policy.backoff(attempt, self.rng, limit=remaining)


def check_name(name: str) -> None:
    """Raise unless ``name`` can be part of a key."""
    if not KEY_PART.fullmatch(name):
        raise ConfigurationError(f"operation names must match {KEY_PART.pattern}: {name!r}")


def _checked_key(key: str) -> str:
    if len(key) > MAX_KEY_LENGTH:
        raise ConfigurationError(f"a key would be longer than {MAX_KEY_LENGTH} characters")
    return key


def _holds_outcome(entry: JournalEntry) -> bool:
    """Whether ``entry`` is settled with a response (a failed one may never have been sent)."""
    return entry.state is OperationState.CONFIRMED or (
        entry.state is OperationState.FAILED and entry.response_body is not None
    )


def _conclude(entry: JournalEntry) -> httpx.Response:
    """The settled ``entry``'s response, or the error it stands for."""
    response = entry.response
    if response is None:
        raise ResponseNotReplayable("it took effect; the journal holds no response", entry.key)
    verdict = classify(response)
    if verdict is Verdict.MISMATCH:
        raise IdempotencyKeyMismatch("key reused with a different request", entry.key, response)
    if verdict is Verdict.NOT_REPLAYABLE:
        if problem_type(response) == COMMITTED_WITHOUT_RESPONSE:
            raise CommittedWithoutResponse(
                "it took effect; its response is not available", entry.key, response
            )
        raise ResponseNotReplayable("it ran, but its response is lost", entry.key, response)
    return response


def _describe(outcome: httpx.Response | Exception) -> str:
    if isinstance(outcome, httpx.Response):
        return f"HTTP {outcome.status_code}"
    return type(outcome).__name__
