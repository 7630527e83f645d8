"""The ``idempotency-mw`` command: migrations without an Alembic project, and the purge."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from alembic import command
from alembic.util.exc import CommandError

from idempotency_mw.cleanup import DEFAULT_BATCH_SIZE, purge
from idempotency_mw.exceptions import ConfigurationError, StoreError, describe
from idempotency_mw.stores.base import Store
from idempotency_mw.stores.sql.migrate import alembic_config, upgrade, upgrade_sync

__all__ = ["alembic_config", "main", "upgrade", "upgrade_sync"]


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
    args = parser.parse_args(argv)

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
    import idempotency_mw  # the stores import their drivers on first use

    redis = url.startswith(("redis:", "rediss:"))
    store: Store = idempotency_mw.RedisStore(url) if redis else idempotency_mw.SQLStore(url)
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


if __name__ == "__main__":
    sys.exit(main())
