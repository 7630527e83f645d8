"""The library's errors: one base class and a few that callers act on."""

from __future__ import annotations


def install_extra(extra: str) -> str:
    """How to install one of this package's extras, from an index or from a checkout."""
    return (
        f"install the [{extra}] extra (pip install 'idempotency-mw[{extra}]', "
        f"or from a checkout: pip install -e '.[{extra}]')"
    )


class IdempotencyError(Exception):
    """Base class of every error raised by idempotency-mw."""


class ConfigurationError(IdempotencyError, ValueError):
    """An option given to the middleware, a decorator or a store is invalid."""


class InvalidKey(ConfigurationError):
    """A key is not 1-255 visible ASCII characters: refused before anything is claimed or run,
    and refused again however often it is sent."""


class StoreError(IdempotencyError):
    """The store could not be reached or failed; the driver's error is the ``__cause__``.

    The message names the operation, the store and the cause.
    """


class LeaseLost(IdempotencyError):
    """The request's claim on its key is no longer the live one (another request took it over):
    raised by :func:`~idempotency_mw.fence` so that the application's transaction rolls back."""


class EffectCommitted(LeaseLost):
    """Raised by :func:`~idempotency_mw.fence` when an earlier run of the key already committed
    its effect (its proof is in the application's database, whatever the store forgot): roll
    back; the client is told the key took effect."""


class SettlementFeedUnsupported(IdempotencyError):
    """The store's backend cannot announce settled records (SQLite, MariaDB/MySQL, a
    PostgreSQL driver other than asyncpg): requests that wait for a key poll the store instead.
    The message says why."""


class SchemaError(StoreError):
    """The idempotency table is missing or older than this version of the library expects."""


def describe(exc: BaseException) -> str:
    """A driver's error on one line, without the SQL and parameters SQLAlchemy adds to it.

    Parameters hold keys, caller scopes and response bodies, which must never reach a log.
    """
    # SQLAlchemy's DBAPIError keeps the driver's own error in ``orig``.
    original = getattr(exc, "orig", None)
    error = original if isinstance(original, BaseException) else exc
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def store_error(operation: str, store: str, exc: BaseException, timeout: float) -> StoreError:
    """The StoreError of ``operation`` on ``store`` (as ``repr`` shows it) that failed with
    ``exc``; a timeout of the store's own says how long it waited."""
    if isinstance(exc, TimeoutError) and not str(exc):
        cause = f"no answer within {timeout} s"
    else:
        cause = describe(exc)
    return StoreError(f"{operation} on {store} failed: {cause}")
