"""fence(): the request's claim checked, and its effect marked, inside the app's transaction.

Between "the handler committed its effect" and "the response was recorded" a middleware alone
has a window (a store error, a lost lease, a crash) after which a retry runs the handler again.
A fenced commit closes it: the idempotency record moves with the application's own transaction.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from idempotency_mw.exceptions import ConfigurationError, LeaseLost

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from idempotency_mw.stores.base import Store


@dataclass(frozen=True, slots=True)
class CurrentClaim:
    """The claim of the request being handled, as the middleware made it."""

    store: Store
    scope: str
    key: str
    token: str


#: The request reached a guarded route without a key: there is no claim to fence.
UNKEYED = "unkeyed"
#: Set by the middleware around the handler; copied into its tasks and worker threads.
current_claim: contextvars.ContextVar[CurrentClaim | str | None] = contextvars.ContextVar(
    "idempotency_mw_current_claim", default=None
)


async def fence(session: Any, *, store: Store | None = None) -> None:
    """Check, inside ``session``'s transaction, that this request still owns its key, and mark
    the key's effect committed in the same transaction.

    ``session`` is an ``AsyncSession`` or ``AsyncConnection`` in a transaction on the database
    of the middleware's ``SQLStore`` (or of ``store``). If another request took the key over,
    :class:`~idempotency_mw.LeaseLost` is raised and the transaction must roll back: the effect
    is never committed twice. Once committed, the key never runs again within its TTL. A
    request sent without a key (on a route where the key is optional) has nothing to fence:
    ``fence`` then does nothing.
    """
    if current_claim.get() == UNKEYED:
        return
    claim, target = _claim_and_store(store)
    if not session.in_transaction():
        raise ConfigurationError(
            "fence() must run inside the transaction that commits the effect "
            "(e.g. `async with session.begin(): ... await fence(session)`)"
        )
    connection = await session.connection() if hasattr(session, "get_bind") else session
    _check_same_database(target, connection.engine.url)
    statement, params = target.fence_statement(claim.scope, claim.key, claim.token)
    result = await connection.execute(statement, params)
    _check_owned(result.rowcount)


def fence_sync(session: Any, *, store: Store | None = None) -> None:
    """:func:`fence` for a synchronous ``Session`` or ``Connection`` (a sync endpoint)."""
    if current_claim.get() == UNKEYED:
        return
    claim, target = _claim_and_store(store)
    if not session.in_transaction():
        raise ConfigurationError(
            "fence_sync() must run inside the transaction that commits the effect "
            "(e.g. `with session.begin(): ... fence_sync(session)`)"
        )
    connection = session.connection() if hasattr(session, "get_bind") else session
    _check_same_database(target, connection.engine.url)
    statement, params = target.fence_statement(claim.scope, claim.key, claim.token)
    _check_owned(connection.execute(statement, params).rowcount)


def _claim_and_store(store: Store | None) -> tuple[CurrentClaim, Any]:
    claim = current_claim.get()
    if not isinstance(claim, CurrentClaim):
        raise ConfigurationError(
            "fence() is only for a request guarded by IdempotencyMiddleware with a key "
            "(none is being handled here)"
        )
    target = claim.store if store is None else store
    if not hasattr(target, "fence_statement"):
        raise ConfigurationError(
            f"fence() needs a SQLStore on the application's database; {target!r} cannot take "
            "part in the application's transaction"
        )
    return claim, target


def _check_same_database(store: Any, url: URL) -> None:
    if _database_of(store.url) != _database_of(url):
        raise ConfigurationError(
            "fence() was given a session on another database than the idempotency store's "
            f"({url.render_as_string(hide_password=True)} is not "
            f"{store.url.render_as_string(hide_password=True)}): write the host the same way "
            "in both URLs, or pass store= for the SQLStore on the session's database"
        )


_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}


def _database_of(url: URL) -> tuple[str, str | None, int | None, str | None]:
    """What names one database, whatever the driver and credentials."""
    backend, database = url.get_backend_name(), url.database
    if backend == "sqlite" and database not in (None, "", ":memory:"):
        database = str(Path(database).resolve())
    return backend, url.host, url.port or _DEFAULT_PORTS.get(backend), database


def _check_owned(rowcount: int) -> None:
    if rowcount != 1:
        raise LeaseLost(
            "this request no longer holds its Idempotency-Key (another request took it over): "
            "roll back, the effect must not be committed twice"
        )
