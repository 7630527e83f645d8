"""SQLJournal: the client's journal as a table in a SQL database (SQLite, PostgreSQL,
MariaDB/MySQL), through a sync SQLAlchemy engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from sqlalchemy import (
    URL,
    Boolean,
    Column,
    Connection,
    Double,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    create_engine,
    insert,
    inspect,
    make_url,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from idempotency_mw._sqltypes import ExactString, LongBinary
from idempotency_mw._urls import shown_url
from idempotency_mw.client._closing import ClosedOnExit
from idempotency_mw.client.journals.base import FIELDS, MUTABLE, from_row, to_row
from idempotency_mw.client.values import JournalEntry, OperationState
from idempotency_mw.values.exceptions import ConfigurationError, SchemaError, install_extra

# The client's journal table: the caller's, created on first use.
journal_metadata = MetaData()
journal_table = Table(
    "idempotency_client_journal",
    journal_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", ExactString, nullable=False, unique=True),
    Column("name", ExactString, nullable=False),
    Column("ref", ExactString, nullable=True),
    Column("state", String(24), nullable=False),
    Column("keyless", Boolean, nullable=False),
    Column("method", ExactString, nullable=True),
    Column("url", Text, nullable=True),
    Column("headers", Text, nullable=False),
    Column("body", LongBinary, nullable=False),
    Column("status", Integer, nullable=True),
    # Times are Unix seconds from the callers' clocks.
    Column("first_sent_at", Double, nullable=True),
    Column("response_headers", Text, nullable=False),
    Column("response_body", LongBinary, nullable=True),
    Column("holder", String(64), nullable=True),
    Column("lease_expires_at", Double, nullable=True),
    Column("created_at", Double, nullable=False),
    Column("updated_at", Double, nullable=False),
    UniqueConstraint("name", "ref"),
)
_SELECT = select(*(journal_table.c[name] for name in FIELDS))
_SETTLED = tuple(state.value for state in OperationState if state.settled)

#: The sync driver used for each backend when a URL names none, or an async one, and the
#: extra that installs it.
SYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}
_DRIVER_EXTRAS = {"postgresql": "client-postgresql", "mysql": "client-mysql"}
_ASYNC_ONLY_DRIVERS = {"aiosqlite", "asyncpg", "asyncmy", "aiomysql"}


def sync_url(url: str | URL) -> URL:
    """``url`` with a sync driver: ``postgresql://`` becomes ``postgresql+psycopg://``,
    ``mysql://`` ``mysql+pymysql://``, ``sqlite+aiosqlite://`` ``sqlite://``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {shown_url(url)!r}") from exc
    backend = parsed.get_backend_name()
    if backend != "sqlite" and backend not in SYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() not in _ASYNC_ONLY_DRIVERS:
        return parsed
    driver = SYNC_DRIVERS.get(backend)
    return parsed.set(drivername=f"{backend}+{driver}" if driver else backend)


def journal_engine(url: str | URL, **options: Any) -> Engine:
    """A sync engine on ``url`` (see :func:`sync_url`); a missing driver names its extra."""
    parsed = sync_url(url)
    try:
        return create_engine(parsed, **options)
    except ImportError as exc:
        backend = parsed.get_backend_name()
        extra = _DRIVER_EXTRAS.get(backend, "client-mysql")
        raise ConfigurationError(
            f"a {backend} journal needs the driver {parsed.get_driver_name()}: "
            f"{install_extra(extra)}"
        ) from exc


class SQLJournal(ClosedOnExit):
    """A :class:`Journal` in the table ``idempotency_client_journal`` of a SQL database
    (SQLite, PostgreSQL, MariaDB/MySQL), e.g. the server store's.

    Give a URL (the journal makes a sync engine, see :func:`sync_url`, and disposes of it in
    :meth:`close`) or a sync ``Engine`` (never disposed of). The table is created on first use;
    names and refs are at most 255 characters. Leases expire by the callers' wall clocks, which
    must agree to well within a lease (as NTP keeps them).
    """

    def __init__(self, url_or_engine: str | URL | Engine) -> None:
        if isinstance(url_or_engine, Engine):
            self._setup(url_or_engine, owns_engine=False, serialized=False)
        else:
            self._setup(journal_engine(url_or_engine), owns_engine=True, serialized=False)

    def _setup(self, engine: Engine, *, owns_engine: bool, serialized: bool) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        # One connection shared by threads (an in-memory SQLite) takes one statement at a time.
        self._serial: AbstractContextManager[Any] = (
            threading.Lock() if serialized else nullcontext()
        )
        self._lock = threading.Lock()
        self._created = False

    @property
    def engine(self) -> Engine:
        """The engine the journal runs on."""
        return self._engine

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation, or return the one with the same name and ref."""
        with contextlib.suppress(IntegrityError), self._begin() as conn:
            conn.execute(insert(journal_table).values(self._values(entry)))
        c = journal_table.c
        if entry.ref is None:
            where = c.key == entry.key
        else:
            where = and_(c.name == entry.name, c.ref == entry.ref)
        with self._connect() as conn:
            return from_row(conn.execute(_SELECT.where(where)).one())

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        values = self._values(entry)
        changes = {name: values[name] for name in (*MUTABLE, "updated_at")}
        with self._begin() as conn:
            found = conn.execute(
                update(journal_table).where(journal_table.c.key == entry.key).values(changes)
            )
            if found.rowcount == 0:
                conn.execute(insert(journal_table).values(values))

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        with self._connect() as conn:
            row = conn.execute(_SELECT.where(journal_table.c.key == key)).first()
        return None if row is None else from_row(row)

    def unsettled(self) -> list[JournalEntry]:
        """Entries neither confirmed nor failed, oldest first."""
        c = journal_table.c
        query = _SELECT.where(c.state.not_in(_SETTLED)).order_by(c.id)
        with self._connect() as conn:
            return [from_row(row) for row in conn.execute(query)]

    def acquire(self, key: str, holder: str, seconds: float) -> bool:
        """Take or renew the lease on ``key``; ``False`` while another holder's is live."""
        c = journal_table.c
        now = time.time()
        free = or_(c.holder.is_(None), c.holder == holder, c.lease_expires_at < now)
        with self._begin() as conn:
            taken = conn.execute(
                update(journal_table)
                .where(c.key == key, free)
                .values(holder=holder, lease_expires_at=now + seconds)
            )
        return taken.rowcount == 1

    def release(self, key: str, holder: str) -> None:
        """End ``holder``'s lease on ``key``, if it still holds it."""
        c = journal_table.c
        with self._begin() as conn:
            conn.execute(
                update(journal_table)
                .where(c.key == key, c.holder == holder)
                .values(holder=None, lease_expires_at=None)
            )

    def close(self) -> None:
        """Dispose of the engine, if the journal made it."""
        if self._owns_engine:
            self._engine.dispose()

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        self._create()
        with self._serial, self._engine.begin() as conn:
            yield conn

    @contextmanager
    def _connect(self) -> Iterator[Connection]:
        self._create()
        with self._serial, self._engine.connect() as conn:
            yield conn

    def _create(self) -> None:
        with self._lock:
            if self._created:
                return
            try:
                journal_metadata.create_all(self._engine)
            except SQLAlchemyError:  # another process created it since create_all checked
                if not inspect(self._engine).has_table(journal_table.name):
                    raise
            found = {
                column["name"] for column in inspect(self._engine).get_columns(journal_table.name)
            }
            missing = [column.name for column in journal_table.columns if column.name not in found]
            if missing:
                raise SchemaError(
                    f"the journal table {journal_table.name} lacks the columns {missing}: it was"
                    " made by an older version; drop it once its operations are settled"
                )
            self._created = True

    @staticmethod
    def _values(entry: JournalEntry) -> dict[str, Any]:
        now = time.time()
        return {
            **dict(zip(FIELDS, to_row(entry), strict=True)),
            "created_at": now,
            "updated_at": now,
        }
