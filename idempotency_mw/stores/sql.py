"""SQLStore: idempotency records in a SQL table (SQLite, PostgreSQL, MariaDB/MySQL)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    delete,
    event,
    func,
    inspect,
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
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement
from sqlalchemy.types import BigInteger

from idempotency_mw.exceptions import ConfigurationError, SchemaError, StoreError
from idempotency_mw.records import (
    Claim,
    ClaimOutcome,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)
from idempotency_mw.stores.schema import TABLE_NAME, records

T = TypeVar("T")

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


def _tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers and one writer work at once across processes; a busy timeout makes
    # concurrent writers wait for the lock instead of failing with "database is locked".
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _key_is(scope: str, key: str) -> ColumnElement[bool]:
    return and_(records.c.scope == scope, records.c.key == key)


def _owned(scope: str, key: str, token: str) -> ColumnElement[bool]:
    return and_(
        _key_is(scope, key),
        records.c.token == token,
        records.c.status == RecordStatus.IN_PROGRESS.value,
    )


def _expired(now: _NowMs) -> ColumnElement[bool]:
    """Past its TTL and not held by a live lease."""
    return and_(
        records.c.expires_at <= now,
        or_(
            records.c.status != RecordStatus.IN_PROGRESS.value,
            records.c.lease_expires_at <= now,
        ),
    )


def _can_take_over(fingerprint: str, now: _NowMs) -> ColumnElement[bool]:
    """Expired (any request may take it), or the same request's lease lapsed."""
    return or_(
        _expired(now),
        and_(
            records.c.status == RecordStatus.IN_PROGRESS.value,
            records.c.lease_expires_at <= now,
            records.c.request_hash == fingerprint,
        ),
    )


class SQLStore:
    """Idempotency records in the ``idempotency_records`` table of a SQL database.

    ``database`` is a SQLAlchemy URL (with or without an async driver name) or an
    :class:`~sqlalchemy.ext.asyncio.AsyncEngine`. The store disposes only an engine it created.
    SQLite databases it opens get WAL and a busy timeout, so several worker processes can share
    one file. ``operation_timeout`` bounds every database call (seconds).
    """

    def __init__(
        self,
        database: str | URL | AsyncEngine,
        *,
        operation_timeout: float = 10.0,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(database, AsyncEngine):
            self._engine = database
            self._owns_engine = False
        else:
            url = async_url(database)
            self._engine = create_async_engine(url, **(engine_options or {}))
            self._owns_engine = True
            if url.get_backend_name() == "sqlite":
                event.listen(self._engine.sync_engine, "connect", _tune_sqlite)
        self._operation_timeout = operation_timeout
        self._upsert = _UPSERTS[self._engine.dialect.name]

    @property
    def engine(self) -> AsyncEngine:
        """The engine the store runs on."""
        return self._engine

    async def claim(
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float
    ) -> Claim:
        token = uuid.uuid4().hex

        def claim_in(conn: Connection) -> Claim:
            now = _NowMs()
            conn.execute(
                self._upsert(
                    {
                        "scope": scope,
                        "key": key,
                        "request_hash": fingerprint,
                        "status": RecordStatus.IN_PROGRESS.value,
                        "token": token,
                        "created_at": now,
                        "lease_expires_at": now + int(lease * 1000),
                        "expires_at": now + int(ttl * 1000),
                        "response_status": None,
                        "response_headers": None,
                        "result_payload": None,
                    },
                    _can_take_over(fingerprint, now),
                )
            )
            # The upsert holds the row's lock (or the database's, on SQLite) until commit, so
            # this read sees the record exactly as the upsert left it.
            row = conn.execute(
                select(
                    records.c.token,
                    records.c.request_hash,
                    records.c.status,
                    records.c.response_status,
                    records.c.response_headers,
                    records.c.result_payload,
                ).where(_key_is(scope, key))
            ).one()
            if row.token == token:
                return Claim(ClaimOutcome.ACQUIRED, token=token)
            if row.request_hash != fingerprint:
                return Claim(ClaimOutcome.MISMATCH)
            if row.status == RecordStatus.COMPLETED.value:
                response = StoredResponse(
                    row.response_status, unpack_headers(row.response_headers), row.result_payload
                )
                return Claim(ClaimOutcome.REPLAY, response=response)
            if row.status == RecordStatus.UNREPLAYABLE.value:
                return Claim(ClaimOutcome.UNREPLAYABLE)
            return Claim(ClaimOutcome.IN_PROGRESS)

        return await self._transaction(claim_in)

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        statement = (
            update(records)
            .where(_owned(scope, key, token))
            .values(lease_expires_at=_NowMs() + int(lease * 1000))
        )
        return await self._changes_one_row(statement)

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        now = _NowMs()
        outcome: dict[str, Any] = (
            {"status": RecordStatus.UNREPLAYABLE.value}
            if response is None
            else {
                "status": RecordStatus.COMPLETED.value,
                "response_status": response.status,
                "response_headers": pack_headers(response.headers),
                "result_payload": response.body,
            }
        )
        statement = (
            update(records)
            .where(_owned(scope, key, token))
            .values(lease_expires_at=now, expires_at=now + int(ttl * 1000), **outcome)
        )
        return await self._changes_one_row(statement)

    async def release(self, scope: str, key: str, token: str) -> bool:
        return await self._changes_one_row(delete(records).where(_owned(scope, key, token)))

    async def purge_expired(self, *, batch_size: int) -> int | None:
        statement = _purge_statement(self._engine.dialect.name, batch_size)

        def purge(conn: Connection) -> int:
            return conn.execute(statement).rowcount

        return await self._transaction(purge, isolation_level="READ COMMITTED")

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

        await self._transaction(check)

    async def aclose(self) -> None:
        if self._owns_engine:
            await self._engine.dispose()

    async def _changes_one_row(self, statement: Any) -> bool:
        def execute(conn: Connection) -> bool:
            return conn.execute(statement).rowcount == 1

        return await self._transaction(execute)

    async def _transaction(
        self, operation: Callable[[Connection], T], isolation_level: str | None = None
    ) -> T:
        """Run ``operation`` in one transaction; driver failures become StoreError."""
        engine = self._engine
        if isolation_level is not None and engine.dialect.name != "sqlite":
            engine = engine.execution_options(isolation_level=isolation_level)
        try:
            async with asyncio.timeout(self._operation_timeout), engine.begin() as conn:
                return await conn.run_sync(operation)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc


def _purge_statement(dialect: str, batch_size: int) -> Any:
    """Delete at most ``batch_size`` expired rows, oldest first, in one statement."""
    if dialect in ("mysql", "mariadb"):
        # MariaDB takes no LIMIT in an IN subquery, but a single-table DELETE takes one.
        expired = delete(records).where(_expired(_NowMs()))
        return expired.with_dialect_options(mysql_limit=batch_size)
    # SKIP LOCKED lets concurrent purgers and claims pass each other on PostgreSQL instead of
    # waiting or deadlocking; SQLite, one writer at a time, ignores it.
    batch = (
        select(records.c.scope, records.c.key)
        .where(_expired(_NowMs()))
        .order_by(records.c.expires_at)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
    )
    return delete(records).where(tuple_(records.c.scope, records.c.key).in_(batch))


Upsert = Callable[[dict[str, Any], ColumnElement[bool]], Any]


def _upsert_on_conflict(dialect: Any) -> Upsert:
    def upsert(values: dict[str, Any], take_over: ColumnElement[bool]) -> Any:
        statement = dialect.insert(records).values(values)
        return statement.on_conflict_do_update(
            index_elements=[records.c.scope, records.c.key],
            set_={
                name: statement.excluded[name] for name in values if name not in ("scope", "key")
            },
            where=take_over,
        )

    return upsert


def _upsert_on_duplicate_key(values: dict[str, Any], take_over: ColumnElement[bool]) -> Any:
    # MySQL has no WHERE on ON DUPLICATE KEY UPDATE and applies assignments left to right:
    # the token is decided first, and every other column follows whether the token changed.
    statement = mysql.insert(records).values(values)
    new = statement.inserted
    assignments: list[tuple[str, Any]] = [("token", func.IF(take_over, new.token, records.c.token))]
    assignments += [
        (name, func.IF(records.c.token == new.token, new[name], records.c[name]))
        for name in values
        if name not in ("scope", "key", "token")
    ]
    return statement.on_duplicate_key_update(assignments)


_UPSERTS: dict[str, Upsert] = {
    "sqlite": _upsert_on_conflict(sqlite),
    "postgresql": _upsert_on_conflict(postgresql),
    "mysql": _upsert_on_duplicate_key,
    "mariadb": _upsert_on_duplicate_key,
}
