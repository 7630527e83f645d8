"""The errors an operation can end with; each carries the operation's key."""

from __future__ import annotations

import httpx

from idempotency_mw.values.exceptions import IdempotencyError


class OperationError(IdempotencyError):
    """An operation did not end with a response; ``key`` is its Idempotency-Key."""

    def __init__(self, message: str, key: str, response: httpx.Response | None = None) -> None:
        super().__init__(f"{message} (Idempotency-Key {key!r})")
        self.key = key
        self.response = response


class IdempotencyKeyMismatch(OperationError):
    """The key was already used with a different request: a bug in the caller.

    Raised on the server's ``mismatch`` problem (409 or 422), or before sending when the
    journal holds a different request under the key; the journal marks the operation
    ``failed`` in the first case and leaves it alone in the second.
    """


class IdempotencyCredentialMismatch(OperationError):
    """The key belongs to a request sent with other credentials (the server's 409
    ``credential-mismatch``): the caller's credentials changed under one key, a bug in the
    caller like a key mismatch. Send it with the first request's credentials, or decide a new
    operation.

    The journal marks the operation ``failed`` when no earlier attempt of it may have reached
    the server (the key is another caller's), and ``needs_intervention`` otherwise: an earlier
    attempt, under the other credentials, may have taken effect. ``response`` is the problem.
    """


class CredentialsMissing(OperationError):
    """An operation sent with credentials of its own is sent again from the journal, which
    keeps none, and the client configures none of them (``headers`` names them): nothing was
    sent. Give the client its credentials (``headers=`` or ``auth=``, or the httpx client's
    own) and send or reconcile it again; the journal keeps it as it was."""

    def __init__(self, key: str, headers: tuple[str, ...]) -> None:
        names = ", ".join(headers)
        super().__init__(
            f"the journal keeps no credentials, and this client configures none for {names}:"
            " give the client headers= or auth= to send it again with",
            key,
        )
        self.headers = headers


class ResponseNotReplayable(OperationError):
    """The operation took effect, but the server cannot give its response (it was too large).

    The journal marks the operation ``confirmed``; ``response`` is the server's problem answer.
    """


class CommittedWithoutResponse(ResponseNotReplayable):
    """The operation took effect, but its response is not available: the server answered
    409 ``committed-without-response``. The journal marks it ``confirmed``."""


class OutcomeUnknown(OperationError):
    """Attempts or time ran out before the server's answer was known.

    The operation may or may not have taken effect; the journal keeps it ``unknown`` so that
    ``reconcile()`` (or sending the same :class:`Operation` again) settles it with the same key.
    The last exception, if the last attempt raised one, is the ``__cause__``.
    """

    def __init__(
        self,
        key: str,
        attempts: int,
        last: httpx.Response | Exception | None = None,
        *,
        why: str = "",
    ) -> None:
        if isinstance(last, httpx.Response):
            what = f"HTTP {last.status_code}"
        elif last is not None:
            what = type(last).__name__
        else:
            what = "nothing"
        response = last if isinstance(last, httpx.Response) else None
        reason = why or f"outcome unknown after {attempts} attempt(s), last: {what}"
        super().__init__(reason, key, response)
        self.attempts = attempts


class NeedsConfirmation(OutcomeUnknown):
    """The outcome is unknown and the operation may not be re-sent blindly: its first attempt
    is older than the client's ``retention`` (the server may have forgotten the key) or the
    server does not understand keys, and no probe is configured for it (or the probe failed).
    The journal marks it ``needs_confirmation``; :meth:`IdempotentClient.attention` lists it."""


class NotSent(OperationError):
    """No attempt ever left the caller (connection refused, name resolution, pool full):
    the operation did not take effect (a ``failed`` that, unlike a final 4xx, nothing on the
    server saw). The journal marks it ``failed``; sending it again is
    safe. The last attempt's exception is the ``__cause__``."""
