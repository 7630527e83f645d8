"""fence(): the request's claim checked, and its effect marked, inside the app's transaction.

Between "the handler committed its effect" and "the response was recorded" a middleware alone
has a window (a store error, a lost lease, a crash) after which a retry runs the handler again.
A fenced commit closes it: the idempotency record moves with the application's own transaction.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio.from_thread

from idempotency_mw.values.exceptions import ConfigurationError, EffectCommitted, LeaseLost
from idempotency_mw.wire.keys import current_claim

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

    from idempotency_mw.stores.base import Store


@dataclass(slots=True)
class CurrentClaim:
    """The claim of the call being handled, as the claim engine made it."""

    store: Store
    scope: str
    key: str
    token: str
    #: The key's TTL in seconds: how long a proof in the application's database lives.
    ttl: float
    #: What the claim's record holds, to write it again if it was lost before its flush.
    fingerprint: str = ""
    binding: str = ""
    lease: float = 0.0
    #: Set once ``fence()`` marked the effect in the app's transaction: from then on nothing
    #: can take the key over, so a lost lease never stops the call.
    fenced: bool = False
    #: Set when ``fence()`` found an earlier run's committed effect (and raised
    #: :class:`~idempotency_mw.EffectCommitted`): whatever this run then fails with, the key's
    #: effect happened, and its caller must be told so.
    committed_earlier: bool = False
    #: How many client operations of each name this run decided (their keys are derived from
    #: the sequence: see :func:`~idempotency_mw.wire.keys.operation_key`).
    operations: dict[str, int] = field(default_factory=dict)


#: The request reached a guarded route without a key: there is no claim to fence.
UNKEYED = "unkeyed"
#: The store failed and the middleware runs the request unprotected (``fail_open``).
UNPROTECTED = "unprotected"


#: What the route's door gets when the claim waits for the endpoint (its caller's scope comes
#: from one of the endpoint's dependencies).
AT_THE_ENDPOINT = "at-the-endpoint"


class Entrance(Protocol):
    """What the doors of a route (and a ``fence()`` before its endpoint) ask of the request's
    exchange."""

    def passed(self, *, endpoint: bool) -> bool:
        """Note that a door was passed (the endpoint's when ``endpoint``): whether the key was
        claimed before it, and the request goes on with that claim (``current_claim``'s
        already); when not, :meth:`enter` claims it."""
        ...

    async def enter(self, caller_scope: object, *, endpoint: bool) -> CurrentClaim | str | None:
        """Claim the key, at the route's door or (``endpoint``) the endpoint's, whose
        ``caller_scope`` is the scope dependency's value or ``None``: the claim to hand
        ``fence()`` when the request may go on, ``None`` when it was answered instead (a
        replay, a refusal), or :data:`AT_THE_ENDPOINT` from the route's door of a route whose
        claim needs the endpoint's dependencies."""
        ...


#: The exchange of the keyed request being handled, until its key is claimed at the door.
current_entrance: contextvars.ContextVar[Entrance | None] = contextvars.ContextVar(
    "idempotency_mw_current_entrance", default=None
)


class AnsweredInstead(Exception):
    """Raised by ``fence()`` before the endpoint (in a dependency) when the key's claim found
    a replay or a refusal, which the middleware answered: the transaction must roll back."""


async def fence(session: Any, *, store: Store | None = None) -> None:
    """Check, inside ``session``'s transaction, that this request still owns its key, and mark
    the key's effect committed in the same transaction.

    ``session`` is an ``AsyncSession`` or ``AsyncConnection`` in a transaction. On the database
    of the middleware's ``SQLStore`` (or of ``store``) the store's own record is marked; with
    any other store (Redis, ``MemoryStore``, a SQL store elsewhere) a row of the proof table
    (:mod:`idempotency_mw.engine.proofs`) in the session's database is written instead. If another
    request took the key over, :class:`~idempotency_mw.LeaseLost` is raised, and
    :class:`~idempotency_mw.EffectCommitted` (a ``LeaseLost``) if an earlier run committed
    its effect: the transaction must roll back, the effect is never committed twice. Once
    committed, the key never runs again within its TTL, whatever the store forgets. A request
    sent without a key (on a route where the key is optional) has nothing to fence: ``fence``
    then does nothing, and so it does for a request the middleware runs unprotected because
    its store failed (``fail_open=True``).
    """
    entrance = current_entrance.get()
    if current_claim.get() is None and entrance is not None:
        # Before the endpoint's door (in a dependency): the effect begins here.
        current_claim.set(await entrance.enter(None, endpoint=False))
    if current_claim.get() in (UNKEYED, UNPROTECTED):
        return
    claim, target = _claim_and_store(store)
    if not session.in_transaction():
        raise ConfigurationError(
            "fence() must run inside the transaction that commits the effect "
            "(e.g. `async with session.begin(): ... await fence(session)`)"
        )
    connection = await session.connection() if hasattr(session, "get_bind") else session
    if _on_the_store(target, connection.engine.url):
        statement, params = target.fence_statement(claim.scope, claim.key, claim.token, claim.ttl)
        changed = (await connection.execute(statement, params)).rowcount
        if changed == 0:
            statement, params = target.refence_statement(claim)
            changed = (await connection.execute(statement, params)).rowcount
        _check_owned(changed)
    else:
        from idempotency_mw.engine.proofs import write_proof

        _check_proven(
            claim,
            await write_proof(
                connection, claim.scope, claim.key, claim.token, claim.ttl, store=target
            ),
        )
    claim.fenced = True


def fence_sync(session: Any, *, store: Store | None = None) -> None:
    """:func:`fence` for a synchronous ``Session`` or ``Connection`` (a sync endpoint)."""
    entrance = current_entrance.get()
    if current_claim.get() is None and entrance is not None:
        # Before the endpoint's door (in a dependency, in a worker thread): claimed in the loop.
        current_claim.set(
            anyio.from_thread.run(functools.partial(entrance.enter, None, endpoint=False))
        )
    if current_claim.get() in (UNKEYED, UNPROTECTED):
        return
    claim, target = _claim_and_store(store)
    if not session.in_transaction():
        raise ConfigurationError(
            "fence_sync() must run inside the transaction that commits the effect "
            "(e.g. `with session.begin(): ... fence_sync(session)`)"
        )
    connection = session.connection() if hasattr(session, "get_bind") else session
    if _on_the_store(target, connection.engine.url):
        statement, params = target.fence_statement(claim.scope, claim.key, claim.token, claim.ttl)
        changed = connection.execute(statement, params).rowcount
        if changed == 0:
            statement, params = target.refence_statement(claim)
            changed = connection.execute(statement, params).rowcount
        _check_owned(changed)
    else:
        from idempotency_mw.engine.proofs import write_proof_sync

        _check_proven(
            claim,
            write_proof_sync(
                connection, claim.scope, claim.key, claim.token, claim.ttl, store=target
            ),
        )
    claim.fenced = True


def _claim_and_store(store: Store | None) -> tuple[CurrentClaim, Any]:
    claim = current_claim.get()
    if claim == AT_THE_ENDPOINT:
        raise ConfigurationError(
            "fence() on a route whose caller scope comes from a dependency "
            "(@idempotent(scope=...)) must run in the endpoint, not in another dependency"
        )
    if claim is None and current_entrance.get() is not None:
        raise AnsweredInstead("the middleware answered this request with a replay or a refusal")
    if not isinstance(claim, CurrentClaim):
        raise ConfigurationError(
            "fence() is only for a request guarded by IdempotencyMiddleware with a key "
            "(none is being handled here)"
        )
    return claim, claim.store if store is None else store


def _on_the_store(store: Any, url: URL) -> bool:
    """Whether ``url`` is the database of ``store`` (a SQLStore): then its own record is the
    proof (marked, or written again if it is gone); any other store's proof is a row of the
    proof table on the session's database."""
    return hasattr(store, "fence_statement") and _database_of(store.url) == _database_of(url)


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


def _check_proven(claim: CurrentClaim, proven: bool) -> None:
    if not proven:
        claim.committed_earlier = True
        raise EffectCommitted(
            "an earlier run of this Idempotency-Key committed its effect (its proof is in the "
            "application's database): roll back, the effect must not be committed twice"
        )
