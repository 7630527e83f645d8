"""SQLStore: idempotency records in a SQL table (SQLite, PostgreSQL, MariaDB/MySQL)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from typing import cast as type_cast

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    cast,
    delete,
    exists,
    func,
    inspect,
    not_,
    null,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement, Delete, Executable, FunctionElement
from sqlalchemy.types import BigInteger, Integer

from idempotency_mw.exceptions import ConfigurationError, SchemaError, StoreError, describe
from idempotency_mw.records import (
    Claim,
    ClaimOutcome,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)
from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.stores.drivers import (
    READ_COMMITTED,
    AsyncmyDriver,
    AsyncpgDriver,
    Driver,
    SQLAlchemyDriver,
    SQLiteDriver,
    deadline,
)
from idempotency_mw.stores.schema import TABLE_NAME, records

T = TypeVar("T")
#: The share of the operation timeout a statement may spend in a thread waiting for a lock.
_THREAD_SHARE = 0.9

#: The async driver used for each backend when a URL names none (or a sync one).
ASYNC_DRIVERS = {
    "sqlite": "aiosqlite",
    "postgresql": "asyncpg",
    "mysql": "asyncmy",
    "mariadb": "asyncmy",
}
_ASYNC_DRIVER_NAMES = {"aiosqlite", "asyncpg", "psycopg", "asyncmy", "aiomysql"}

MIGRATE_HINT = (
    "run `idempotency-mw migrate --url <database url>`, or `alembic upgrade idempotency_mw@head` "
    "in an Alembic project that includes this package's revisions"
)


class _NowMs(FunctionElement[int]):
    """The database server's clock, in milliseconds since the Unix epoch."""

    type = BigInteger()
    inherit_cache = True


@compiles(_NowMs, "sqlite")
def _now_sqlite(element: _NowMs, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"


@compiles(_NowMs, "postgresql")
def _now_postgresql(element: _NowMs, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)"


@compiles(_NowMs, "mysql")
@compiles(_NowMs, "mariadb")
def _now_mysql(element: _NowMs, compiler: SQLCompiler, **kw: Any) -> str:
    return "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"


def async_url(url: str | URL) -> URL:
    """``url`` with an async driver: ``sqlite:///x.db`` becomes ``sqlite+aiosqlite:///x.db``."""
    try:
        parsed = make_url(url)
    except SQLAlchemyError as exc:
        raise ConfigurationError(f"not a database URL: {url!r}") from exc
    backend = parsed.get_backend_name()
    if backend not in ASYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported database {backend!r}: use SQLite, PostgreSQL or MariaDB/MySQL"
        )
    if "+" in parsed.drivername and parsed.get_driver_name() in _ASYNC_DRIVER_NAMES:
        return parsed
    return parsed.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")


# Statements are built once, with bound parameters, so SQLAlchemy compiles each only once.
_NOW = _NowMs()
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_KEY_IS = and_(records.c.scope == bindparam("p_scope"), records.c.key == bindparam("p_key"))
_MINE = and_(records.c.status == _IN_PROGRESS, records.c.token == bindparam("p_token"))
#: Past its TTL and not held by a live lease: as good as absent.
_EXPIRED = and_(
    records.c.expires_at <= _NOW,
    or_(records.c.status != _IN_PROGRESS, records.c.lease_expires_at <= _NOW),
)
#: Still in progress under this token, and not yet as good as absent.
_OWNED = and_(_KEY_IS, _MINE, not_(_EXPIRED))
#: Expired (any request may take it), or the same request's lease lapsed.
_CAN_TAKE_OVER = or_(
    _EXPIRED,
    and_(
        records.c.status == _IN_PROGRESS,
        records.c.lease_expires_at <= _NOW,
        records.c.request_hash == bindparam("p_fingerprint"),
    ),
)
_NEW_RECORD: dict[str, Any] = {
    "scope": bindparam("p_scope"),
    "key": bindparam("p_key"),
    "request_hash": bindparam("p_fingerprint"),
    "status": _IN_PROGRESS,
    "token": bindparam("p_token"),
    "created_at": _NOW,
    "lease_expires_at": _NOW + bindparam("p_lease_ms", type_=BigInteger),
    "expires_at": _NOW + bindparam("p_ttl_ms", type_=BigInteger),
    "response_status": None,
    "response_headers": None,
    "result_payload": None,
}
_READ = select(
    records.c.request_hash,
    records.c.status,
    records.c.response_status,
    records.c.response_headers,
    records.c.result_payload,
    _MINE.label("mine"),
    _CAN_TAKE_OVER.label("free"),
).where(_KEY_IS)
_WINNER = select(records.c.token).where(_KEY_IS)
_RENEW = (
    update(records)
    .where(_OWNED)
    .values(lease_expires_at=_NOW + bindparam("p_lease_ms", type_=BigInteger))
)
_COMPLETE = (
    update(records)
    .where(_OWNED)
    .values(
        status=bindparam("p_status"),
        response_status=bindparam("p_response_status"),
        response_headers=bindparam("p_response_headers"),
        result_payload=bindparam("p_result_payload"),
        lease_expires_at=_NOW,
        expires_at=_NOW + bindparam("p_ttl_ms", type_=BigInteger),
    )
)
_RELEASE = delete(records).where(_OWNED)


class SQLStore(ClaimsWithToken):
    """Idempotency records in the ``idempotency_records`` table of a SQL database.

    ``database`` is a SQLAlchemy URL (with or without an async driver name) or an
    :class:`~sqlalchemy.ext.asyncio.AsyncEngine`, which the store never disposes. From a URL the
    store picks the fastest safe driver: asyncpg for PostgreSQL, asyncmy for MariaDB/MySQL, the
    standard library's sqlite3 for a SQLite file, and SQLAlchemy's async engine otherwise.
    ``operation_timeout`` bounds every database call (seconds). A SQLite file keeps its journal
    mode unless ``sqlite_wal=True`` switches it to WAL with ``synchronous=NORMAL``: readers and a
    writer of several processes no longer wait for each other, and a power cut can lose the
    latest commits (never corrupt the file).
    """

    def __init__(
        self,
        database: str | URL | AsyncEngine,
        *,
        operation_timeout: float = 10.0,
        sqlite_wal: bool = False,
    ) -> None:
        self._driver = _driver_for(database, sqlite_wal=sqlite_wal)
        self._operation_timeout = operation_timeout
        self._errors: tuple[type[Exception], ...] = (
            *self._driver.errors,
            OSError,
            TimeoutError,
        )
        dialect = self._driver.dialect_name
        self._claim_step = _CLAIM_STEPS[dialect]
        self._purge = _PURGES[dialect]

    async def _claim(
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float, token: str
    ) -> Claim:
        params = {
            **_record_of(scope, key),
            "p_fingerprint": fingerprint,
            "p_token": token,
            "p_ttl_ms": int(ttl * 1000),
            "p_lease_ms": int(lease * 1000),
        }
        # A record the read finds live decides the outcome without a write (a replay is one
        # statement). Otherwise the atomic upsert decides; if another request won it in between,
        # the next attempt reads that request's record.
        for _ in range(3):
            live, taken = await self._call(self._claim_step(self._driver, params))
            if taken:
                return Claim(ClaimOutcome.ACQUIRED, token=token)
            existing = _outcome_of(live, fingerprint, token)
            if existing is not None:
                return existing
        raise StoreError(f"the record of a key kept changing while it was claimed ({TABLE_NAME})")

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        params = {**_record_of(scope, key), "p_token": token, "p_lease_ms": int(lease * 1000)}
        return await self._call(self._driver.change(_RENEW, params)) == 1

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        params: dict[str, Any] = {
            **_record_of(scope, key),
            "p_token": token,
            "p_ttl_ms": int(ttl * 1000),
            "p_status": RecordStatus.UNREPLAYABLE.value,
            "p_response_status": None,
            "p_response_headers": None,
            "p_result_payload": None,
        }
        if response is not None:
            params |= {
                "p_status": RecordStatus.COMPLETED.value,
                "p_response_status": response.status,
                "p_response_headers": pack_headers(response.headers),
                "p_result_payload": response.body,
            }
        return await self._call(self._driver.change(_COMPLETE, params)) == 1

    async def release(self, scope: str, key: str, token: str) -> bool:
        params = {**_record_of(scope, key), "p_token": token}
        return await self._call(self._driver.change(_RELEASE, params)) == 1

    async def purge_expired(self, *, batch_size: int) -> int | None:
        statement, params = self._purge(batch_size)
        return await self._call(self._driver.change(statement, params))

    async def startup(self) -> None:
        def check(conn: Connection) -> None:
            inspector = inspect(conn)
            if not inspector.has_table(TABLE_NAME):
                raise SchemaError(f"the table {TABLE_NAME!r} does not exist: {MIGRATE_HINT}")
            present = {column["name"] for column in inspector.get_columns(TABLE_NAME)}
            missing = sorted(set(records.c.keys()) - present)
            if missing:
                raise SchemaError(
                    f"the table {TABLE_NAME!r} lacks columns {missing}, it is out of date: "
                    f"{MIGRATE_HINT}"
                )

        await self._call(self._driver.run_sync(check))

    async def aclose(self) -> None:
        await self._driver.aclose()

    async def _call(self, operation: Awaitable[T]) -> T:
        """Await a driver call within the operation timeout; its failures become StoreError."""
        # Work the driver hands to a thread must give up before the caller stops waiting: a
        # statement that ran after the request was answered 503 would hold the key for nothing.
        ends = deadline.set(time.monotonic() + self._operation_timeout * _THREAD_SHARE)
        try:
            async with asyncio.timeout(self._operation_timeout):
                return await operation
        except self._errors as exc:
            raise StoreError(describe(exc)) from exc
        finally:
            deadline.reset(ends)


_IN_MEMORY = (None, "", ":memory:")


def _driver_for(database: str | URL | AsyncEngine, *, sqlite_wal: bool) -> Driver:
    url = None if isinstance(database, AsyncEngine) else async_url(database)
    if url is not None and url.get_backend_name() == "sqlite" and url.database not in _IN_MEMORY:
        return SQLiteDriver(url, wal=sqlite_wal)
    if sqlite_wal:
        raise ConfigurationError("sqlite_wal=True applies to a SQLite file URL only")
    if url is None:
        return SQLAlchemyDriver(type_cast(AsyncEngine, database), owned=False)
    backend, driver = url.get_backend_name(), url.get_driver_name()
    if backend == "postgresql" and driver == "asyncpg":
        return AsyncpgDriver(url)
    if backend in ("mysql", "mariadb") and driver == "asyncmy":
        return AsyncmyDriver(url)
    if backend == "sqlite":
        # An in-memory SQLite database exists once per connection: keep one connection.
        return SQLAlchemyDriver(create_async_engine(url, poolclass=StaticPool), owned=True)
    # READ COMMITTED spares MariaDB/MySQL the gap locks that make concurrent purges deadlock.
    # Pre-ping: a connection pooled before an outage is replaced, not handed out dead.
    options: dict[str, Any] = {"pool_pre_ping": True}
    if backend in ("mysql", "mariadb"):
        options["connect_args"] = {"init_command": READ_COMMITTED}
    return SQLAlchemyDriver(
        create_async_engine(url, isolation_level="AUTOCOMMIT", **options),
        owned=True,
        in_autocommit=True,
    )


_DIGEST = "sha256:"


def _stored(name: str) -> str:
    """``name`` as the table stores it: verbatim, or as its digest when it may not be.

    A name that does not fit the column, or ends with a space (MariaDB/MySQL collations ignore
    trailing spaces, so 'k' and 'k ' would be one record), or looks like a digest, is stored
    as its own digest: no two names ever share a record.
    """
    if len(name) <= 255 and not name.endswith(" ") and not name.startswith(_DIGEST):
        return name
    return _DIGEST + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()


def _record_of(scope: str, key: str) -> dict[str, str]:
    return {"p_scope": _stored(scope), "p_key": _stored(key)}


def _outcome_of(row: Sequence[Any] | None, fingerprint: str, token: str) -> Claim | None:
    """The outcome a live record decides (a row of ``_READ``), or ``None`` if the key is free.

    A record in progress under ``token`` is this request's own: its claim was delivered before.
    """
    if row is None:
        return None
    request_hash, status, response_status, response_headers, result_payload, mine, free = row
    if free:
        return None
    if mine:
        return Claim(ClaimOutcome.ACQUIRED, token=token)
    if request_hash != fingerprint:
        return Claim(ClaimOutcome.MISMATCH)
    if status == RecordStatus.COMPLETED.value:
        response = StoredResponse(
            response_status, unpack_headers(response_headers), bytes(result_payload)
        )
        return Claim(ClaimOutcome.REPLAY, response=response)
    if status == RecordStatus.UNREPLAYABLE.value:
        return Claim(ClaimOutcome.UNREPLAYABLE)
    return Claim(ClaimOutcome.IN_PROGRESS)


_BATCH = bindparam("p_batch_size", type_=Integer)
# SKIP LOCKED lets concurrent purgers and claims pass each other on PostgreSQL instead of
# waiting or deadlocking; SQLite, one writer at a time, ignores it.
_PURGE_OLDEST = delete(records).where(
    tuple_(records.c.scope, records.c.key).in_(
        select(records.c.scope, records.c.key)
        .where(_EXPIRED)
        .order_by(records.c.expires_at)
        .limit(_BATCH)
        .with_for_update(skip_locked=True)
    )
)
Purge = Callable[[int], tuple[Any, dict[str, Any]]]


def _purge_oldest(batch_size: int) -> tuple[Any, dict[str, Any]]:
    return _PURGE_OLDEST, {"p_batch_size": batch_size}


class _DeleteLimit(Executable, ClauseElement):
    """``DELETE ... LIMIT :p_batch_size``: MariaDB takes no LIMIT in an IN subquery.

    SQLAlchemy's own ``mysql_limit`` writes the number into the SQL, so every batch size would
    be a statement of its own; the MySQL drivers fill in a bound LIMIT like any parameter.
    """

    inherit_cache = True

    def __init__(self, statement: Delete) -> None:
        self.statement = statement


@compiles(_DeleteLimit)
def _compile_delete_limit(element: _DeleteLimit, compiler: SQLCompiler, **kw: Any) -> str:
    return f"{compiler.process(element.statement, **kw)} LIMIT {compiler.process(_BATCH, **kw)}"


_PURGE_LIMITED = _DeleteLimit(delete(records).where(_EXPIRED))


def _purge_limited(batch_size: int) -> tuple[Any, dict[str, Any]]:
    return _PURGE_LIMITED, {"p_batch_size": batch_size}


_PURGES: dict[str, Purge] = {
    "sqlite": _purge_oldest,
    "postgresql": _purge_oldest,
    "mysql": _purge_limited,
    "mariadb": _purge_limited,
}


Row = Sequence[Any]
#: Whether the request took the key (the upsert's winner).
Take = Callable[[Driver, dict[str, Any]], Awaitable[bool]]
#: One attempt at a claim: the row of ``_READ`` of a live record found (else None), and
#: whether the request took the key.
ClaimStep = Callable[[Driver, dict[str, Any]], Awaitable[tuple[Row | None, bool]]]


def _upsert_returning(dialect: Any, rows: Any = None) -> Any:
    """INSERT (the new record, or ``rows``) ON CONFLICT DO UPDATE ... WHERE ... RETURNING."""
    insert = dialect.insert(records)
    insert = insert.values(_NEW_RECORD) if rows is None else insert.from_select(_NEW_RECORD, rows)
    return insert.on_conflict_do_update(
        index_elements=[records.c.scope, records.c.key],
        set_={name: insert.excluded[name] for name in _NEW_RECORD if name not in _KEY},
        where=_CAN_TAKE_OVER,
    ).returning(records.c.token)


def _take_returning(dialect: Any) -> Take:
    """The upsert alone: one atomic statement."""
    statement = _upsert_returning(dialect)

    async def take(driver: Driver, params: dict[str, Any]) -> bool:
        rows = await driver.fetch(statement, params)
        return bool(rows) and rows[0][0] == params["p_token"]

    return take


def _read_then(take: Take) -> ClaimStep:
    """Read; only when no live record turns up, ``take``."""

    async def step(driver: Driver, params: dict[str, Any]) -> tuple[Row | None, bool]:
        rows = await driver.fetch(_READ, params)
        if rows and not rows[0][-1]:  # live: its outcome needs no write
            return rows[0], False
        return None, await take(driver, params)

    return step


def _read_or_take_in_one_statement() -> ClaimStep:
    """PostgreSQL: the read and, when it finds no live record, the upsert, in one statement.

    Both parts see one snapshot; the upsert's WHERE still decides on the latest committed row,
    so of concurrent requests that all found the key free exactly one takes it.
    """
    existing = _READ.cte("existing")
    new_record = select(
        *(
            cast(null() if value is None else value, records.c[name].type).label(name)
            for name, value in _NEW_RECORD.items()
        )
    ).where(~exists(select(existing.c.free).where(~existing.c.free)))
    taken = _upsert_returning(postgresql, new_record).cte("taken")
    statement = select(
        *(select(column).scalar_subquery() for column in existing.c),
        select(taken.c.token).scalar_subquery(),
    )

    async def step(driver: Driver, params: dict[str, Any]) -> tuple[Row | None, bool]:
        *read, token = (await driver.fetch(statement, params))[0]
        return (read if read[0] is not None else None), token == params["p_token"]

    return step


def _take_on_duplicate_key() -> Take:
    # MySQL has no WHERE on ON DUPLICATE KEY UPDATE and applies assignments left to right:
    # the token is decided first, and every other column follows whether the token changed.
    # Without RETURNING, a second statement reads the winner. No transaction is needed: a
    # record that holds this request's fresh token is this request's (only the token's owner
    # can release it, and no one can take it over while its lease runs).
    insert = mysql.insert(records).values(_NEW_RECORD)
    new = insert.inserted
    assignments: list[tuple[str, Any]] = [
        ("token", func.IF(_CAN_TAKE_OVER, new.token, records.c.token))
    ]
    assignments += [
        (name, func.IF(records.c.token == new.token, new[name], records.c[name]))
        for name in _NEW_RECORD
        if name not in (*_KEY, "token")
    ]
    upsert = insert.on_duplicate_key_update(assignments)

    async def take(driver: Driver, params: dict[str, Any]) -> bool:
        await driver.change(upsert, params)
        rows = await driver.fetch(_WINNER, params)
        return bool(rows) and rows[0][0] == params["p_token"]

    return take


_KEY = ("scope", "key")
_READ_THEN_TAKE_ON_DUPLICATE_KEY = _read_then(_take_on_duplicate_key())
_CLAIM_STEPS: dict[str, ClaimStep] = {
    "sqlite": _read_then(_take_returning(sqlite)),
    "postgresql": _read_or_take_in_one_statement(),
    "mysql": _READ_THEN_TAKE_ON_DUPLICATE_KEY,
    "mariadb": _READ_THEN_TAKE_ON_DUPLICATE_KEY,
}
