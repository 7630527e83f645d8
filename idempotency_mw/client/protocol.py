"""The client's protocol: keys, retries, leases, confirmation and journaling, free of I/O.

Every operation is a generator that yields the effects below and receives their results, as
h11 does for HTTP. One async and one sync interpreter (:mod:`idempotency_mw.client._drive`)
perform them, for the clients and the sagas alike; a generator of your own that yields these
effects runs on :meth:`IdempotentClient.perform` just the same.
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
from typing import Any, TypeAlias, TypedDict, TypeVar, cast

import httpx

from idempotency_mw.client.classify import (
    Verdict,
    classify,
    problem_type,
    retry_after,
)
from idempotency_mw.client.errors import (
    CommittedWithoutResponse,
    CredentialsMissing,
    IdempotencyCredentialMismatch,
    IdempotencyKeyMismatch,
    NeedsConfirmation,
    NotSent,
    OperationError,
    OutcomeUnknown,
    ResponseNotReplayable,
)
from idempotency_mw.client.events import ClientEvent, ClientEventHook
from idempotency_mw.client.lookup import learned, lookup_request
from idempotency_mw.client.values import (
    KEY_EXPIRES_HEADER,
    LOOKED_UP_HEADER,
    MAYBE_DELIVERED,
    JournalEntry,
    Operation,
    OperationState,
    RequestParts,
    RetryPolicy,
)
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.metrics import EventHook, guard
from idempotency_mw.values.problems import Problem
from idempotency_mw.values.records import KeyState
from idempotency_mw.wire.credentials import is_credential
from idempotency_mw.wire.http import (
    FIRST_SENT_HEADER,
    HEADER_NAME,
    KEY_HEADER,
    http_date,
    parse_http_date,
)
from idempotency_mw.wire.keys import MAX_KEY_LENGTH, operation_key

logger = logging.getLogger("idempotency_mw.client")

T = TypeVar("T")

KEY_PART = re.compile(r"[A-Za-z0-9._~-]{1,64}")

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


# --- The effects, and what each one's result is -----------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``request``, renewing the lease on ``lease`` (a key) while it is in flight.
    Result: the response (body read) or the exception."""

    request: httpx.Request
    lease: str


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``. Result: None."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Add:
    """Journal the new ``entry``, or find the one of its name and ref. Result: the entry held."""

    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class Save:
    """Journal ``entry`` over the one of its key. Result: None."""

    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class Get:
    """Read the entry with ``key``. Result: the entry or None."""

    key: str


@dataclass(frozen=True, slots=True)
class Unsettled:
    """Read the entries neither confirmed nor failed, oldest first. Result: their list."""


@dataclass(frozen=True, slots=True)
class Acquire:
    """Take or renew the lease on ``key``. Result: whether it is held. The interpreter
    releases a lease it holds on :class:`Release` or, at the latest, when the run ends."""

    key: str


@dataclass(frozen=True, slots=True)
class Release:
    """Release the lease on ``key``, if held. Result: None."""

    key: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Look ``entry``'s effect up with the probe of its name. Result: the response found,
    None when not found, or the exception the probe raised."""

    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``function(*args)`` (awaited by the async interpreter): the caller's own code, such
    as a saga step, that sends through the client. Result: its value, or the
    :class:`OperationError` it raised."""

    function: Callable[..., Any]
    args: tuple[Any, ...] = ()


Effect: TypeAlias = Send | Sleep | Add | Save | Get | Unsettled | Acquire | Release | Probe | Call
Steps: TypeAlias = Generator[Effect, Any, T]


def _checked(result: Any, kind: type[T] | tuple[type, ...]) -> T:
    assert isinstance(result, kind), result
    return cast(T, result)


def add(entry: JournalEntry) -> Steps[JournalEntry]:
    """The entry held for ``entry`` once journaled (see :class:`Add`)."""
    return _checked((yield Add(entry)), JournalEntry)


def get(key: str) -> Steps[JournalEntry | None]:
    """The journaled entry with ``key``, if any."""
    result = yield Get(key)
    return None if result is None else _checked(result, JournalEntry)


def unsettled() -> Steps[list[JournalEntry]]:
    """The journal's unsettled entries, oldest first."""
    return _checked((yield Unsettled()), list)


def acquire(key: str) -> Steps[bool]:
    """Whether the lease on ``key`` is held now."""
    return _checked((yield Acquire(key)), bool)


def send(request: httpx.Request, lease: str) -> Steps[httpx.Response | Exception]:
    """One attempt's response or exception."""
    return _checked((yield Send(request, lease)), (httpx.Response, Exception))


def probe(entry: JournalEntry) -> Steps[httpx.Response | Exception | None]:
    """What ``entry``'s probe found (see :class:`Probe`)."""
    result = yield Probe(entry)
    return None if result is None else _checked(result, (httpx.Response, Exception))


class ProtocolOptions(TypedDict, total=False):
    """The options both clients take and hand to :class:`Protocol` unchanged."""

    policy: RetryPolicy | None
    header_name: str
    key_prefix: str
    session_id: str | None
    rng: random.Random | None
    retention: timedelta
    keyless: bool
    lease: timedelta
    on_event: ClientEventHook | None
    lookup_path: str | None
    first_sent_header: str | None


class Protocol:
    """Keys, request encoding, classification, retries, leases and confirmation: what the
    two clients share, with their I/O left to the interpreter that runs the steps.

    ``build_request`` is the httpx client's (pure: it only merges the client's base URL and
    headers); ``authenticates`` tells whether the httpx client has an ``auth`` (which then
    supplies the credentials a resend from the journal lacks); ``probed`` names the
    operations that have a confirmation probe.
    """

    def __init__(
        self,
        build_request: Callable[..., httpx.Request],
        *,
        clock: Callable[[], float],
        probed: frozenset[str],
        authenticates: Callable[[], bool] = lambda: False,
        policy: RetryPolicy | None = None,
        header_name: str = KEY_HEADER,
        key_prefix: str = "op",
        session_id: str | None = None,
        rng: random.Random | None = None,
        retention: timedelta = DEFAULT_RETENTION,
        keyless: bool = False,
        lease: timedelta = DEFAULT_LEASE,
        on_event: ClientEventHook | None = None,
        lookup_path: str | None = None,
        first_sent_header: str | None = FIRST_SENT_HEADER,
    ) -> None:
        if key_prefix and not KEY_PART.fullmatch(key_prefix):
            raise ConfigurationError(f"key_prefix must match {KEY_PART.pattern}")
        session = session_id if session_id is not None else secrets.token_hex(4)
        if not KEY_PART.fullmatch(session):
            raise ConfigurationError(f"session_id must match {KEY_PART.pattern}")
        if not HEADER_NAME.fullmatch(header_name):
            raise ConfigurationError("header_name must be a non-empty HTTP header name")
        if retention <= timedelta(0):
            raise ConfigurationError("retention must be positive")
        if lease <= timedelta(0):
            raise ConfigurationError("lease must be positive")
        if lookup_path is not None and (
            not lookup_path.startswith("/") or lookup_path.endswith("/")
        ):
            raise ConfigurationError("lookup_path must start with '/' and not end with one")
        if first_sent_header is not None and not HEADER_NAME.fullmatch(first_sent_header):
            raise ConfigurationError("first_sent_header must be an HTTP header name")
        self._build = build_request
        self._authenticates = authenticates
        self.policy = policy or RetryPolicy()
        self.header_name = header_name
        self.key_prefix = key_prefix
        self.session = f"{key_prefix}-{session}" if key_prefix else session
        self.clock = clock
        self.rng = rng or random.Random()
        self.probed = probed
        self.retention = retention.total_seconds()
        self.keyless = keyless
        #: Where the server answers ``GET <lookup_path>/<key>`` (its middleware's option).
        self.lookup_path = lookup_path
        self.first_sent_header = first_sent_header
        #: How long a lease lasts, in seconds (renewed every third of it while sending).
        self.lease = lease.total_seconds()
        #: Who holds this client's leases: unique per client, at most 64 characters.
        self.holder = f"{os.getpid()}-{secrets.token_hex(8)}"
        # The hook shares the server's guard: a broken hook must never fail an operation.
        self._on_event = (
            None if on_event is None else cast(ClientEventHook, guard(cast(EventHook, on_event)))
        )
        self._sequence = itertools.count(1)

    # --- Operations and the journal ----------------------------------------------------------

    def new_entry(self, name: str, ref: str | None) -> JournalEntry:
        """A pending entry for a new operation, with a fresh key."""
        check_name(name)
        # Decided in a protected handler, an operation's key follows from the handler's own:
        # a re-run of the handler sends it again under the same key, and is replayed.
        key = operation_key(name, ref) or (
            f"{self.session}:{name}:{next(self._sequence):06d}:{secrets.token_hex(8)}"
        )
        return JournalEntry(key=_checked_key(key), name=name, ref=ref, state=OperationState.PENDING)

    def operation(self, name: str, ref: str | None) -> Steps[Operation]:
        """Journal a new operation with a fresh key; with ``ref``, the journaled operation of
        that name and ref (with its key) if there is one."""
        stored = yield from add(self.new_entry(name, ref))
        return stored.operation

    def derived(self, name: str, ref: str) -> Steps[JournalEntry]:
        """The journaled entry of the operation ``name`` whose key follows from ``name`` and
        ``ref`` alone, so that any process that runs the same saga again arrives at it."""
        check_name(name)
        prefix = f"{self.key_prefix}-saga" if self.key_prefix else "saga"
        digest = hashlib.sha256(ref.encode()).hexdigest()[:32]
        key = _checked_key(f"{prefix}:{name}:{digest}")
        return (yield from add(JournalEntry(key, name, ref, OperationState.PENDING)))

    def mark(self, key: str, state: OperationState) -> Steps[None]:
        """Journal ``state`` for the entry ``key`` (a saga's verdict on it)."""
        entry = yield from get(key)
        if entry is not None:
            yield from _Track(self, entry).save(replace(entry, state=state))

    def record(self, operation: Operation, state: OperationState) -> Steps[None]:
        """Journal the outcome (``confirmed`` or ``failed``) of an operation sent by other
        means under its key, so that the journal does not keep it pending."""
        if not state.settled:
            raise ConfigurationError(f"an outcome is confirmed or failed, not {state.value}")
        yield from self.mark(operation.key, state)

    def attention(self) -> Steps[list[JournalEntry]]:
        """Entries a person has to look at: ``needs_confirmation`` or ``needs_intervention``."""
        entries = yield from unsettled()
        return [entry for entry in entries if entry.state.needs_attention]

    def reconcile(self) -> Steps[list[JournalEntry]]:
        """Settle every unsettled entry with a request, except the ones a saga handed to a
        person; their entries afterwards."""
        settled = []
        for entry in (yield from unsettled()):
            if entry.method is not None and entry.state is not OperationState.NEEDS_INTERVENTION:
                settled.append((yield from self.settle(entry)))
        return settled

    def prepare(
        self, operation: Operation, method: str, url: str, parts: RequestParts, keyless: bool
    ) -> JournalEntry:
        """The pending entry of ``operation`` with its request encoded once, for every attempt."""
        request = self._build(
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
        headers: list[tuple[str, str]] = []
        credentials: list[tuple[str, str]] = []
        for name, value in given.multi_items():
            if name not in unsent:
                (credentials if is_credential(name) else headers).append((name, value))
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
            withheld=tuple(dict.fromkeys(name for name, _ in credentials)),
            credentials=tuple(credentials),
        )

    # --- One operation -----------------------------------------------------------------------

    def exchange(self, request: JournalEntry) -> Steps[httpx.Response]:
        """Settle ``request`` (a pending entry with its request): its response, once known.

        Under the operation's lease (or after waiting for another holder's outcome): a
        journaled final response is returned without sending; an attempt that may have
        reached the server is confirmed by probe before re-sending when the server forgot the
        key or never knew keys; otherwise the request is sent until its outcome is known or
        attempts or time run out. The lease is released when it ends.
        """
        return (
            yield from self._leased(request.key, self._exchange(request, _Track(self, request)))
        )

    def settle(self, entry: JournalEntry) -> Steps[JournalEntry]:
        """Re-send (or confirm) an unsettled entry; its journaled entry afterwards, whatever
        the outcome."""
        track = _Track(self, entry)
        try:
            yield from self._leased(entry.key, self._exchange(entry, track))
        except RECONCILE_ERRORS as exc:
            # The error's message holds the key: name only its kind.
            logger.warning(
                "reconcile could not settle %s: %s", key_digest(entry.key), type(exc).__name__
            )
        return track.entry

    def _leased(self, key: str, steps: Steps[T]) -> Steps[T]:
        # Not in a finally: a generator closed mid-step cannot yield; the interpreter then
        # releases what it holds when the run ends.
        try:
            result = yield from steps
        except Exception:
            yield Release(key)
            raise
        yield Release(key)
        return result

    def _exchange(self, request: JournalEntry, track: _Track) -> Steps[httpx.Response]:
        if request.method is None or request.url is None:
            raise ConfigurationError(f"operation {request.name!r} has no request to send")
        deadline = self.clock() + self.policy.deadline
        stored = yield from self._take(request, deadline)
        attempt = 0
        last: httpx.Response | Exception | None = None
        probes = 0  # probes that failed
        at_once = True  # the first retry after a request that never left goes at once
        looked = False  # the server's lookup was asked since the last attempt
        warned = False  # the caller was told its retries outlast the server's retention
        while True:
            track.entry = stored
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
                response_headers=stored.response_headers,
                withheld=tuple(dict.fromkeys((*stored.withheld, *request.withheld))),
            )
            self._check_credentials(entry)
            maybe = stored.state in MAYBE_DELIVERED
            if maybe and not stored.same_request(request):
                raise IdempotencyKeyMismatch(
                    "the journal holds a different request for this key", request.key
                )
            while True:
                if maybe and self._must_confirm(entry):
                    if entry.name not in self.probed:
                        entry = replace(entry, state=OperationState.NEEDS_CONFIRMATION)
                        yield from track.save(entry)
                        raise NeedsConfirmation(entry.key, attempt, last, why=self._why(entry))
                    found = yield from probe(entry)
                    if isinstance(found, httpx.Response):
                        entry = entry.with_response(OperationState.CONFIRMED, found)
                        yield from track.save(entry)
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
                    raise (yield from self._give_up(entry, attempt, last, maybe, track))
                # After an outcome lost on the way (not a server's answer), ask first.
                if maybe and not looked and not isinstance(last, httpx.Response):
                    looked = True
                    entry = yield from self._look_up(entry, remaining, track)
                    if entry.state.settled:
                        return _conclude(entry)
                if not (yield from acquire(entry.key)):
                    logger.warning("lease on %s lost to another caller", key_digest(entry.key))
                    break  # wait for the new holder, then look at the journal again
                attempt += 1
                if not maybe or entry.first_sent_at is None:  # from now on it may have arrived
                    sent_at = entry.first_sent_at or time.time()
                    entry = replace(entry, state=OperationState.SENT, first_sent_at=sent_at)
                    yield from track.save(entry)
                last = yield from send(self._request(entry, remaining), entry.key)
                looked = False
                entry = self._kept(entry, last)
                verdict = classify(last)
                if verdict is Verdict.RAISE:
                    assert isinstance(last, Exception)
                    raise last
                if verdict is Verdict.CREDENTIAL_MISMATCH:
                    assert isinstance(last, httpx.Response)
                    # This attempt did not run; an earlier one, under other credentials, may.
                    state = OperationState.NEEDS_INTERVENTION if maybe else OperationState.FAILED
                    entry = entry.with_response(state, last)
                    yield from track.save(entry)
                    raise _credential_mismatch(entry.key, last)
                if isinstance(last, httpx.Response) and verdict in _STATE_AFTER:
                    entry = entry.with_response(_STATE_AFTER[verdict], last)
                    yield from track.save(entry)
                    return _conclude(entry)
                status = last.status_code if isinstance(last, httpx.Response) else entry.status
                if verdict is Verdict.EXPIRED:
                    # The server has no record and will not run it: confirm, never re-send.
                    maybe = True
                    entry = replace(entry, state=OperationState.UNKNOWN, status=status)
                    yield from track.save(entry.noting(KEY_EXPIRES_HEADER, http_date(0)))
                    entry = track.entry
                    continue
                if verdict is Verdict.UNSENDABLE:
                    assert isinstance(last, Exception)
                    state = OperationState.UNKNOWN if maybe else OperationState.FAILED
                    yield from track.save(replace(entry, state=state))
                    raise last
                immediate = verdict is Verdict.NOT_SENT and at_once
                at_once = verdict is not Verdict.NOT_SENT
                maybe = maybe or verdict is Verdict.RETRY
                state = OperationState.UNKNOWN if maybe else OperationState.PENDING
                entry = replace(entry, state=state, status=status)
                yield from track.save(entry)
                if maybe and self._must_confirm(entry) and entry.name not in self.probed:
                    continue  # nothing to wait for: a person has to confirm it
                delay = self._delay(last, attempt, deadline, immediate=immediate)
                if delay is None:
                    raise (yield from self._give_up(entry, attempt, last, maybe, track))
                logger.info(
                    "retrying %s in %.2fs after %s", key_digest(entry.key), delay, _describe(last)
                )
                if not warned:
                    warned = self._outlasts(entry, deadline)
                yield Sleep(delay)
            stored = yield from self._take(request, deadline)

    def _look_up(self, entry: JournalEntry, remaining: float, track: _Track) -> Steps[JournalEntry]:
        """Ask the server what became of ``entry``'s key (when it has a lookup) and journal
        what it said: the entry settled when the server holds its outcome (its replay, or
        ``confirmed`` without a response when it took effect without one), else as it was."""
        if self.lookup_path is None:
            return entry
        timeout = self.policy.timeout(remaining)
        answer = yield from send(
            lookup_request(self._build, entry, self.lookup_path, timeout), entry.key
        )
        found = learned(answer)
        entry = self._kept(entry, answer).noting(LOOKED_UP_HEADER, found.state)
        if found.replay is not None and classify(found.replay) in _STATE_AFTER:
            entry = entry.with_response(_STATE_AFTER[classify(found.replay)], found.replay)
        elif found.state in (KeyState.COMPLETED, KeyState.COMMITTED):
            entry = replace(entry, state=OperationState.CONFIRMED, status=found.status)
        yield from track.save(entry)
        if found.state == KeyState.COMMITTED:
            raise CommittedWithoutResponse(
                "it took effect (the server's lookup says so); its response is not available",
                entry.key,
            )
        return entry

    def _kept(self, entry: JournalEntry, outcome: httpx.Response | Exception) -> JournalEntry:
        """``entry`` noting until when the server keeps its key, if ``outcome`` says."""
        if not isinstance(outcome, httpx.Response):
            return entry
        value = outcome.headers.get(KEY_EXPIRES_HEADER)
        if value is None or parse_http_date(value) is None:
            return entry
        return entry.noting(KEY_EXPIRES_HEADER, value)

    def _outlasts(self, entry: JournalEntry, deadline: float) -> bool:
        """Report (an event) that the retries of ``entry`` may go on after the server stops
        keeping its key; whether they may."""
        expires = entry.key_expires_at
        if expires is None or expires >= time.time() + max(deadline - self.clock(), 0.0):
            return False
        logger.warning(
            "the server keeps the key of %s for less time than its retries may take",
            key_digest(entry.key),
        )
        if self._on_event is not None:
            self._on_event(
                ClientEvent(
                    entry.state, entry.state, entry.name, key_digest(entry.key), kept_until=expires
                )
            )
        return True

    def _take(self, request: JournalEntry, deadline: float) -> Steps[JournalEntry]:
        """Hold the lease on ``request``'s operation, or wait until its holder settles it or
        lets go; the journaled entry (settled, when another holder settled it)."""
        waited = False
        while True:
            held = yield from acquire(request.key)
            stored = yield from get(request.key)
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
            # A poll at a steady pace, not a backoff: the holder's settling is what ends it.
            yield Sleep(min(self.lease / 4, 1.0, max(deadline - self.clock(), 0.0)))

    def _give_up(
        self,
        entry: JournalEntry,
        attempts: int,
        last: httpx.Response | Exception | None,
        maybe: bool,
        track: _Track,
    ) -> Steps[OperationError]:
        """The error to end with once attempts or time ran out (journaled ``failed`` when no
        attempt left the caller; ``unknown`` is journaled already otherwise)."""
        error: OperationError
        if maybe:
            error = OutcomeUnknown(entry.key, attempts, last)
        else:
            yield from track.save(replace(entry, state=OperationState.FAILED))
            error = NotSent(f"no attempt left the caller in {attempts} attempt(s)", entry.key)
        error.__cause__ = last if isinstance(last, Exception) else None
        return error

    def _must_confirm(self, entry: JournalEntry) -> bool:
        """Whether a lost attempt must be looked up instead of re-sent."""
        sent, kept = entry.first_sent_at, entry.key_expires_at
        return (
            entry.keyless
            or (sent is not None and time.time() - sent > self.retention)
            or (kept is not None and kept <= time.time())
        )

    def _why(self, entry: JournalEntry) -> str:
        reason = confirmation_reason(entry, time.time())
        return f"needs confirmation: {reason}, and no probe is configured for {entry.name!r}"

    def _check_credentials(self, entry: JournalEntry) -> None:
        """Raise :class:`CredentialsMissing` unless every credential ``entry`` was sent with is
        at hand: given with it in this process, or supplied by the client (its default
        headers or cookies, or its ``auth``, which signs every request)."""
        given = {name for name, _ in entry.credentials}
        missing = [name for name in entry.withheld if name not in given]
        if not missing or self._authenticates():
            return
        assert entry.url is not None
        defaults = self._build(entry.method or "POST", entry.url).headers
        missing = [name for name in missing if name not in defaults]
        if missing:
            raise CredentialsMissing(entry.key, tuple(missing))

    def _request(self, entry: JournalEntry, remaining: float) -> httpx.Request:
        assert entry.method is not None
        assert entry.url is not None
        headers = [*entry.headers, *entry.credentials, (self.header_name, entry.key)]
        if self.first_sent_header is not None and entry.first_sent_at is not None:
            headers.append((self.first_sent_header, http_date(entry.first_sent_at)))
        return self._build(
            entry.method,
            entry.url,
            content=entry.body,
            headers=headers,
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

    def _moved(self, previous: OperationState, entry: JournalEntry) -> None:
        if self._on_event is not None and entry.state is not previous:
            self._on_event(ClientEvent(entry.state, previous, entry.name, key_digest(entry.key)))


class _Track:
    """The latest journaled entry of one operation; its saves report the state changes."""

    def __init__(self, protocol: Protocol, entry: JournalEntry) -> None:
        self._protocol = protocol
        self.entry = entry

    def save(self, new: JournalEntry) -> Steps[None]:
        yield Save(new)
        self._protocol._moved(self.entry.state, new)
        self.entry = new


def confirmation_reason(entry: JournalEntry, now: float) -> str:
    """Why a lost attempt of ``entry`` is looked up, never sent again blindly (``now`` in Unix
    seconds): what the client's own check found, as the panel shows it."""
    kept = entry.key_expires_at
    if entry.keyless:
        return "the server does not understand keys"
    if kept is not None and kept <= now:
        return "the server no longer keeps its key"
    return "its first attempt is older than the client's retention"


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


def _credential_mismatch(key: str, response: httpx.Response) -> IdempotencyCredentialMismatch:
    return IdempotencyCredentialMismatch(
        "the key was used by a request sent with other credentials", key, response
    )


def _conclude(entry: JournalEntry) -> httpx.Response:
    """The settled ``entry``'s response, or the error it stands for."""
    response = entry.response
    if response is None:
        raise ResponseNotReplayable("it took effect; the journal holds no response", entry.key)
    verdict = classify(response)
    if verdict is Verdict.MISMATCH:
        raise IdempotencyKeyMismatch("key reused with a different request", entry.key, response)
    if verdict is Verdict.CREDENTIAL_MISMATCH:
        raise _credential_mismatch(entry.key, response)
    if verdict is Verdict.NOT_REPLAYABLE:
        if problem_type(response) == Problem.COMMITTED_WITHOUT_RESPONSE.type_uri:
            raise CommittedWithoutResponse(
                "it took effect; its response is not available", entry.key, response
            )
        raise ResponseNotReplayable("it ran, but its response is lost", entry.key, response)
    return response


def _describe(outcome: httpx.Response | Exception) -> str:
    if isinstance(outcome, httpx.Response):
        return f"HTTP {outcome.status_code}"
    return type(outcome).__name__
