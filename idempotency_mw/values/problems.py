"""RFC 9457 ``application/problem+json`` answers the middleware gives instead of the app's."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING

from idempotency_mw.values.exceptions import SchemaError, StoreError
from idempotency_mw.wire.http import PROBLEM_TYPE_PREFIX

if TYPE_CHECKING:
    from starlette.types import Send


class Problem(enum.Enum):
    """Each problem the middleware can answer with: (slug, title)."""

    MISSING_KEY = ("missing-key", "Idempotency-Key required")
    INVALID_KEY = ("invalid-key", "Invalid Idempotency-Key")
    IN_PROGRESS = ("in-progress", "Request with this Idempotency-Key is in progress")
    MISMATCH = ("mismatch", "Idempotency-Key reused with a different request")
    UNREPLAYABLE = ("not-replayable", "Response for this Idempotency-Key cannot be replayed")
    TOO_LARGE = ("request-too-large", "Request body too large")
    STORE_UNAVAILABLE = ("store-unavailable", "Idempotency store unavailable")
    #: Its table is missing or old: the operator's to fix (``idempotency-mw migrate``).
    STORE_NOT_READY = ("store-not-ready", "Idempotency store not set up")
    LEASE_LOST = ("lease-lost", "Request stopped: its Idempotency-Key could no longer be held")
    SCOPE_FAILED = ("scope-failed", "The caller's scope could not be determined")
    CREDENTIAL_MISMATCH = (
        "credential-mismatch",
        "Idempotency-Key belongs to a request sent with other credentials",
    )
    COMMITTED_WITHOUT_RESPONSE = (
        "committed-without-response",
        "The request took effect, but its response is not available",
    )
    EXPIRED_KEY = (
        "expired-key",
        "Idempotency-Key first sent longer ago than this server keeps keys",
    )
    INVALID_FIRST_SENT = ("invalid-first-sent", "Invalid Repeatability-First-Sent")
    NOT_REPEATABLE = ("not-repeatable", "This request cannot be made repeatable")

    @property
    def type_uri(self) -> str:
        """The problem's ``type`` member."""
        return PROBLEM_TYPE_PREFIX + self.value[0]


#: Whether a retry with the same key may get another answer. ``False``: the problem is final,
#: and says ``x-should-retry: false`` (Stainless-generated SDKs, openai and anthropic among
#: them, retry every 409 and 5xx otherwise). ``True``: a retry later should follow, told when
#: by ``Retry-After`` and ``retry-after-ms``. A problem not listed says neither: a failed
#: ``scope=`` callable is the server's fault, and a client's own policy for a 500 applies.
RETRYABLE: Mapping[Problem, bool] = {
    Problem.MISSING_KEY: False,
    Problem.INVALID_KEY: False,
    Problem.MISMATCH: False,
    Problem.CREDENTIAL_MISMATCH: False,
    Problem.UNREPLAYABLE: False,
    Problem.COMMITTED_WITHOUT_RESPONSE: False,
    Problem.TOO_LARGE: False,
    Problem.STORE_NOT_READY: False,
    Problem.EXPIRED_KEY: False,
    Problem.INVALID_FIRST_SENT: False,
    Problem.NOT_REPEATABLE: False,
    Problem.IN_PROGRESS: True,
    Problem.STORE_UNAVAILABLE: True,
    Problem.LEASE_LOST: True,
}


def store_failure(exc: StoreError) -> tuple[Problem, int, str | None]:
    """How a keyed call is answered when its store failed with ``exc``: a table missing or
    old (:class:`~idempotency_mw.SchemaError`) is final, 500 with the error's words (they
    name ``idempotency-mw migrate``); any other failure may pass, 503 (the store's words stay
    in the server's log: ``None``)."""
    if isinstance(exc, SchemaError):
        return Problem.STORE_NOT_READY, 500, str(exc)
    return Problem.STORE_UNAVAILABLE, 503, None


async def send_problem(
    send: Send,
    problem: Problem,
    status: int,
    detail: str,
    *,
    retry_after: int | None = None,
) -> None:
    """Send a complete problem+json response, with the retry headers :data:`RETRYABLE` says
    (``retry_after``, in seconds, is required for a retryable problem)."""
    retryable = RETRYABLE.get(problem)
    if retryable is False:
        extra = [(b"x-should-retry", b"false")]
    elif retryable:
        if retry_after is None:
            raise ValueError(f"{problem} needs retry_after")
        extra = [
            (b"retry-after", str(retry_after).encode()),
            (b"retry-after-ms", str(retry_after * 1000).encode()),
        ]
    else:
        extra = []
    await _send(send, problem.type_uri, problem.value[1], status, detail, extra)


async def send_http_problem(
    send: Send, status: int, detail: str, headers: Mapping[str, str] | None = None
) -> None:
    """Send an HTTP error (an ``HTTPException`` raised where the app could not answer it) as a
    problem of type ``about:blank``, with the exception's headers."""
    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    extra = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in (headers or {}).items()
    ]
    await _send(send, "about:blank", title, status, detail, extra)


async def _send(
    send: Send,
    type_uri: str,
    title: str,
    status: int,
    detail: str,
    extra: list[tuple[bytes, bytes]],
) -> None:
    body = json.dumps(
        {"type": type_uri, "title": title, "status": status, "detail": detail}
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
