"""SQLiteJournal: the default journal, a local SQLite file in the same table as SQLJournal."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from sqlalchemy import event
from sqlalchemy.pool import StaticPool

from idempotency_mw.client.journals.sql import SQLJournal, journal_engine

#: Where a client keeps its journal unless told otherwise (relative to the working directory).
DEFAULT_JOURNAL_PATH = "idempotency-journal.sqlite3"
_MEMORY = ":memory:"


class SQLiteJournal(SQLJournal):
    """A :class:`Journal` in a SQLite file (``":memory:"`` for one that does not persist).

    The table is :class:`SQLJournal`'s. WAL and a busy timeout let processes share the file;
    Python's own ``sqlite3`` is the only driver it needs.
    """

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_JOURNAL_PATH) -> None:
        where = os.fspath(path)
        memory = where == _MEMORY
        options: dict[str, Any] = {"connect_args": {"timeout": 10.0, "check_same_thread": False}}
        if memory:  # one connection, or each would see a database of its own
            options["poolclass"] = StaticPool
        engine = journal_engine(f"sqlite:///{where}", **options)
        event.listen(engine, "connect", _use_wal)
        self._setup(engine, owns_engine=True, serialized=memory)
        self.path = where


def _use_wal(connection: sqlite3.Connection, record: object) -> None:
    connection.execute("PRAGMA journal_mode=WAL")
