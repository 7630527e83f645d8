"""Databases of a test's own on the shared servers, made empty and dropped afterwards."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress

from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.stores.sql import async_url


def run_on_server(url: str, *statements: str) -> None:
    """Run statements outside a transaction (CREATE/DROP DATABASE) on ``url``'s server."""

    async def go() -> None:
        engine = create_async_engine(async_url(url), isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                for statement in statements:
                    await conn.execute(text(statement))
        finally:
            await engine.dispose()

    asyncio.run(go())


@contextmanager
def scratch_database(url: str, purpose: str) -> Iterator[str]:
    """The URL of an empty database ``<database>_<purpose>_<pid>`` on ``url``'s server.

    The shared database cannot serve tests that create or drop tables in it: other tests
    (possibly run by another process at the same time) use its idempotency table.
    """
    parsed = make_url(url)
    name = f"{parsed.database}_{purpose}_{os.getpid()}"
    drop = f"DROP DATABASE IF EXISTS {name}"
    if parsed.get_backend_name() == "postgresql":
        drop += " WITH (FORCE)"  # no connection of a failed run may keep it alive
    run_on_server(url, drop, f"CREATE DATABASE {name}")
    try:
        yield parsed.set(database=name).render_as_string(hide_password=False)
    finally:
        run_on_server(url, drop)


def run_database_url(url: str, run_id: str) -> str:
    """The URL of the run's own database on ``url``'s server."""
    parsed = make_url(url)
    return parsed.set(database=f"idem_run_{run_id}").render_as_string(hide_password=False)


def _drop_statement(url: str, name: str) -> str:
    drop = f"DROP DATABASE IF EXISTS {name}"
    if make_url(url).get_backend_name() == "postgresql":
        drop += " WITH (FORCE)"  # no connection of a failed run may keep it alive
    return drop


def create_run_databases(urls: Iterable[str], run_id: str) -> dict[str, str]:
    """Make the run's own database on each server; what could not be made, by its run URL.

    A server that does not answer, or whose URL names a database it lacks, is reported here and
    its tests skip (or, in CI, fail) with the message, rather than error on their first query.
    """
    name = f"idem_run_{run_id}"
    problems: dict[str, str] = {}
    for url in urls:
        try:
            run_on_server(url, _drop_statement(url, name), f"CREATE DATABASE {name}")
        except Exception as exc:  # any driver's error: the message says what it was
            shown = make_url(url).render_as_string(hide_password=True)
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            problems[run_database_url(url, run_id)] = (
                f"could not make the run's database on {shown}: {first_line}"
            )
    return problems


def drop_run_databases(urls: Iterable[str], run_id: str) -> None:
    """Drop the run's own databases."""
    name = f"idem_run_{run_id}"
    for url in urls:
        with suppress(Exception):
            run_on_server(url, _drop_statement(url, name))
