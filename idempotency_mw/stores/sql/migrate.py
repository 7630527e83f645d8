"""The idempotency table's migrations, without an Alembic project of your own."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files

import anyio.to_thread
from alembic import command
from alembic.config import Config
from sqlalchemy import Connection
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw.stores.sql.database import async_url, asyncpg_settings
from idempotency_mw.stores.sql.schema import PROOF_VERSION_TABLE
from idempotency_mw.stores.sql.store import SQLStore

#: The advisory lock migrations hold (PostgreSQL's is a number, MariaDB's a name).
_LOCK_ID, _LOCK_NAME = 7_305_944_173_201, "idempotency_mw_migrations"
#: How long MariaDB's GET_LOCK waits, in seconds (it takes no "forever").
_LOCK_WAIT = 600
#: Why an upgrade failed when the table exists but no revision of it is recorded.
UNRECORDED_TABLE = (
    "the table exists, but no revision of it is recorded here: it was made by another Alembic "
    "history or create_all. If your own Alembic project includes our revisions (recipe B), "
    "upgrade there: `alembic upgrade heads`; otherwise (recipe A, create_all) keep that "
    "history, or record ours in it with `alembic stamp idempotency_mw@head`"
)


def plain_engine(url: str | URL) -> AsyncEngine:
    """An engine on ``url`` in the driver's own transactions (the migrations, the proof table),
    the URL's options passed to the driver as :class:`SQLStore` passes them: the URL that
    serves the store migrates it."""
    parsed = async_url(url)
    if parsed.get_driver_name() != "asyncpg":
        return create_async_engine(parsed)
    parsed, connect_args = asyncpg_settings(parsed)
    return create_async_engine(parsed, connect_args=connect_args)


@contextmanager
def migration_lock(connection: Connection) -> Iterator[None]:
    """Hold ``connection``'s database's migration lock while the block runs, so that workers
    started together migrate one after the other (the later ones then find nothing to do).

    The block commits its own work before it ends: PostgreSQL and MariaDB hold an advisory
    lock of the session until then; SQLite holds the database exclusively, which the block's
    commit ends.
    """
    backend = connection.dialect.name
    if backend == "sqlite":
        connection.exec_driver_sql("BEGIN EXCLUSIVE")
        yield
        return
    if backend == "postgresql":
        lock = f"SELECT pg_advisory_lock({_LOCK_ID})"
        unlock = f"SELECT pg_advisory_unlock({_LOCK_ID})"
    else:
        lock = f"SELECT GET_LOCK('{_LOCK_NAME}', {_LOCK_WAIT})"
        unlock = f"SELECT RELEASE_LOCK('{_LOCK_NAME}')"
    if connection.exec_driver_sql(lock).scalar() == 0:  # GET_LOCK timed out (NULL: an error)
        raise TimeoutError(f"another migration held {_LOCK_NAME} for {_LOCK_WAIT} s")
    try:
        yield
    except BaseException:
        # A failed statement aborts PostgreSQL's transaction, where the unlock would fail too
        # and hide the first error: end it first (the session's lock outlives it).
        connection.rollback()
        raise
    finally:
        connection.exec_driver_sql(unlock)
        connection.commit()


def alembic_config(url: str | URL, *, proofs: bool = False) -> Config:
    """An Alembic config for the packaged migrations, pointed at ``url``: the idempotency
    table's, or (``proofs``) the proof table's, each with a version table of its own."""
    config = Config()
    migrations = files("idempotency_mw") / "migrations"
    config.set_main_option("script_location", str(migrations))
    if proofs:
        config.set_main_option("path_separator", "os")
        config.set_main_option("version_locations", str(migrations / "proofs"))
        config.set_main_option("version_table", PROOF_VERSION_TABLE)
    # Config values go through ConfigParser interpolation, where % is special.
    config.set_main_option(
        "sqlalchemy.url", async_url(url).render_as_string(False).replace("%", "%%")
    )
    return config


def upgrade_sync(url: str | URL, revision: str = "head", *, proofs: bool = False) -> None:
    """Create or update the idempotency table in ``url``'s database, or (``proofs``) the
    proof table ``fence()`` writes when the store is on another database."""
    command.upgrade(alembic_config(url, proofs=proofs), revision)


async def upgrade(url: str | URL, revision: str = "head", *, proofs: bool = False) -> None:
    """:func:`upgrade_sync` from async code (Alembic runs its own event loop in a thread)."""
    await anyio.to_thread.run_sync(functools.partial(upgrade_sync, url, revision, proofs=proofs))


async def check(url: str | URL) -> None:
    """What :meth:`SQLStore.startup` checks, on its own: raise
    :class:`~idempotency_mw.values.exceptions.SchemaError` unless ``url``'s database has the
    table as this version expects (:class:`~idempotency_mw.values.exceptions.StoreError` if it
    cannot tell)."""
    store = SQLStore(url)
    try:
        await store.startup()
    finally:
        await store.aclose()
