"""What every keyed answer says about its key, and the refusal of a retry too old to tell.

A keyed answer (a first run, a replay, a 409) carries ``Idempotency-Key-Expires``: an
HTTP-date until which the key's record is kept at least (a first run's record is kept ``ttl``
from its completion, so the date, taken when its answer starts, is never late). A caller may
send the time it first sent the operation, ``Repeatability-First-Sent`` (an HTTP-date, as the
OASIS Repeatable Requests specification defines it): when the key has no record and that time
is older than the route's ``ttl`` on the store's clock (or further ahead than
:data:`~idempotency_mw.values.outcome.FIRST_SENT_SKEW`), the record may have been purged, so the
claim takes nothing and the request is refused with 412 instead of run as if new. Every
answer to a caller that sends its key as ``Repeatability-Request-ID`` (OASIS) says
``Repeatability-Result``: ``accepted`` when the key's record holds this very request's one
execution, ``rejected`` otherwise (see :meth:`KeyAnswers.accepted`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.types import Message, Send

from idempotency_mw.values.records import ClaimOutcome
from idempotency_mw.wire.http import EXPIRES_HEADER, RESULT_HEADER, http_date

#: The outcomes whose record is another request's: the key reused for another request, or
#: by other credentials. This request never runs under the key (OASIS 3.2.1.1: ``rejected``).
_ANOTHER_REQUESTS = frozenset({ClaimOutcome.MISMATCH, ClaimOutcome.CREDENTIAL_MISMATCH})
_EXPIRES = EXPIRES_HEADER.lower().encode()
_RESULT = RESULT_HEADER.lower().encode()


def _below_500(status: int) -> bool:
    return status < 500


class KeyAnswers:
    """The ``send`` of one keyed request: it adds what the answer says about the key.

    The exchange tells it what the claim found (:meth:`found`, :meth:`ran`); what the app
    sends is recorded before it passes here, so a replay carries the date of its record, not
    the first answer's. An answer given before any claim (a bad key, the store unavailable,
    a route the app does not have) says nothing of a kept key.
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
        #: A first run's retention, counted from its answer, for the statuses ``_keeps``.
        self._ttl: float | None = None
        self._keeps: Callable[[int], bool] = _below_500
        #: Whether the claim found (or took) this request's own record.
        self._own = False
        self._rejected = False

    def found(self, expires_at: float | None, outcome: ClaimOutcome | None = None) -> None:
        """The claim found a record with ``outcome``, kept until ``expires_at`` (if known);
        ``None``: a lookup, which only tells the date."""
        self._expires_at = expires_at
        self._own = outcome is not None and outcome not in _ANOTHER_REQUESTS

    def ran(self, ttl: float, keeps: Callable[[int], bool] = _below_500) -> None:
        """The key's record is kept ``ttl`` from the answer's end at least if ``keeps`` its
        status (else the key is released): the claim was acquired, or another request with
        the same key and body holds it (its record is kept ``ttl`` from its completion)."""
        self._ttl, self._keeps, self._own = ttl, keeps, True

    def finished(self) -> None:
        """The request is over: let go of the rule :meth:`ran` was given."""
        self._keeps = _below_500

    def reject(self) -> None:
        """The request is refused for its first-sent time: nothing is kept."""
        self._rejected = True

    def accepted(self, status: int) -> bool:
        """OASIS ``Repeatability-Result`` (3.2.1) of an answer of ``status``: ``accepted``
        when the key's record holds this very request's one execution (run, running,
        replayed, or told it ran), ``rejected`` for every other answer: refused before a
        claim, another request's key, a first-sent time too old, a released key."""
        return self._own and not self._rejected and (self._ttl is None or self._keeps(status))

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            extra = self._headers(message["status"])
            if extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await self._send(message)

    def _headers(self, status: int) -> list[tuple[bytes, bytes]]:
        expires = self._expires_at
        if self._ttl is not None:
            expires = self._clock() + self._ttl if self._keeps(status) else None
        extra = []
        if expires is not None and not self._rejected:
            extra.append((_EXPIRES, http_date(expires).encode()))
        if self._oasis:
            result = b"accepted" if self.accepted(status) else b"rejected"
            extra.append((_RESULT, result))
        return extra
