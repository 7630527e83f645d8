"""Where a client journals its operations: a SQLite file, a SQL database, or Redis."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from idempotency_mw.client.journals.base import NOTE_HEADER, Journal, needing_attention, resolve
from idempotency_mw.client.journals.sql import SQLJournal, journal_table, sync_url
from idempotency_mw.client.journals.sqlite import DEFAULT_JOURNAL_PATH, SQLiteJournal

__all__ = [
    "DEFAULT_JOURNAL_PATH",
    "NOTE_HEADER",
    "Journal",
    "RedisJournal",
    "SQLJournal",
    "SQLiteJournal",
    "journal_table",
    "needing_attention",
    "open_journal",
    "resolve",
    "sync_url",
]

if TYPE_CHECKING:
    from idempotency_mw.client.journals.redis import RedisJournal

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def __getattr__(name: str) -> Any:
    # RedisJournal needs redis-py (the [redis] extra): imported only when asked for.
    if name == "RedisJournal":
        from idempotency_mw.client.journals.redis import RedisJournal

        return RedisJournal
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_journal(where: str | os.PathLike[str]) -> Journal:
    """The journal at ``where``: a ``redis://`` URL, a database URL, or a SQLite file's path."""
    target = os.fspath(where)
    if target.startswith(_REDIS_SCHEMES):
        from idempotency_mw.client.journals.redis import RedisJournal

        return RedisJournal(target)
    if "://" in target:
        return SQLJournal(target)
    return SQLiteJournal(target)
