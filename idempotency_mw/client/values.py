"""The client's values: operations, journal entries, what a request carries, retry policy."""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import httpx

from idempotency_mw._backoff import Backoff
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.wire.credentials import is_credential
from idempotency_mw.wire.http import EXPIRES_HEADER, parse_http_date

#: Response headers a journal does not keep besides credentials: framing that no longer
#: applies to the decoded body it stores.
_UNKEPT_HEADERS = frozenset(
    {"content-length", "content-encoding", "transfer-encoding", "connection"}
)


#: The server's word on until when it keeps an operation's key (an HTTP-date), journaled with
#: the entry's response headers (lower case) from every answer that says it.
KEY_EXPIRES_HEADER = EXPIRES_HEADER.lower()
#: What the last lookup of the key found (``unknown``, ``in-progress``, ``completed``, ...),
#: journaled beside it.
LOOKED_UP_HEADER = "idempotency-mw-lookup"


class OperationState(enum.StrEnum):
    """Where an operation stands, as journaled.

    ``pending`` → ``sent`` → ``confirmed`` | ``failed`` | ``unknown``. ``unknown`` (an
    attempt's outcome was lost) ends as ``confirmed`` or ``failed`` once a retry or
    ``reconcile()`` gets the server's answer. ``failed``: the server refused it with a final
    4xx (its settled answer, replayed to every retry; a handler that acted before refusing
    owns undoing that), or no attempt ever left the caller. ``needs_confirmation``: its
    outcome is unknown and re-sending it blindly is unsafe (the server may have forgotten the
    key, or never knew keys), and no probe can look it up. ``needs_intervention``: a saga gave
    up on it (a step it could not settle, a compensation that kept failing): a person has to
    look.
    """

    PENDING = "pending"
    SENT = "sent"
    CONFIRMED = "confirmed"
    UNKNOWN = "unknown"
    FAILED = "failed"
    NEEDS_CONFIRMATION = "needs_confirmation"
    NEEDS_INTERVENTION = "needs_intervention"

    @property
    def settled(self) -> bool:
        """Whether the server's answer is known (re-sending would change nothing)."""
        return self in (OperationState.CONFIRMED, OperationState.FAILED)

    @property
    def needs_attention(self) -> bool:
        """Whether a person has to look (see :meth:`IdempotentClient.attention`)."""
        return self in (OperationState.NEEDS_CONFIRMATION, OperationState.NEEDS_INTERVENTION)


#: States in which an attempt may have reached the server with its outcome unknown.
MAYBE_DELIVERED = frozenset(
    {
        OperationState.SENT,
        OperationState.UNKNOWN,
        OperationState.NEEDS_CONFIRMATION,
        OperationState.NEEDS_INTERVENTION,
    }
)


@dataclass(frozen=True, slots=True)
class Operation:
    """One logical operation: its name, the caller's optional reference, and its key."""

    key: str
    name: str
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """An operation as journaled: its key, state, the request to re-send and the final response.

    ``method`` and ``url`` are ``None`` until the operation is first sent. ``status`` is the
    last HTTP status seen; ``response_headers`` and ``response_body`` hold the final response
    once the operation is settled with one, so that it is never sent again. ``keyless``: the
    server does not understand keys, so a lost attempt is looked up, not re-sent.
    ``first_sent_at`` is the wall-clock time of the first attempt (Unix seconds).

    No credential is journaled (see :func:`~idempotency_mw.wire.credentials.is_credential`):
    ``withheld`` names the credential headers the request was given, and ``credentials``
    holds their values in memory only, for the attempts of this process; a resend from the
    journal takes them from the client as configured.
    """

    key: str
    name: str
    ref: str | None
    state: OperationState
    method: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    status: int | None = None
    keyless: bool = False
    first_sent_at: float | None = None
    response_headers: tuple[tuple[str, str], ...] = ()
    response_body: bytes | None = None
    withheld: tuple[str, ...] = ()
    credentials: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    @property
    def operation(self) -> Operation:
        """The operation this entry is about."""
        return Operation(self.key, self.name, self.ref)

    @property
    def response(self) -> httpx.Response | None:
        """The journaled final response, if the entry holds one."""
        if self.status is None or self.response_body is None:
            return None
        request = httpx.Request(self.method or "POST", self.url or "http://journal.invalid/")
        return httpx.Response(
            self.status, headers=self.response_headers, content=self.response_body, request=request
        )

    def with_response(self, state: OperationState, response: httpx.Response) -> JournalEntry:
        """This entry settled as ``state`` with ``response`` (whose body must have been read)."""
        headers = tuple(
            (name, value)
            for name, value in response.headers.multi_items()
            if name not in _UNKEPT_HEADERS and not is_credential(name)
        )
        return replace(
            self,
            state=state,
            status=response.status_code,
            response_headers=headers,
            response_body=response.content,
        )

    @property
    def key_expires_at(self) -> float | None:
        """Until when the server said it keeps the key (Unix seconds), if it said."""
        for name, value in self.response_headers:
            if name == KEY_EXPIRES_HEADER:
                return parse_http_date(value)
        return None

    def noting(self, name: str, value: str) -> JournalEntry:
        """This entry with the response header ``name`` (one of the notes above) set to
        ``value``, in place of any it held."""
        kept = tuple((n, v) for n, v in self.response_headers if n != name)
        return replace(self, response_headers=(*kept, (name, value)))

    def same_request(self, other: JournalEntry) -> bool:
        """Whether ``other`` sends what this entry sent: method, path and query, and body (the
        host may differ, as it does between callers behind different addresses of one API)."""
        return (self.method, _target(self.url), self.body) == (
            other.method,
            _target(other.url),
            other.body,
        )


def _target(url: str | None) -> bytes | None:
    return None if url is None else httpx.URL(url).raw_path


class RequestParts(TypedDict, total=False):
    """What an operation sends besides method and URL (the body must not be a stream)."""

    params: Mapping[str, str | int | float | bool | None]
    headers: Mapping[str, str] | Sequence[tuple[str, str]]
    content: str | bytes
    data: Mapping[str, Any]
    json: Any


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How one operation is retried.

    Waits are "full jitter" (the package's one backoff): uniform up to
    ``min(backoff_cap, backoff_base * 2**(n-1))`` after the n-th attempt, unless the response
    says how long to wait (``retry-after-ms``, or ``Retry-After: <seconds>``). ``deadline``
    bounds the whole operation (seconds): no wait or attempt timeout reaches past it, and a
    ``Retry-After`` that does ends the operation with :class:`OutcomeUnknown` at once.
    """

    max_attempts: int = 6
    backoff_base: float = 0.25
    backoff_cap: float = 10.0
    deadline: float = 60.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        for name in ("backoff_base", "backoff_cap"):
            if not getattr(self, name) >= 0:
                raise ConfigurationError(f"{name} must not be negative")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name} must be positive")

    def backoff(self, attempt: int, rng: random.Random, *, limit: float = math.inf) -> float:
        """The wait after the ``attempt``-th attempt (1-based), at most ``limit``."""
        return Backoff(self.backoff_base, self.backoff_cap).delay(
            attempt - 1, rng.random, limit=limit
        )

    def timeout(self, remaining: float) -> httpx.Timeout:
        """The timeouts of one attempt, none longer than the ``remaining`` time."""
        connect = min(self.connect_timeout, remaining)
        read = min(self.read_timeout, remaining)
        return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)
