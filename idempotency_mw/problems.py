"""RFC 9457 ``application/problem+json`` answers the middleware gives instead of the app's."""

from __future__ import annotations

import enum
import json

from starlette.types import Send

_TYPE_PREFIX = "urn:idempotency-mw:problem:"


class Problem(enum.Enum):
    """Each problem the middleware can answer with: (slug, title)."""

    MISSING_KEY = ("missing-key", "Idempotency-Key required")
    INVALID_KEY = ("invalid-key", "Invalid Idempotency-Key")
    IN_PROGRESS = ("in-progress", "Request with this Idempotency-Key is in progress")
    MISMATCH = ("mismatch", "Idempotency-Key reused with a different request")
    UNREPLAYABLE = ("not-replayable", "Response for this Idempotency-Key cannot be replayed")
    TOO_LARGE = ("request-too-large", "Request body too large")
    STORE_UNAVAILABLE = ("store-unavailable", "Idempotency store unavailable")
    LEASE_LOST = ("lease-lost", "Request stopped: its Idempotency-Key could no longer be held")

    @property
    def type_uri(self) -> str:
        """The problem's ``type`` member."""
        return _TYPE_PREFIX + self.value[0]


async def send_problem(
    send: Send,
    problem: Problem,
    status: int,
    detail: str,
    *,
    retry_after: int | None = None,
) -> None:
    """Send a complete problem+json response."""
    body = json.dumps(
        {"type": problem.type_uri, "title": problem.value[1], "status": status, "detail": detail}
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
