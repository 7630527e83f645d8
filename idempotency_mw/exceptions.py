"""The library's errors: one base class and a few that callers act on."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError


class IdempotencyError(Exception):
    """Base class of every error raised by idempotency-mw."""


class ConfigurationError(IdempotencyError, ValueError):
    """An option given to the middleware, a decorator or a store is invalid."""


class StoreError(IdempotencyError):
    """The store could not be reached or failed; the driver's error is the ``__cause__``."""


class SchemaError(StoreError):
    """The idempotency table is missing or older than this version of the library expects."""


def describe(exc: BaseException) -> str:
    """A driver's error on one line, without the SQL and parameters SQLAlchemy adds to it.

    Parameters hold keys, caller scopes and response bodies, which must never reach a log.
    """
    error = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
