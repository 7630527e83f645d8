"""The ``idempotency-mw`` command: migrations without an Alembic project, and the purge."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import anyio.to_thread
from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError

from idempotency_mw.cleanup import DEFAULT_BATCH_SIZE, purge
from idempotency_mw.exceptions import ConfigurationError, StoreError, describe
from idempotency_mw.stores.base import Store
from idempotency_mw.stores.redis import RedisStore
from idempotency_mw.stores.sql import SQLStore, async_url


def alembic_config(url: str) -> Config:
    """An Alembic config for the packaged migrations, pointed at ``url``."""
    config = Config()
    config.set_main_option("script_location", str(files("idempotency_mw") / "migrations"))
    # Config values go through ConfigParser interpolation, where % is special.
    config.set_main_option(
        "sqlalchemy.url", async_url(url).render_as_string(False).replace("%", "%%")
    )
    return config


def upgrade_sync(url: str, revision: str = "head") -> None:
    """Create or update the idempotency table in ``url``'s database."""
    command.upgrade(alembic_config(url), revision)


async def upgrade(url: str, revision: str = "head") -> None:
    """:func:`upgrade_sync` from async code (Alembic runs its own event loop in a thread)."""
    await anyio.to_thread.run_sync(upgrade_sync, url, revision)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idempotency-mw`` command."""
    parser = argparse.ArgumentParser(
        prog="idempotency-mw", description="Manage the idempotency-mw table."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    migrate = commands.add_parser("migrate", help="create or upgrade the table (alembic upgrade)")
    migrate.add_argument("--url", required=True, help="database URL, e.g. sqlite:///./app.db")
    migrate.add_argument("--revision", default="head", help="target revision (default: head)")
    downgrade = commands.add_parser("downgrade", help="downgrade the table (base removes it)")
    downgrade.add_argument("--url", required=True, help="database URL")
    downgrade.add_argument("--revision", default="base", help="target revision (default: base)")
    purge_parser = commands.add_parser("purge", help="delete expired records now")
    purge_parser.add_argument("--url", required=True, help="database or redis:// URL")
    purge_parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="rows per transaction"
    )
    _add_journal_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "journal":
        return _journal_attention(args.journal)

    try:
        if args.command == "purge":
            print(f"idempotency-mw: {asyncio.run(_purge(args.url, args.batch_size))}")
            return 0
        config = alembic_config(args.url)
        if args.command == "migrate":
            command.upgrade(config, args.revision)
        else:
            command.downgrade(config, args.revision)
    except (ConfigurationError, CommandError) as exc:
        print(f"idempotency-mw: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a database error: one line for the shell, not a traceback
        cause = exc.__cause__ if isinstance(exc, StoreError) and exc.__cause__ else exc
        print(f"idempotency-mw: {describe(cause)}", file=sys.stderr)
        return 1
    print(f"idempotency-mw: {args.command} to {args.revision} done")
    return 0


async def _purge(url: str, batch_size: int) -> str:
    store: Store = RedisStore(url) if url.startswith(("redis:", "rediss:")) else SQLStore(url)
    try:
        report = await purge(store, batch_size=batch_size)
    finally:
        await store.aclose()
    if report.self_expiring:
        return "Redis expires records by itself (TTL): nothing to purge"
    return (
        f"purged {report.deleted} expired records in {report.seconds:.3f} s "
        f"({report.batches} batches of at most {batch_size})"
    )


# --- The caller's journal (logic in idempotency_mw.client, imported only when asked for) -----


def _add_journal_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    journal = commands.add_parser("journal", help="inspect a client journal")
    actions = journal.add_subparsers(dest="action", required=True)
    attention = actions.add_parser(
        "attention", help="list operations that need a person (confirmation or intervention)"
    )
    attention.add_argument(
        "--journal", required=True, help="SQLite journal path, database URL or redis:// URL"
    )


def _journal_attention(where: str) -> int:
    from idempotency_mw.client.attention import attention_rows, format_rows
    from idempotency_mw.client.journals import open_journal

    if "://" not in where and not Path(where).is_file():
        print(f"idempotency-mw: no journal file at {where}", file=sys.stderr)
        return 2
    try:
        journal = open_journal(where)
        try:
            rows = attention_rows(journal)
        finally:
            journal.close()
    except ConfigurationError as exc:
        print(f"idempotency-mw: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the journal's database or Redis failed: one line
        print(f"idempotency-mw: {describe(exc)}", file=sys.stderr)
        return 1
    print(format_rows(rows) if rows else "idempotency-mw: no operation needs attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())
