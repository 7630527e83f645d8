"""SQLStore: idempotency records in a SQL table (SQLite, PostgreSQL, MariaDB/MySQL)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Row,
    and_,
    bindparam,
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


# Statements are built once, with bound parameters, so SQLAlchemy compiles each only once.
_NOW = _NowMs()
_IN_PROGRESS = RecordStatus.IN_PROGRESS.value
_KEY_IS = and_(records.c.scope == bindparam("p_scope"), records.c.key == bindparam("p_key"))
_OWNED = and_(_KEY_IS, records.c.token == bindparam("p_token"), records.c.status == _IN_PROGRESS)
#: Past its TTL and not held by a live lease.
_EXPIRED = and_(
    records.c.expires_at <= _NOW,
    or_(records.c.status != _IN_PROGRESS, records.c.lease_expires_at <= _NOW),
)
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
        dialect = self._engine.dialect.name
        self._take = _TAKES[dialect]
        # Single statements run in autocommit: no BEGIN/COMMIT round trips. Only MariaDB/MySQL's
        # claim needs a transaction (its upsert cannot return the winner).
        self._autocommit = self._engine.execution_options(isolation_level="AUTOCOMMIT")
        self._take_engine = (
            self._engine if self._take is _TAKE_ON_DUPLICATE_KEY else self._autocommit
        )
        # READ COMMITTED spares MariaDB's purge gap locks that would stall concurrent claims.
        self._purge_engine = (
            self._autocommit
            if dialect == "sqlite"
            else self._engine.execution_options(isolation_level="READ COMMITTED")
        )

    @property
    def engine(self) -> AsyncEngine:
        """The engine the store runs on."""
        return self._engine

    async def claim(
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float
    ) -> Claim:
        token = uuid.uuid4().hex
        params = {
            "p_scope": scope,
            "p_key": key,
            "p_fingerprint": fingerprint,
            "p_token": token,
            "p_ttl_ms": int(ttl * 1000),
            "p_lease_ms": int(lease * 1000),
        }
        take = self._take

        def read(conn: Connection) -> Claim | None:
            return _outcome_of(conn.execute(_READ, params).one_or_none(), fingerprint)

        def take_over(conn: Connection) -> bool:
            return take(conn, params)

        # A record the read finds live decides the outcome without a write (a replay is one
        # statement). Otherwise the atomic upsert decides; if another request won it in between,
        # the next read sees that request's record.
        for _ in range(3):
            existing = await self._run(read)
            if existing is not None:
                return existing
            if await self._run(take_over, self._take_engine):
                return Claim(ClaimOutcome.ACQUIRED, token=token)
        raise StoreError(f"the record of a key kept changing while it was claimed ({TABLE_NAME})")

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        params = {"p_scope": scope, "p_key": key, "p_token": token, "p_lease_ms": int(lease * 1000)}
        return await self._changes_one_row(_RENEW, params)

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        params: dict[str, Any] = {
            "p_scope": scope,
            "p_key": key,
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
        return await self._changes_one_row(_COMPLETE, params)

    async def release(self, scope: str, key: str, token: str) -> bool:
        params = {"p_scope": scope, "p_key": key, "p_token": token}
        return await self._changes_one_row(_RELEASE, params)

    async def purge_expired(self, *, batch_size: int) -> int | None:
        statement = _purge_statement(self._engine.dialect.name, batch_size)

        def purge(conn: Connection) -> int:
            return conn.execute(statement).rowcount

        return await self._run(purge, self._purge_engine)

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

        await self._run(check)

    async def aclose(self) -> None:
        if self._owns_engine:
            await self._engine.dispose()

    async def _changes_one_row(self, statement: Any, params: dict[str, Any]) -> bool:
        def execute(conn: Connection) -> bool:
            return conn.execute(statement, params).rowcount == 1

        return await self._run(execute)

    async def _run(
        self, operation: Callable[[Connection], T], engine: AsyncEngine | None = None
    ) -> T:
        """Run ``operation`` on one connection (autocommit unless ``engine`` says otherwise).

        Driver failures and timeouts become StoreError.
        """
        try:
            async with (
                asyncio.timeout(self._operation_timeout),
                (engine or self._autocommit).begin() as conn,
            ):
                return await conn.run_sync(operation)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc


def _outcome_of(row: Row[Any] | None, fingerprint: str) -> Claim | None:
    """The outcome a live record decides, or ``None`` when the key is free to claim."""
    if row is None or row.free:
        return None
    if row.request_hash != fingerprint:
        return Claim(ClaimOutcome.MISMATCH)
    if row.status == RecordStatus.COMPLETED.value:
        headers = unpack_headers(row.response_headers)
        response = StoredResponse(row.response_status, headers, row.result_payload)
        return Claim(ClaimOutcome.REPLAY, response=response)
    if row.status == RecordStatus.UNREPLAYABLE.value:
        return Claim(ClaimOutcome.UNREPLAYABLE)
    return Claim(ClaimOutcome.IN_PROGRESS)


def _purge_statement(dialect: str, batch_size: int) -> Any:
    """Delete at most ``batch_size`` expired rows, oldest first, in one statement."""
    if dialect in ("mysql", "mariadb"):
        # MariaDB takes no LIMIT in an IN subquery, but a single-table DELETE takes one.
        expired = delete(records).where(_EXPIRED)
        return expired.with_dialect_options(mysql_limit=batch_size)
    # SKIP LOCKED lets concurrent purgers and claims pass each other on PostgreSQL instead of
    # waiting or deadlocking; SQLite, one writer at a time, ignores it.
    batch = (
        select(records.c.scope, records.c.key)
        .where(_EXPIRED)
        .order_by(records.c.expires_at)
        .limit(batch_size)
        .with_for_update(skip_locked=True)
    )
    return delete(records).where(tuple_(records.c.scope, records.c.key).in_(batch))


Take = Callable[[Connection, dict[str, Any]], bool]


def _take_returning(dialect: Any) -> Take:
    """INSERT ... ON CONFLICT DO UPDATE ... WHERE ... RETURNING: one atomic statement."""
    insert = dialect.insert(records).values(_NEW_RECORD)
    statement = insert.on_conflict_do_update(
        index_elements=[records.c.scope, records.c.key],
        set_={name: insert.excluded[name] for name in _NEW_RECORD if name not in _KEY},
        where=_CAN_TAKE_OVER,
    ).returning(records.c.token)

    def take(conn: Connection, params: dict[str, Any]) -> bool:
        return bool(conn.execute(statement, params).scalar_one_or_none() == params["p_token"])

    return take


def _take_on_duplicate_key() -> Take:
    # MySQL has no WHERE on ON DUPLICATE KEY UPDATE and applies assignments left to right:
    # the token is decided first, and every other column follows whether the token changed.
    # Without RETURNING, a read in the same transaction (the row stays locked) tells the winner.
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

    def take(conn: Connection, params: dict[str, Any]) -> bool:
        conn.execute(upsert, params)
        return bool(conn.execute(_WINNER, params).scalar_one() == params["p_token"])

    return take


_KEY = ("scope", "key")
_TAKE_ON_DUPLICATE_KEY = _take_on_duplicate_key()
_TAKES: dict[str, Take] = {
    "sqlite": _take_returning(sqlite),
    "postgresql": _take_returning(postgresql),
    "mysql": _TAKE_ON_DUPLICATE_KEY,
    "mariadb": _TAKE_ON_DUPLICATE_KEY,
}
