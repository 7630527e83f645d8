"""The proof table: a key's effect committed, recorded in the application's own database.

When the store is not on the application's database (Redis, a ``MemoryStore``, a SQL store
elsewhere), ``fence()`` writes one row here in the application's transaction: (scope, key,
token, expiry). A second run of the key, whatever its store forgot, finds the row of another
token and cannot commit. Rows live for the key's TTL; the purge (:class:`ProofTable`) deletes
the others.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    bindparam,
    case,
    select,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.expression import Executable

from idempotency_mw._sqltypes import ExactString
from idempotency_mw._urls import shown_url
from idempotency_mw.stores.sql.schema import metadata, stored_name
from idempotency_mw.stores.sql.statements import NOW, purges_of
from idempotency_mw.values.exceptions import ConfigurationError, describe
from idempotency_mw.values.metrics import key_hash

PROOF_TABLE = "idempotency_proofs"
#: The Alembic branch of the proof table (its versions: ``idempotency_mw:migrations/proofs``).
PROOF_BRANCH = "idempotency_mw_proofs"

#: The proof table alone, for ``metadata.create_all`` or an Alembic ``target_metadata``.
proof_metadata = MetaData(naming_convention=metadata.naming_convention)
proofs = Table(
    PROOF_TABLE,
    proof_metadata,
    Column("scope", ExactString, nullable=False),
    Column("key", ExactString, nullable=False),
    Column("token", String(32), nullable=False),
    # Milliseconds since the Unix epoch, on the database's clock.
    Column("expires_at", BigInteger, nullable=False),
    PrimaryKeyConstraint("scope", "key"),
    Index(None, "expires_at"),
)

_EXPIRED = proofs.c.expires_at <= NOW
_MINE_OR_FREE = (proofs.c.token == bindparam("p_token")) | _EXPIRED
_NEW = {
    "scope": bindparam("p_scope"),
    "key": bindparam("p_key"),
    "token": bindparam("p_token"),
    "expires_at": NOW + bindparam("p_ttl_ms", type_=BigInteger),
}


def _upsert(dialect: Any) -> Executable:
    """INSERT the proof, or take over an expired one (or this token's own): RETURNING a row
    unless another token's live proof is there."""
    insert = dialect.insert(proofs).values(_NEW)
    upsert: Executable = insert.on_conflict_do_update(
        index_elements=[proofs.c.scope, proofs.c.key],
        set_={"token": insert.excluded.token, "expires_at": insert.excluded.expires_at},
        where=_MINE_OR_FREE,
    ).returning(proofs.c.token)
    return upsert


def _upsert_mysql() -> Executable:
    # MariaDB/MySQL have no conditional upsert with RETURNING: a row that is not ours keeps
    # its values, and the token read back in the same transaction says whose it is. The token
    # is set first: the expiry's condition then reads the new token, the old expiry.
    insert = mysql.insert(proofs).values(_NEW)
    free = _MINE_OR_FREE
    return insert.on_duplicate_key_update(
        [
            ("token", case((free, insert.inserted.token), else_=proofs.c.token)),
            ("expires_at", case((free, insert.inserted.expires_at), else_=proofs.c.expires_at)),
        ]
    )


_UPSERTS: dict[str, Executable] = {
    "postgresql": _upsert(postgresql),
    "sqlite": _upsert(sqlite),
    "mysql": _upsert_mysql(),
    "mariadb": _upsert_mysql(),
}
_TOKEN = select(proofs.c.token).where(
    proofs.c.scope == bindparam("p_scope"), proofs.c.key == bindparam("p_key")
)


async def write_proof(
    connection: Any, scope: str, key: str, token: str, ttl: float, *, store: object
) -> bool:
    """Record, in ``connection``'s transaction (an ``AsyncConnection``), that ``token``'s run of
    the key committed its effect: whether it may (no other run's live proof is there).
    ``store``: the request's store, named in the error when the table is missing."""
    params = _params(scope, key, token, ttl)
    try:
        for statement in _statements(connection):
            result = await connection.execute(statement, params)
        rows = result.all()
    except DBAPIError as exc:
        # Not chained: SQLAlchemy's error shows the statement's parameters, the key among them.
        raise _missing_table(connection.engine.url, store, scope, key, exc) from None
    return [row[0] for row in rows] == [token]


def write_proof_sync(
    connection: Any, scope: str, key: str, token: str, ttl: float, *, store: object
) -> bool:
    """:func:`write_proof` on a synchronous ``Connection``."""
    params = _params(scope, key, token, ttl)
    try:
        for statement in _statements(connection):
            result = connection.execute(statement, params)
        rows = result.all()
    except DBAPIError as exc:
        # Not chained: SQLAlchemy's error shows the statement's parameters, the key among them.
        raise _missing_table(connection.engine.url, store, scope, key, exc) from None
    return [row[0] for row in rows] == [token]


def _statements(connection: Any) -> list[Executable]:
    backend = connection.engine.url.get_backend_name()
    if backend in ("mysql", "mariadb"):
        return [_UPSERTS[backend], _TOKEN]
    return [_UPSERTS[backend]]


def _params(scope: str, key: str, token: str, ttl: float) -> dict[str, Any]:
    return {
        "p_scope": stored_name(scope),
        "p_key": stored_name(key),
        "p_token": token,
        "p_ttl_ms": int(ttl * 1000),
    }


def _missing_table(
    url: Any, store: object, scope: str, key: str, exc: DBAPIError
) -> ConfigurationError:
    return ConfigurationError(
        f"fence() of key {key_hash(scope, key)} records its proof in the table {PROOF_TABLE!r} "
        f"of the session's database ({shown_url(url)}), since the store ({store!r}) is not "
        f"known to be on that database (a SQLStore whose URL names the same host, port and "
        f"database is), and could not write it ({describe(exc)}): create it with "
        f"`idempotency-mw migrate --proofs --store <that url>`, with "
        "`idempotency_mw.engine.proofs.proof_metadata.create_all`, or in your own Alembic project "
        "(the docs' Migrations page)"
    )


_PURGES = purges_of(proofs, _EXPIRED)


class ProofTable:
    """The proof table of ``engine``'s database, to purge like a store: ``purge(ProofTable(
    engine))`` once, or ``background_purge(ProofTable(engine))`` in the app's lifespan. The
    engine is the caller's, never disposed here."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._purge = _PURGES[engine.url.get_backend_name()]

    async def purge_expired(self, *, batch_size: int) -> int:
        """Delete at most ``batch_size`` expired proofs in one short transaction: how many."""
        async with self.engine.begin() as connection:
            result = await connection.execute(self._purge, {"p_batch_size": batch_size})
        return int(result.rowcount)
