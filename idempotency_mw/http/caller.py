"""Whose request this is: the caller's scope (the ``scope=`` option) and the digest of its
credentials that a record is bound to. Shared by the exchange and the lookup by key, so that a
lookup sees exactly the records its caller's requests would."""

from __future__ import annotations

import inspect
import logging

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.types import Scope, Send

from idempotency_mw.http.options import Options
from idempotency_mw.values.problems import Problem, send_http_problem, send_problem
from idempotency_mw.wire.credentials import bound_headers, credential_digest

logger = logging.getLogger("idempotency_mw")


def credential_binding(options: Options, scope: Scope, headers: dict[str, list[str]]) -> str:
    """A digest of the caller's credentials, which the record is bound to.

    Without a ``scope`` option a record is bound by checking: the same key sent with other
    credentials never gets this record. With ``scope``, the scope alone decides. The
    credentials are the ``credential_headers`` (by default every header
    :func:`~idempotency_mw.wire.credentials.is_bound` names) and ``credential_cookies``.
    """
    if options.caller_scope is not None:
        return ""
    if options.credential_headers is None:
        values = bound_headers(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]
        )
    else:
        values = [
            (name, value) for name in options.credential_headers for value in headers.get(name, ())
        ]
    if options.credential_cookies:
        cookies = HTTPConnection(scope).cookies
        values += [
            (f"cookie:{name}", cookies[name])
            for name in options.credential_cookies
            if name in cookies
        ]
    if not values:
        return ""
    return credential_digest(values)


async def caller_scope(options: Options, scope: Scope, send: Send) -> str | None:
    """The namespace of this request's keys, from the ``scope`` option ('' without one).

    ``None`` when the request was answered instead: the callable raised an HTTPException
    (its answer, as a problem), or failed or gave no usable scope (a 500 problem, logged:
    the handler never runs unscoped).
    """
    given = options.caller_scope
    if given is None:
        return ""
    try:
        value = given(HTTPConnection(scope))
        if inspect.isawaitable(value):
            value = await value
    except HTTPException as exc:
        await send_http_problem(send, exc.status_code, str(exc.detail), exc.headers)
        return None
    except Exception:
        logger.exception("the scope= callable of IdempotencyMiddleware failed")
        await scope_failed(options, send)
        return None
    if not isinstance(value, str) or not value:
        logger.error(
            "the scope= callable of IdempotencyMiddleware returned %s; it must return a "
            "non-empty string (the handler did not run)",
            "an empty string" if value == "" else f"a {type(value).__name__}",
        )
        await scope_failed(options, send)
        return None
    return value


async def scope_failed(options: Options, send: Send) -> None:
    """Answer that the caller's scope could not be determined (nothing ran)."""
    await send_problem(
        send,
        Problem.SCOPE_FAILED,
        500,
        "The server could not determine whose request this is; the request did not run.",
        retry_after=options.retry_after,
    )
