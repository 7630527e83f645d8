"""The caller's half: httpx clients that send each operation under one ``Idempotency-Key``.

An operation gets its key when it is decided (:meth:`IdempotentClient.operation`); every
attempt, retry, restart and :meth:`~IdempotentClient.reconcile` re-sends it with that same key,
so the server runs it at most once. Operations and their states are journaled (a local SQLite
file by default; :class:`SQLJournal` and :class:`RedisJournal` keep them in the server store's
database or Redis) so that a caller that crashes can resume them after a restart.

Outcomes: a response below 400 is returned (journal: ``confirmed``); any other 4xx is returned
too, as httpx does, and the operation is ``failed``; timeouts, connection errors, 408, 425,
429, 5xx and 409 "in progress" are retried with the same key until ``max_attempts`` or the
deadline, then :class:`OutcomeUnknown` is raised (journal: ``unknown``). A mismatch problem
raises :class:`IdempotencyKeyMismatch`; a "not replayable" problem raises
:class:`ResponseNotReplayable`.

The retry protocol is written once, as a generator that yields the I/O it needs (send, sleep,
journal write); :class:`IdempotentClient` and :class:`SyncIdempotentClient` only perform it.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import itertools
import json as jsonlib
import logging
import math
import os
import random
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import (
    Any,
    Protocol,
    Self,
    TypeAlias,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    runtime_checkable,
)

import anyio
import anyio.to_thread
import httpx
import redis
from sqlalchemy import (
    URL,
    Column,
    Engine,
    Float,
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
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from idempotency_mw.exceptions import ConfigurationError, IdempotencyError
from idempotency_mw.stores.redis import binary_client
from idempotency_mw.stores.sql.schema import ExactString, LongBinary

logger = logging.getLogger("idempotency_mw.client")

T = TypeVar("T")

#: Where a client keeps its journal unless told otherwise (relative to the working directory).
DEFAULT_JOURNAL_PATH = "idempotency-journal.sqlite3"
MAX_KEY_LENGTH = 255
_KEY_PART = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


# --- Values ---------------------------------------------------------------------------------


class OperationState(enum.StrEnum):
    """Where an operation stands, as journaled.

    ``pending`` → ``sent`` → ``confirmed`` | ``failed`` | ``unknown``; ``unknown`` (an attempt's
    outcome was lost) ends as ``confirmed`` or ``failed`` once a retry or ``reconcile()`` gets
    the server's answer.
    """

    PENDING = "pending"
    SENT = "sent"
    CONFIRMED = "confirmed"
    UNKNOWN = "unknown"
    FAILED = "failed"

    @property
    def settled(self) -> bool:
        """Whether the server's answer is known (re-sending would change nothing)."""
        return self in (OperationState.CONFIRMED, OperationState.FAILED)


@dataclass(frozen=True, slots=True)
class Operation:
    """One logical operation: its name, the caller's optional reference, and its key."""

    key: str
    name: str
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """An operation as journaled: its key, state, last HTTP status and the request to re-send.

    ``method`` and ``url`` are ``None`` until the operation is first sent.
    """

    key: str
    name: str
    ref: str | None
    state: OperationState
    method: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    status: int | None = None

    @property
    def operation(self) -> Operation:
        """The operation this entry is about."""
        return Operation(self.key, self.name, self.ref)


class RequestParts(TypedDict, total=False):
    """What an operation sends besides method and URL (the body must not be a stream)."""

    params: Mapping[str, str | int | float | bool | None]
    headers: Mapping[str, str] | Sequence[tuple[str, str]]
    content: str | bytes
    data: Mapping[str, Any]
    json: Any


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How one operation is retried.

    Waits are "full jitter": uniform in ``[0, min(backoff_cap, backoff_base * 2**(n-1))]``
    after the n-th attempt, unless the response says ``Retry-After: <seconds>``. ``deadline``
    bounds the whole operation (seconds): no wait or attempt timeout reaches past it, and a
    ``Retry-After`` that does ends the operation with :class:`OutcomeUnknown` at once.
    """

    max_attempts: int = 6
    backoff_base: float = 0.25
    backoff_cap: float = 10.0
    deadline: float = 60.0
    connect_timeout: float = 5.0
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        for name in ("backoff_base", "backoff_cap"):
            if not getattr(self, name) >= 0:
                raise ConfigurationError(f"{name} must not be negative")
        for name in ("deadline", "connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name} must be positive")

    def backoff(self, attempt: int, rng: random.Random, *, limit: float = math.inf) -> float:
        """The wait after the ``attempt``-th attempt (1-based), at most ``limit``."""
        ceiling = min(self.backoff_cap, self.backoff_base * 2.0 ** min(attempt - 1, 64), limit)
        return rng.uniform(0.0, max(ceiling, 0.0))

    def timeout(self, remaining: float) -> httpx.Timeout:
        """The timeouts of one attempt, none longer than the ``remaining`` time."""
        connect = min(self.connect_timeout, remaining)
        read = min(self.read_timeout, remaining)
        return httpx.Timeout(connect=connect, read=read, write=read, pool=connect)


# --- Errors ---------------------------------------------------------------------------------


class OperationError(IdempotencyError):
    """An operation did not end with a response; ``key`` is its Idempotency-Key."""

    def __init__(self, message: str, key: str, response: httpx.Response | None = None) -> None:
        super().__init__(f"{message} (Idempotency-Key {key!r})")
        self.key = key
        self.response = response


class IdempotencyKeyMismatch(OperationError):
    """The key was already used with a different request: a bug in the caller.

    Raised on 409/422 with a problem ``type`` ending in ``mismatch``; the journal marks the
    operation ``failed``.
    """


class ResponseNotReplayable(OperationError):
    """The server ran the operation but cannot replay its response (it was too large).

    The journal marks the operation ``confirmed``: it took effect; only its response is lost.
    """


class OutcomeUnknown(OperationError):
    """Attempts or time ran out before the server's answer was known.

    The operation may or may not have taken effect; the journal keeps it ``unknown`` so that
    ``reconcile()`` (or sending the same :class:`Operation` again) settles it with the same key.
    The last exception, if the last attempt raised one, is the ``__cause__``.
    """

    def __init__(
        self, key: str, attempts: int, last: httpx.Response | Exception | None = None
    ) -> None:
        if isinstance(last, httpx.Response):
            what = f"HTTP {last.status_code}"
        elif last is not None:
            what = type(last).__name__
        else:
            what = "nothing"
        response = last if isinstance(last, httpx.Response) else None
        super().__init__(
            f"outcome unknown after {attempts} attempt(s), last: {what}", key, response
        )
        self.attempts = attempts


# --- Classification -------------------------------------------------------------------------


class Verdict(enum.Enum):
    """What one attempt's outcome means for the operation."""

    SUCCEEDED = "succeeded"  # < 400: return the response; confirmed
    REJECTED = "rejected"  # other 4xx: return the response; failed
    RETRY = "retry"  # outcome unknown: retry with the same key; unknown
    MISMATCH = "mismatch"  # raise IdempotencyKeyMismatch; failed
    NOT_REPLAYABLE = "not-replayable"  # raise ResponseNotReplayable; confirmed
    UNSENDABLE = "unsendable"  # the request cannot be sent as built: re-raise; failed
    RAISE = "raise"  # any other exception: re-raise; the journal is left as it is


_RETRYABLE_ERRORS = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
    httpx.ProxyError,
)
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
_STATE_AFTER = {
    Verdict.SUCCEEDED: OperationState.CONFIRMED,
    Verdict.REJECTED: OperationState.FAILED,
    Verdict.RETRY: OperationState.UNKNOWN,
    Verdict.MISMATCH: OperationState.FAILED,
    Verdict.NOT_REPLAYABLE: OperationState.CONFIRMED,
    Verdict.UNSENDABLE: OperationState.FAILED,
}


def classify(outcome: httpx.Response | Exception) -> Verdict:
    """The verdict on one attempt's response or exception."""
    if isinstance(outcome, Exception):
        if isinstance(outcome, _RETRYABLE_ERRORS):
            return Verdict.RETRY
        if isinstance(outcome, httpx.TransportError):  # UnsupportedProtocol, LocalProtocolError
            return Verdict.UNSENDABLE
        return Verdict.RAISE
    status = outcome.status_code
    if status < 400:
        return Verdict.SUCCEEDED
    if status >= 500 or status in _RETRYABLE_STATUSES:
        return Verdict.RETRY
    if status in (409, 422):
        kind = problem_type(outcome)
        if kind.endswith("mismatch"):
            return Verdict.MISMATCH
        if status == 409 and kind.endswith("in-progress"):
            return Verdict.RETRY
        if status == 409 and kind.endswith("not-replayable"):
            return Verdict.NOT_REPLAYABLE
    return Verdict.REJECTED


def problem_type(response: httpx.Response) -> str:
    """The ``type`` of a JSON problem response ('' when the response is not one)."""
    if "json" not in response.headers.get("content-type", ""):
        return ""
    try:
        body = jsonlib.loads(response.content)
    except ValueError:
        return ""
    kind = body.get("type") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else ""


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds, when given in its delay-seconds form."""
    value = response.headers.get("retry-after", "").strip()
    return float(value) if value.isascii() and value.isdigit() else None


# --- Journal --------------------------------------------------------------------------------


@runtime_checkable
class Journal(Protocol):
    """Durable operation records, keyed by Idempotency-Key. Methods may block: the async
    client calls them in a worker thread, so implementations must be thread-safe."""

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation; if one with the same name and (non-null) ref exists,
        return that one unchanged instead."""
        ...

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        ...

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        ...

    def unsettled(self) -> list[JournalEntry]:
        """Entries still pending, sent or unknown, oldest first."""
        ...

    def close(self) -> None:
        """Release the journal's resources."""
        ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_operations (
    key TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    ref TEXT,
    state TEXT NOT NULL,
    method TEXT,
    url TEXT,
    headers TEXT NOT NULL DEFAULT '[]',
    body BLOB NOT NULL DEFAULT x'',
    status INTEGER,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    UNIQUE (name, ref)
)
"""
#: A journal entry's fields, in the order of :func:`_row` and :func:`_entry`.
_FIELDS = ("key", "name", "ref", "state", "method", "url", "headers", "body", "status")
#: The fields ``save()`` replaces; key, name and ref are fixed when an entry is first stored.
_MUTABLE = ("state", "method", "url", "headers", "body", "status")
_COLUMNS = ", ".join(_FIELDS)
_UNSETTLED = tuple(state.value for state in OperationState if not state.settled)
_SQLITE_UPSERT = "ON CONFLICT (key) DO UPDATE SET " + ", ".join(
    f"{name} = excluded.{name}" for name in (*_MUTABLE, "updated_at")
)


class _ClosedOnExit(abc.ABC):
    """``with thing:`` closes it at the end of the block."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the journal opened."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class SQLiteJournal(_ClosedOnExit):
    """A :class:`Journal` in a SQLite file (``":memory:"`` for one that does not persist).

    One connection guarded by a lock; WAL and a busy timeout let processes share the file.
    """

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_JOURNAL_PATH) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation, or return the one with the same name and ref."""
        with self._lock:
            self._write(entry, "ON CONFLICT DO NOTHING")
            args: tuple[str, ...]
            if entry.ref is None:
                where, args = "key = ?", (entry.key,)
            else:
                where, args = "name = ? AND ref = ?", (entry.name, entry.ref)
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM idempotency_operations WHERE {where}", args
            ).fetchone()
        return _entry(row)

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        with self._lock:
            self._write(entry, _SQLITE_UPSERT)

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM idempotency_operations WHERE key = ?", (key,)
            ).fetchone()
        return None if row is None else _entry(row)

    def unsettled(self) -> list[JournalEntry]:
        """Entries still pending, sent or unknown, oldest first."""
        marks = ", ".join("?" * len(_UNSETTLED))
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM idempotency_operations WHERE state IN ({marks})"
                " ORDER BY created_at, rowid",
                _UNSETTLED,
            ).fetchall()
        return [_entry(row) for row in rows]

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    def _write(self, entry: JournalEntry, on_conflict: str) -> None:
        now = time.time()
        self._db.execute(
            f"INSERT INTO idempotency_operations ({_COLUMNS}, created_at, updated_at)"
            f" VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) {on_conflict}",
            (*_row(entry), now, now),
        )


def _row(entry: JournalEntry) -> tuple[Any, ...]:
    """``entry`` as stored: the values of :data:`_FIELDS` (headers as JSON)."""
    return (
        entry.key,
        entry.name,
        entry.ref,
        entry.state.value,
        entry.method,
        entry.url,
        jsonlib.dumps([list(pair) for pair in entry.headers]),
        entry.body,
        entry.status,
    )


def _entry(row: Sequence[Any]) -> JournalEntry:
    """The entry stored as ``row`` (the values of :data:`_FIELDS`)."""
    key, name, ref, state, method, url, headers, body, status = row
    return JournalEntry(
        key=key,
        name=name,
        ref=ref,
        state=OperationState(state),
        method=method,
        url=url,
        headers=tuple((str(k), str(v)) for k, v in jsonlib.loads(headers)),
        body=bytes(body),
        status=None if status is None else int(status),
    )


# The client's journal table in a SQL database: the caller's, created on first use.
journal_metadata = MetaData()
journal_table = Table(
    "idempotency_client_journal",
    journal_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("key", ExactString, nullable=False, unique=True),
    Column("name", ExactString, nullable=False),
    Column("ref", ExactString, nullable=True),
    Column("state", String(16), nullable=False),
    Column("method", ExactString, nullable=True),
    Column("url", Text, nullable=True),
    Column("headers", Text, nullable=False),
    Column("body", LongBinary, nullable=False),
    Column("status", Integer, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    UniqueConstraint("name", "ref"),
)
_SELECT = select(*(journal_table.c[name] for name in _FIELDS))

#: The sync driver used for each backend when a URL names none, or an async one.
SYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}
_ASYNC_ONLY_DRIVERS = {"aiosqlite", "asyncpg", "asyncmy", "aiomysql"}


def sync_url(url: str | URL) -> URL:
    """``url`` with a sync driver: ``postgresql://`` becomes ``postgresql+psycopg://``,
    ``mysql://`` ``mysql+pymysql://``, ``sqlite+aiosqlite://`` ``sqlite://``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {url!r}") from exc
    backend = parsed.get_backend_name()
    if backend != "sqlite" and backend not in SYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() not in _ASYNC_ONLY_DRIVERS:
        return parsed
    driver = SYNC_DRIVERS.get(backend)
    return parsed.set(drivername=f"{backend}+{driver}" if driver else backend)


class SQLJournal(_ClosedOnExit):
    """A :class:`Journal` in the table ``idempotency_client_journal`` of a SQL database
    (SQLite, PostgreSQL, MariaDB/MySQL), e.g. the server store's.

    Give a URL (the journal makes a sync engine, see :func:`sync_url`, and disposes of it in
    :meth:`close`) or a sync ``Engine`` (never disposed of). The table is created on first use;
    names and refs are at most 255 characters.
    """

    def __init__(self, url_or_engine: str | URL | Engine) -> None:
        self._owns_engine = not isinstance(url_or_engine, Engine)
        self._engine = (
            url_or_engine
            if isinstance(url_or_engine, Engine)
            else create_engine(sync_url(url_or_engine))
        )
        self._lock = threading.Lock()
        self._created = False

    @property
    def engine(self) -> Engine:
        """The engine the journal runs on."""
        return self._engine

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation, or return the one with the same name and ref."""
        self._create()
        with contextlib.suppress(IntegrityError), self._engine.begin() as conn:
            conn.execute(insert(journal_table).values(self._values(entry)))
        c = journal_table.c
        if entry.ref is None:
            where = c.key == entry.key
        else:
            where = and_(c.name == entry.name, c.ref == entry.ref)
        with self._engine.connect() as conn:
            return _entry(conn.execute(_SELECT.where(where)).one())

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        self._create()
        values = self._values(entry)
        changes = {name: values[name] for name in (*_MUTABLE, "updated_at")}
        with self._engine.begin() as conn:
            found = conn.execute(
                update(journal_table).where(journal_table.c.key == entry.key).values(changes)
            )
            if found.rowcount == 0:
                conn.execute(insert(journal_table).values(values))

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        self._create()
        with self._engine.connect() as conn:
            row = conn.execute(_SELECT.where(journal_table.c.key == key)).first()
        return None if row is None else _entry(row)

    def unsettled(self) -> list[JournalEntry]:
        """Entries still pending, sent or unknown, oldest first."""
        self._create()
        query = _SELECT.where(journal_table.c.state.in_(_UNSETTLED)).order_by(journal_table.c.id)
        with self._engine.connect() as conn:
            return [_entry(row) for row in conn.execute(query)]

    def close(self) -> None:
        """Dispose of the engine, if the journal made it."""
        if self._owns_engine:
            self._engine.dispose()

    def _create(self) -> None:
        with self._lock:
            if self._created:
                return
            try:
                journal_metadata.create_all(self._engine)
            except SQLAlchemyError:  # another process created it since create_all checked
                if not inspect(self._engine).has_table(journal_table.name):
                    raise
            self._created = True

    @staticmethod
    def _values(entry: JournalEntry) -> dict[str, Any]:
        now = time.time()
        return {
            **dict(zip(_FIELDS, _row(entry), strict=True)),
            "created_at": now,
            "updated_at": now,
        }


# KEYS: the entry's hash, the (name, ref) -> key index, the unsettled sorted set, the sequence.
# ARGV: key, index field ('' without a ref), 'add' or 'save', '1' if settled, name, ref,
# n, n field/value pairs to set, then the fields to delete.
# An entry is stored once, with a new sequence number, name and ref; 'add' returns the key of
# the entry already stored under that key or (name, ref), 'save' then replaces the rest.
_REDIS_WRITE = """
local key, ref_field = ARGV[1], ARGV[2]
local owner = false
if ref_field ~= '' then owner = redis.call('HGET', KEYS[2], ref_field) end
local seq = redis.call('HGET', KEYS[1], 'seq')
if ARGV[3] == 'add' and (owner or seq) then return owner or key end
if not seq then
    if owner and owner ~= key then
        return redis.error_reply('another operation has this name and ref: ' .. owner)
    end
    seq = redis.call('INCR', KEYS[4])
    redis.call('HSET', KEYS[1], 'key', key, 'seq', seq, 'name', ARGV[5])
    if ref_field ~= '' then
        redis.call('HSET', KEYS[1], 'ref', ARGV[6])
        redis.call('HSET', KEYS[2], ref_field, key)
    end
end
local n = tonumber(ARGV[7])
if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, 8, 7 + 2 * n)) end
if #ARGV > 7 + 2 * n then redis.call('HDEL', KEYS[1], unpack(ARGV, 8 + 2 * n)) end
if ARGV[4] == '1' then
    redis.call('ZREM', KEYS[3], key)
else
    redis.call('ZADD', KEYS[3], seq, key)
end
return key
"""


class RedisJournal(_ClosedOnExit):
    """A :class:`Journal` in Redis, e.g. the server store's.

    Each entry is a hash ``<prefix>op:<key>``; ``<prefix>refs`` maps name and ref to keys,
    ``<prefix>unsettled`` orders unsettled keys by ``<prefix>seq``. Give ``url`` (the journal
    makes a client and closes it in :meth:`close`) or ``client``, a sync ``redis.Redis`` with
    ``decode_responses=False`` that the journal never closes. Writes are one Lua script each.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        prefix: str = "idem-journal:",
    ) -> None:
        client, self._owns_client = binary_client(
            url,
            client,
            lambda address: redis.Redis.from_url(address, decode_responses=False),
            owner="RedisJournal",
            holds="entries hold binary request bodies",
        )
        self._client = client
        self._prefix = prefix
        self._script = client.register_script(_REDIS_WRITE)

    @property
    def client(self) -> redis.Redis:
        """The Redis client the journal runs on."""
        return self._client

    @property
    def prefix(self) -> str:
        """The prefix of every Redis key the journal writes."""
        return self._prefix

    def add(self, entry: JournalEntry) -> JournalEntry:
        """Record a new operation, or return the one with the same name and ref."""
        stored = self.get(self._write(entry, "add"))
        assert stored is not None
        return stored

    def save(self, entry: JournalEntry) -> None:
        """Insert or replace the entry with ``entry.key``."""
        self._write(entry, "save")

    def get(self, key: str) -> JournalEntry | None:
        """The entry with this key, if any."""
        return self._entry(cast("dict[bytes, bytes]", self._client.hgetall(self._op(key))))

    def unsettled(self) -> list[JournalEntry]:
        """Entries still pending, sent or unknown, oldest first."""
        keys = cast("list[bytes]", self._client.zrange(f"{self._prefix}unsettled", 0, -1))
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self._op(key.decode()))
        entries = [self._entry(fields) for fields in pipe.execute()]
        return [entry for entry in entries if entry is not None and not entry.state.settled]

    def close(self) -> None:
        """Close the Redis client, if the journal made it."""
        if self._owns_client:
            self._client.close()

    def _op(self, key: str) -> str:
        return f"{self._prefix}op:{key}"

    def _write(self, entry: JournalEntry, mode: str) -> str:
        row = dict(zip(_FIELDS, _row(entry), strict=True))
        pairs = [part for name in _MUTABLE if row[name] is not None for part in (name, row[name])]
        gone = [name for name in _MUTABLE if row[name] is None]
        ref_field = "" if entry.ref is None else jsonlib.dumps([entry.name, entry.ref])
        keys = [self._op(entry.key), *(self._prefix + k for k in ("refs", "unsettled", "seq"))]
        args = [entry.key, ref_field, mode, "1" if entry.state.settled else "0", entry.name]
        reply = self._script(
            keys=keys, args=[*args, entry.ref or "", len(pairs) // 2, *pairs, *gone]
        )
        return bytes(reply).decode()

    @staticmethod
    def _entry(fields: Mapping[bytes, bytes]) -> JournalEntry | None:
        if not fields:
            return None
        values = [fields.get(name.encode()) for name in _FIELDS]
        return _entry(
            [
                v if v is None or name == "body" else v.decode()
                for name, v in zip(_FIELDS, values, strict=True)
            ]
        )


# --- The retry protocol, written once -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Send:
    request: httpx.Request


@dataclass(frozen=True, slots=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class _Save:
    entry: JournalEntry


_Step: TypeAlias = _Send | _Sleep | _Save
#: What a driver answers a step with: the response or exception of a _Send, else None.
_Reply: TypeAlias = httpx.Response | Exception | None
_Steps: TypeAlias = Generator[_Step, _Reply, T]

#: Errors that end one operation of reconcile() without stopping the others.
_RECONCILE_ERRORS = (OperationError, httpx.HTTPError)


class _Core:
    """Everything the two clients share: keys, request encoding, classification, retries."""

    def __init__(
        self,
        http: httpx.Client | httpx.AsyncClient,
        *,
        owns_http: bool,
        journal: Journal | str | os.PathLike[str],
        policy: RetryPolicy | None,
        header_name: str,
        key_prefix: str,
        session_id: str | None,
        clock: Callable[[], float],
        rng: random.Random | None,
    ) -> None:
        if key_prefix and not _KEY_PART.fullmatch(key_prefix):
            raise ConfigurationError(f"key_prefix must match {_KEY_PART.pattern}")
        session = session_id if session_id is not None else secrets.token_hex(4)
        if not _KEY_PART.fullmatch(session):
            raise ConfigurationError(f"session_id must match {_KEY_PART.pattern}")
        if not _HEADER_NAME.fullmatch(header_name):
            raise ConfigurationError("header_name must be a non-empty HTTP header name")
        self.http = http
        self.owns_http = owns_http
        self.owns_journal = not isinstance(journal, Journal)
        self.journal: Journal = journal if isinstance(journal, Journal) else SQLiteJournal(journal)
        self.policy = policy or RetryPolicy()
        self.header_name = header_name
        self.session = f"{key_prefix}-{session}" if key_prefix else session
        self.clock = clock
        self.rng = rng or random.Random()
        self._sequence = itertools.count(1)

    def new_entry(self, name: str, ref: str | None) -> JournalEntry:
        """A pending entry for a new operation, with a fresh key."""
        if not _KEY_PART.fullmatch(name):
            raise ConfigurationError(f"operation names must match {_KEY_PART.pattern}: {name!r}")
        key = f"{self.session}:{name}:{next(self._sequence):06d}:{secrets.token_hex(8)}"
        if len(key) > MAX_KEY_LENGTH:
            raise ConfigurationError(f"the key {key!r} is longer than {MAX_KEY_LENGTH} characters")
        return JournalEntry(key=key, name=name, ref=ref, state=OperationState.PENDING)

    def prepare(
        self, operation: Operation, method: str, url: str, parts: RequestParts
    ) -> JournalEntry:
        """The pending entry of ``operation`` with its request encoded once, for every attempt."""
        request = self.http.build_request(
            method,
            url,
            params=parts.get("params"),
            headers=parts.get("headers"),
            content=parts.get("content"),
            data=parts.get("data"),
            json=parts.get("json"),
        )
        given = httpx.Headers(parts.get("headers"))
        unsent = {self.header_name.lower(), "host", "content-length", "transfer-encoding"}
        headers = [(name, value) for name, value in given.multi_items() if name not in unsent]
        content_type = request.headers.get("content-type")
        if content_type is not None and "content-type" not in given:
            headers.append(("content-type", content_type))
        return JournalEntry(
            key=operation.key,
            name=operation.name,
            ref=operation.ref,
            state=OperationState.PENDING,
            method=request.method,
            url=str(request.url),
            headers=tuple(headers),
            body=request.read(),
        )

    def exchange(
        self, entry: JournalEntry, box: list[JournalEntry] | None = None
    ) -> _Steps[httpx.Response]:
        """Send ``entry`` until its outcome is known, or attempts or time run out.

        ``box``, when given, holds the latest journaled entry (for :meth:`settle`).
        """
        method, url = entry.method, entry.url
        if method is None or url is None:
            raise ConfigurationError(f"operation {entry.key!r} has no request to send")
        deadline = self.clock() + self.policy.deadline

        def journaled(new: JournalEntry) -> _Save:
            if box is not None:
                box[0] = new
            return _Save(new)

        entry = replace(entry, state=OperationState.SENT)
        yield journaled(entry)
        last: httpx.Response | Exception | None = None
        attempt = 0
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise OutcomeUnknown(entry.key, attempt, last) from _cause(last)
            attempt += 1
            request = self.http.build_request(
                method,
                url,
                content=entry.body,
                headers=[*entry.headers, (self.header_name, entry.key)],
                timeout=self.policy.timeout(remaining),
            )
            last = yield _Send(request)
            assert last is not None
            verdict = classify(last)
            if verdict is Verdict.RAISE:
                assert isinstance(last, Exception)
                raise last
            status = last.status_code if isinstance(last, httpx.Response) else entry.status
            entry = replace(entry, state=_STATE_AFTER[verdict], status=status)
            yield journaled(entry)
            if verdict is Verdict.RETRY:
                delay = self._delay(last, attempt, deadline)
                if delay is None:
                    raise OutcomeUnknown(entry.key, attempt, last) from _cause(last)
                logger.info("retrying %s in %.2fs after %s", entry.key, delay, _describe(last))
                yield _Sleep(delay)
                continue
            if isinstance(last, Exception):  # Verdict.UNSENDABLE
                raise last
            if verdict is Verdict.MISMATCH:
                raise IdempotencyKeyMismatch("key reused with a different request", entry.key, last)
            if verdict is Verdict.NOT_REPLAYABLE:
                raise ResponseNotReplayable("it ran, but its response is lost", entry.key, last)
            return last

    def settle(self, entry: JournalEntry) -> _Steps[JournalEntry]:
        """Re-send an unsettled entry; its journaled entry afterwards, whatever the outcome."""
        box = [entry]
        try:
            yield from self.exchange(entry, box)
        except _RECONCILE_ERRORS as exc:
            logger.warning("reconcile could not settle %s: %s", entry.key, exc)
        return box[0]

    def _delay(
        self, last: httpx.Response | Exception, attempt: int, deadline: float
    ) -> float | None:
        """How long to wait before the next attempt; ``None`` to give up."""
        remaining = deadline - self.clock()
        if attempt >= self.policy.max_attempts or remaining <= 0:
            return None
        hint = retry_after(last) if isinstance(last, httpx.Response) else None
        if hint is not None:
            return hint if hint < remaining else None
        return self.policy.backoff(attempt, self.rng, limit=remaining)


def _cause(outcome: httpx.Response | Exception | None) -> Exception | None:
    return outcome if isinstance(outcome, Exception) else None


def _describe(outcome: httpx.Response | Exception) -> str:
    if isinstance(outcome, httpx.Response):
        return f"HTTP {outcome.status_code}"
    return type(outcome).__name__


# --- The clients ----------------------------------------------------------------------------


class IdempotentClient:
    """An async client whose non-GET operations are safe to retry.

    ``http`` is the httpx client to send with (one is made on ``base_url`` when omitted; only
    that one is closed by :meth:`aclose`). ``journal`` is a :class:`Journal` or the path of a
    SQLite file. Keys read ``<key_prefix>-<session_id>:<operation>:<sequence>:<random>``.
    ``sleep``, ``clock`` and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        *,
        http: httpx.AsyncClient | None = None,
        base_url: str = "",
        journal: Journal | str | os.PathLike[str] = DEFAULT_JOURNAL_PATH,
        policy: RetryPolicy | None = None,
        header_name: str = "Idempotency-Key",
        key_prefix: str = "op",
        session_id: str | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._http = http if http is not None else httpx.AsyncClient(base_url=base_url)
        self._core = _Core(
            self._http,
            owns_http=http is None,
            journal=journal,
            policy=policy,
            header_name=header_name,
            key_prefix=key_prefix,
            session_id=session_id,
            clock=clock,
            rng=rng,
        )
        self._sleep = sleep

    @property
    def journal(self) -> Journal:
        """The journal of this client's operations."""
        return self._core.journal

    async def operation(self, name: str, *, ref: str | None = None) -> Operation:
        """Decide an operation and journal its new key; with ``ref``, resume the journaled
        operation of that name and ref (with its key) if there is one."""
        entry = self._core.new_entry(name, ref)
        stored = await anyio.to_thread.run_sync(self._core.journal.add, entry)
        return stored.operation

    async def send(
        self, operation: Operation, method: str, url: str, **parts: Unpack[RequestParts]
    ) -> httpx.Response:
        """Send ``operation`` with its key, retrying until its outcome is known.

        Returns a response below 400 (``confirmed``) or a final 4xx (``failed``); raises
        :class:`IdempotencyKeyMismatch`, :class:`ResponseNotReplayable` or
        :class:`OutcomeUnknown`. The body is encoded once and journaled with ``headers``
        (not the httpx client's default headers, so credentials stay out of the journal);
        attempt timeouts come from the :class:`RetryPolicy`, not the httpx client.
        """
        entry = self._core.prepare(operation, method, url, parts)
        return await self._perform(self._core.exchange(entry))

    async def post(
        self, url: str, *, operation: str, ref: str | None = None, **parts: Unpack[RequestParts]
    ) -> httpx.Response:
        """Decide a POST operation named ``operation`` and send it."""
        op = await self.operation(operation, ref=ref)
        return await self.send(op, "POST", url, **parts)

    async def reconcile(self) -> list[JournalEntry]:
        """Re-send every journaled operation left pending, sent or unknown, with its key.

        Returns their entries afterwards; an operation whose outcome is still unknown stays
        ``unknown`` (errors are logged, not raised). Operations never given a request are
        skipped.
        """
        entries = await anyio.to_thread.run_sync(self._core.journal.unsettled)
        return [
            await self._perform(self._core.settle(entry))
            for entry in entries
            if entry.method is not None
        ]

    async def aclose(self) -> None:
        """Close the httpx client and the journal, if this client opened them."""
        if self._core.owns_http:
            await self._http.aclose()
        if self._core.owns_journal:
            await anyio.to_thread.run_sync(self._core.journal.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _perform(self, steps: _Steps[T]) -> T:
        reply: _Reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    result: T = done.value
                    return result
                reply = None
                if isinstance(step, _Send):
                    try:
                        reply = await self._http.send(step.request)
                    except Exception as exc:
                        reply = exc
                elif isinstance(step, _Sleep):
                    await self._sleep(step.seconds)
                else:
                    await anyio.to_thread.run_sync(self._core.journal.save, step.entry)
        finally:
            steps.close()


class SyncIdempotentClient(_ClosedOnExit):
    """The blocking twin of :class:`IdempotentClient`, with the same behaviour and options."""

    def __init__(
        self,
        *,
        http: httpx.Client | None = None,
        base_url: str = "",
        journal: Journal | str | os.PathLike[str] = DEFAULT_JOURNAL_PATH,
        policy: RetryPolicy | None = None,
        header_name: str = "Idempotency-Key",
        key_prefix: str = "op",
        session_id: str | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._http = http if http is not None else httpx.Client(base_url=base_url)
        self._core = _Core(
            self._http,
            owns_http=http is None,
            journal=journal,
            policy=policy,
            header_name=header_name,
            key_prefix=key_prefix,
            session_id=session_id,
            clock=clock,
            rng=rng,
        )
        self._sleep = sleep

    @property
    def journal(self) -> Journal:
        """The journal of this client's operations."""
        return self._core.journal

    def operation(self, name: str, *, ref: str | None = None) -> Operation:
        """See :meth:`IdempotentClient.operation`."""
        return self._core.journal.add(self._core.new_entry(name, ref)).operation

    def send(
        self, operation: Operation, method: str, url: str, **parts: Unpack[RequestParts]
    ) -> httpx.Response:
        """See :meth:`IdempotentClient.send`."""
        entry = self._core.prepare(operation, method, url, parts)
        return self._perform(self._core.exchange(entry))

    def post(
        self, url: str, *, operation: str, ref: str | None = None, **parts: Unpack[RequestParts]
    ) -> httpx.Response:
        """See :meth:`IdempotentClient.post`."""
        return self.send(self.operation(operation, ref=ref), "POST", url, **parts)

    def reconcile(self) -> list[JournalEntry]:
        """See :meth:`IdempotentClient.reconcile`."""
        return [
            self._perform(self._core.settle(entry))
            for entry in self._core.journal.unsettled()
            if entry.method is not None
        ]

    def close(self) -> None:
        """Close the httpx client and the journal, if this client opened them."""
        if self._core.owns_http:
            self._http.close()
        if self._core.owns_journal:
            self._core.journal.close()

    def _perform(self, steps: _Steps[T]) -> T:
        reply: _Reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    result: T = done.value
                    return result
                reply = None
                if isinstance(step, _Send):
                    try:
                        reply = self._http.send(step.request)
                    except Exception as exc:
                        reply = exc
                elif isinstance(step, _Sleep):
                    self._sleep(step.seconds)
                else:
                    self._core.journal.save(step.entry)
        finally:
            steps.close()
