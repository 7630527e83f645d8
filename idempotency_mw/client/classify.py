"""What one attempt's response or exception means for its operation."""

from __future__ import annotations

import enum
import json
import re

import httpx

from idempotency_mw.values.problems import Problem

_NOT_REPLAYABLE = (Problem.UNREPLAYABLE.type_uri, Problem.COMMITTED_WITHOUT_RESPONSE.type_uri)


class Verdict(enum.Enum):
    """What one attempt's outcome means for the operation."""

    SUCCEEDED = "succeeded"  # < 400: return the response; confirmed
    REJECTED = "rejected"  # other 4xx, 501, 505: return the response; failed
    RETRY = "retry"  # outcome unknown: retry with the same key; unknown
    NOT_SENT = "not-sent"  # nothing left the caller: retry; failed if it never got out
    MISMATCH = "mismatch"  # raise IdempotencyKeyMismatch; failed
    #: raise IdempotencyCredentialMismatch; failed, or needs_intervention when an earlier
    #: attempt may have run under the other credentials
    CREDENTIAL_MISMATCH = "credential-mismatch"
    NOT_REPLAYABLE = "not-replayable"  # took effect, no response: raise; confirmed
    #: 412: first sent longer ago than the server keeps keys, and no record of it: this attempt
    #: did not run, an earlier one may have. Confirm it, never re-send it blindly.
    EXPIRED = "expired"
    UNSENDABLE = "unsendable"  # the request cannot be sent as built: re-raise; failed
    RAISE = "raise"  # any other exception: re-raise; the journal is left as it is


# Raised before a byte of the request was written: connecting, resolving, or waiting for a
# pooled connection. Every other transport error may come after the server got the request.
_NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_RETRYABLE_ERRORS = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.ProxyError,
)
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
#: 5xx that say the request can never succeed as sent, however often it is retried.
_FINAL_5XX = frozenset({501, 505})
_DECIMAL = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")


def classify(outcome: httpx.Response | Exception) -> Verdict:
    """The verdict on one attempt's response or exception.

    Problem types are matched exactly: an application's own 409 or 422 is a plain 4xx.
    """
    if isinstance(outcome, Exception):
        if isinstance(outcome, _NOT_SENT_ERRORS):
            return Verdict.NOT_SENT
        if isinstance(outcome, _RETRYABLE_ERRORS):
            return Verdict.RETRY
        if isinstance(outcome, httpx.TransportError):  # UnsupportedProtocol, LocalProtocolError
            return Verdict.UNSENDABLE
        return Verdict.RAISE
    status = outcome.status_code
    if status < 400:
        return Verdict.SUCCEEDED
    kind = problem_type(outcome) if status in (409, 412, 422) else ""
    if kind == Problem.MISMATCH.type_uri:
        return Verdict.MISMATCH
    if status == 409 and kind == Problem.CREDENTIAL_MISMATCH.type_uri:
        return Verdict.CREDENTIAL_MISMATCH
    if status == 412 and kind == Problem.EXPIRED_KEY.type_uri:
        return Verdict.EXPIRED
    if status == 409 and kind == Problem.IN_PROGRESS.type_uri:
        return Verdict.RETRY
    if status == 409 and kind in _NOT_REPLAYABLE:
        return Verdict.NOT_REPLAYABLE
    if status in _FINAL_5XX:
        return Verdict.REJECTED
    if status >= 500 or status in _RETRYABLE_STATUSES:
        return Verdict.RETRY
    return Verdict.REJECTED


def problem_type(response: httpx.Response) -> str:
    """The ``type`` of a JSON problem response ('' when the response is not one)."""
    if "json" not in response.headers.get("content-type", ""):
        return ""
    try:
        body = json.loads(response.content)
    except ValueError:
        return ""
    kind = body.get("type") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else ""


def retry_after(response: httpx.Response) -> float | None:
    """The wait the server asks for, in seconds: ``retry-after-ms`` (milliseconds, more
    precise) when given, else ``Retry-After`` in its delay-seconds form."""
    precise = _number(response.headers.get("retry-after-ms", ""))
    if precise is not None:
        return precise / 1000.0
    value = response.headers.get("retry-after", "").strip()
    return float(value) if value.isascii() and value.isdigit() else None


def _number(text: str) -> float | None:
    """A finite, non-negative decimal number, or None."""
    text = text.strip()
    if not _DECIMAL.fullmatch(text):
        return None
    return float(text)
