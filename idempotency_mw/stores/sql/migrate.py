"""The idempotency table's migrations, without an Alembic project of your own."""

from __future__ import annotations

import functools
from importlib.resources import files

import anyio.to_thread
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import URL

from idempotency_mw.alembic import PROOF_VERSION_TABLE
from idempotency_mw.stores.sql.drivers import async_url
from idempotency_mw.stores.sql.store import SQLStore


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
    :class:`~idempotency_mw.exceptions.SchemaError` unless ``url``'s database has the table as
    this version expects (:class:`~idempotency_mw.exceptions.StoreError` if it cannot tell)."""
    store = SQLStore(url)
    try:
        await store.startup()
    finally:
        await store.aclose()
