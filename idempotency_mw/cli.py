"""The ``idempotency-mw`` command: database migrations without an Alembic project."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.resources import files

import anyio.to_thread
from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError
from sqlalchemy.exc import DBAPIError

from idempotency_mw.exceptions import ConfigurationError
from idempotency_mw.stores.sql import async_url


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


def one_line(exc: BaseException) -> str:
    """The driver's own error on one line, without SQLAlchemy's SQL and background notes."""
    error = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


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
    args = parser.parse_args(argv)

    try:
        config = alembic_config(args.url)
        if args.command == "migrate":
            command.upgrade(config, args.revision)
        else:
            command.downgrade(config, args.revision)
    except (ConfigurationError, CommandError) as exc:
        print(f"idempotency-mw: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a database error: one line for the shell, not a traceback
        print(f"idempotency-mw: {one_line(exc)}", file=sys.stderr)
        return 1
    print(f"idempotency-mw: {args.command} to {args.revision} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
