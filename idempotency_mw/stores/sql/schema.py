"""The idempotency table, in portable SQLAlchemy Core types."""

from __future__ import annotations

import hashlib

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    inspect,
)

from idempotency_mw._sqltypes import ExactString, LongBinary
from idempotency_mw.values.exceptions import SchemaError

#: Where ``idempotency-mw migrate`` records its revision (kept apart from ``alembic_version``).
VERSION_TABLE = "idempotency_mw_alembic_version"
#: Where ``idempotency-mw migrate --proofs`` records the proof table's revision.
PROOF_VERSION_TABLE = "idempotency_mw_proofs_alembic_version"
TABLE_NAME = "idempotency_records"
#: The Alembic revision that creates the table as this module describes it.
SCHEMA_REVISION = "0001_idempotency_records"

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

records = Table(
    TABLE_NAME,
    metadata,
    Column("scope", ExactString, nullable=False),
    Column("key", ExactString, nullable=False),
    Column("request_hash", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("token", String(32), nullable=False),
    # Times are milliseconds since the Unix epoch, read from the database's clock.
    Column("created_at", BigInteger, nullable=False),
    Column("lease_expires_at", BigInteger, nullable=False),
    Column("expires_at", BigInteger, nullable=False),
    Column("response_status", Integer, nullable=True),
    Column("response_headers", LongBinary, nullable=True),
    Column("result_payload", LongBinary, nullable=True),
    # A digest of the credentials the record is bound to ('' for none).
    Column("caller_binding", String(64), nullable=False),
    # When a fenced commit marked the handler's effect as done (NULL: not marked).
    Column("committed_at", BigInteger, nullable=True),
    PrimaryKeyConstraint("scope", "key"),
    Index(None, "expires_at"),
)

MIGRATE_HINT = (
    "run `idempotency-mw migrate --store <database url>` (no Alembic project of your own); in your "
    "own Alembic project, either add `idempotency_mw.alembic.metadata` to target_metadata and run "
    "`alembic revision --autogenerate` then `alembic upgrade head` (recipe A, your metadata), or "
    "add `idempotency_mw:migrations/versions` to version_locations and run "
    "`alembic upgrade heads` (recipe B, our branch)"
)


def check_schema(conn: Connection) -> None:
    """Raise :class:`SchemaError` unless the table exists with every column of this version."""
    inspector = inspect(conn)
    if not inspector.has_table(TABLE_NAME):
        raise SchemaError(f"the table {TABLE_NAME!r} does not exist: {MIGRATE_HINT}")
    present = {column["name"] for column in inspector.get_columns(TABLE_NAME)}
    missing = sorted(set(records.c.keys()) - present)
    if missing:
        raise SchemaError(
            f"the table {TABLE_NAME!r} lacks columns {missing}, it is out of date: {MIGRATE_HINT}"
        )


_DIGEST = "sha256:"


def stored_name(name: str) -> str:
    """``name`` as the table stores it: verbatim, or as its digest when it may not be.

    A name that does not fit the column, or ends with a space (MariaDB/MySQL collations ignore
    trailing spaces, so 'k' and 'k ' would be one record), or looks like a digest, is stored
    as its own digest: no two names ever share a record.
    """
    if len(name) <= 255 and not name.endswith(" ") and not name.startswith(_DIGEST):
        return name
    return _DIGEST + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
