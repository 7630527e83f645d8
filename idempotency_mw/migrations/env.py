"""Alembic environment of idempotency-mw's own table (used by ``alembic`` and the CLI).

The database URL is ``sqlalchemy.url`` of the Alembic config (the CLI sets it), else
``IDEMPOTENCY_DATABASE_URL``; async URLs are accepted. The revisions are recorded in a version
table of their own, so this history never collides with the application's own Alembic history.
"""

from __future__ import annotations

import asyncio
import logging
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, inspect
from sqlalchemy.exc import DBAPIError

from idempotency_mw.alembic import PROOF_VERSION_TABLE, VERSION_TABLE
from idempotency_mw.engine.proofs import PROOF_TABLE, proof_metadata
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.migrate import UNRECORDED_TABLE, migration_lock, plain_engine
from idempotency_mw.stores.sql.schema import TABLE_NAME, metadata
from idempotency_mw.values.exceptions import SchemaError

#: The proof table's history is kept in a version table of its own (see ``migrate.py``).
_VERSION_TABLE = context.config.get_main_option("version_table") or VERSION_TABLE
_METADATA = [metadata, proof_metadata]
#: The table this history's first revision creates.
_TABLE = PROOF_TABLE if _VERSION_TABLE == PROOF_VERSION_TABLE else TABLE_NAME


def _not_a_primary_key_name_note(record: logging.LogRecord) -> bool:
    # MariaDB/MySQL note that a primary key's name is ignored (all are named PRIMARY there),
    # which asyncmy logs for every table made here: noise on an operator's console.
    return "ignored for PRIMARY key" not in record.getMessage()


def _url() -> str:
    url = context.config.get_main_option("sqlalchemy.url") or os.environ.get(
        "IDEMPOTENCY_DATABASE_URL"
    )
    if not url:
        raise SystemExit("set IDEMPOTENCY_DATABASE_URL to the database to migrate")
    return url


def _run_offline() -> None:
    context.configure(
        url=async_url(_url()),
        literal_binds=True,
        target_metadata=_METADATA,
        version_table=_VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


def _migrate(connection: Connection) -> None:
    # Several workers may start (and migrate) at once: one at a time, the later ones then
    # find the revision recorded and do nothing.
    with migration_lock(connection):
        context.configure(
            connection=connection, target_metadata=_METADATA, version_table=_VERSION_TABLE
        )
        try:
            with context.begin_transaction():
                context.run_migrations()
        except DBAPIError as exc:
            # Told by the database, not by its message: our table is there, no revision is.
            connection.rollback()
            unrecorded = context.get_context().get_current_revision() is None
            if unrecorded and inspect(connection).has_table(_TABLE):
                raise SchemaError(UNRECORDED_TABLE) from exc
            raise
        connection.commit()


async def _run_online() -> None:
    engine = plain_engine(_url())
    driver_log = logging.getLogger("asyncmy")
    driver_log.addFilter(_not_a_primary_key_name_note)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_migrate)
            await connection.commit()
    finally:
        driver_log.removeFilter(_not_a_primary_key_name_note)
        await engine.dispose()


# The logging of the alembic.ini in use (none when the CLI runs us: it prints its own lines).
if context.config.config_file_name is not None:
    fileConfig(context.config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    _run_offline()
else:
    asyncio.run(_run_online())
