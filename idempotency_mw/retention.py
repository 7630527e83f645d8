"""What every keyed answer says about its key, and the refusal of a retry too old to tell.

A keyed answer (a first run, a replay, a 409) carries ``Idempotency-Key-Expires``: an
HTTP-date until which the key's record is kept at least (a first run's record is kept ``ttl``
from its completion, so the date, taken when its answer starts, is never late). A caller may
send the time it first sent the operation, ``Repeatability-First-Sent`` (an HTTP-date, as the
OASIS Repeatable Requests specification defines it): when the key has no record and that time
is older than the route's ``ttl`` on the store's clock (or further ahead than
:data:`~idempotency_mw.outcome.FIRST_SENT_SKEW`), the record may have been purged, so the
claim takes nothing and the request is refused with 412 instead of run as if new. Callers
that send their key as ``Repeatability-Request-ID`` (OASIS) are also told
``Repeatability-Result: accepted`` (their key is kept) or ``rejected``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import formatdate, parsedate_to_datetime

from starlette.types import Message, Send

EXPIRES_HEADER = "Idempotency-Key-Expires"
FIRST_SENT_HEADER = "Repeatability-First-Sent"
REQUEST_ID_HEADER = "Repeatability-Request-ID"
RESULT_HEADER = "Repeatability-Result"


def http_date(seconds: float) -> str:
    """``seconds`` (Unix time) as an HTTP-date, rounded down to the second."""
    return _http_date(math.floor(seconds))


@functools.lru_cache(maxsize=64)
def _http_date(second: int) -> str:
    # Every keyed answer says a date, and the answers of one second and route say the same.
    return formatdate(second, usegmt=True)


def parse_http_date(value: str) -> float | None:
    """The Unix time of an HTTP-date (any form RFC 9110 accepts; a zone-less one is UTC), or
    ``None`` when ``value`` is not one."""
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def parse_first_sent(value: object) -> float | None:
    """The Unix time of a first-sent time given as JSON (MCP's ``_meta``): an HTTP-date, or an
    RFC 3339 date-time with its offset; ``None`` for anything else."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return parse_http_date(value)
    return moment.timestamp() if moment.tzinfo is not None else None


class KeyAnswers:
    """The ``send`` of one keyed request: it adds what the answer says about the key.

    The exchange tells it what the claim found (:meth:`found`, :meth:`ran`); what the app
    sends is recorded before it passes here, so a replay carries the date of its record, not
    the first answer's.
    """

    def __init__(
        self,
        send: Send,
        *,
        oasis: bool,
        first_sent: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._send = send
        self._oasis = oasis
        self.first_sent = first_sent
        self._clock = clock
        self._expires_at: float | None = None
        #: A first run's retention, counted from its answer (statuses it releases excepted).
        self._ttl: float | None = None
        self._released: frozenset[int] = frozenset()
        self._rejected = False

    def found(self, expires_at: float | None) -> None:
        """The claim found the caller's record, kept until ``expires_at`` (if known)."""
        self._expires_at = expires_at

    def ran(self, ttl: float, released: frozenset[int] = frozenset()) -> None:
        """The key's record is kept ``ttl`` from the answer's end at least, unless its status
        is ``released`` (or a 5xx, which releases the key): the claim was acquired, or another
        request holds the key (its record is kept ``ttl`` from its completion)."""
        self._ttl, self._released = ttl, released

    def reject(self) -> None:
        """The request is refused for its first-sent time (or its key): nothing is kept."""
        self._rejected = True

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            extra = self._headers(message["status"])
            if extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await self._send(message)

    def _headers(self, status: int) -> list[tuple[bytes, bytes]]:
        expires = self._expires_at
        if self._ttl is not None:
            kept = status < 500 and status not in self._released
            expires = self._clock() + self._ttl if kept else None
        extra = []
        if expires is not None and not self._rejected:
            extra.append((b"idempotency-key-expires", http_date(expires).encode()))
        if self._oasis and (self._rejected or expires is not None):
            extra.append((b"repeatability-result", b"rejected" if self._rejected else b"accepted"))
        return extra
