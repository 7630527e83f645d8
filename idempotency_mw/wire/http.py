"""The headers both halves name, the HTTP-dates they carry, and the problems' type."""

from __future__ import annotations

import functools
import math
import re
from datetime import UTC, datetime
from email.utils import formatdate, parsedate_to_datetime

#: Where a request carries its key, unless told otherwise.
KEY_HEADER = "Idempotency-Key"
#: Set (``true``) on an answer that was replayed from its record rather than run.
REPLAYED_HEADER = "Idempotent-Replayed"
#: An HTTP-date until which a keyed answer's key is kept at least.
EXPIRES_HEADER = "Idempotency-Key-Expires"
#: When the caller first sent the operation (OASIS Repeatable Requests): an HTTP-date.
FIRST_SENT_HEADER = "Repeatability-First-Sent"
REQUEST_ID_HEADER = "Repeatability-Request-ID"
RESULT_HEADER = "Repeatability-Result"
#: Where every ``type`` of the server's RFC 9457 problems begins (over MCP too, in ``data``).
PROBLEM_TYPE_PREFIX = "urn:idempotency-mw:problem:"
#: An HTTP header's name: an RFC 9110 token.
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: Headers a webhook's sender makes anew for every attempt of one message (a timestamp, a
#: signature over it): as a key, a credential or a part of the fingerprint, they would make
#: every re-delivery a new request or a 409.
PER_ATTEMPT_HEADERS = frozenset(
    {
        "webhook-timestamp",
        "webhook-signature",
        "svix-timestamp",
        "svix-signature",
        "stripe-signature",
        "x-hub-signature",
        "x-hub-signature-256",
    }
)


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
    except (TypeError, ValueError, IndexError, OverflowError):  # a year or zone of 11 digits
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
