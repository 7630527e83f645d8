"""The operator's view of a store: one key's record, freeing a stuck key, counts of records.

Every function takes a store URL: a SQL database (its ``idempotency_records`` table, read
through SQLAlchemy Core) or Redis (the records a :class:`~idempotency_mw.RedisStore` with the
same ``prefix`` writes). Times are read from the store's clock, as the store itself reads them.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from idempotency_mw.exceptions import ConfigurationError, SchemaError, StoreError, describe
from idempotency_mw.records import RecordStatus

if TYPE_CHECKING:
    from sqlalchemy.engine import URL
    from sqlalchemy.ext.asyncio import AsyncConnection

    from idempotency_mw.stores.redis import RedisStore

DEFAULT_REDIS_PREFIX = "idem:"
_REDIS_SCHEMES = ("redis:", "rediss:", "unix:")


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server rather than a SQL database."""
    return url.startswith(_REDIS_SCHEMES)


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _time(ms: int | None) -> datetime | None:
    return None if ms is None else _utc(ms)


@dataclass(frozen=True, slots=True)
class RecordView:
    """One key's record as stored. ``created_at`` is ``None`` where the store keeps no such time
    (Redis); ``body`` is ``None`` unless it was asked for."""

    scope: str
    key: str
    status: RecordStatus
    request_hash: str
    created_at: datetime | None
    lease_expires_at: datetime
    expires_at: datetime
    response_status: int | None
    response_size: int | None
    body: bytes | None
    #: The store's clock when the record was read.
    now: datetime

    @property
    def expired(self) -> bool:
        """Past its TTL and not held by a live lease: treated as absent, awaiting the purge."""
        lease_held = self.status is RecordStatus.IN_PROGRESS and self.lease_expires_at > self.now
        return self.expires_at <= self.now and not lease_held


class ReleaseOutcome(enum.StrEnum):
    """What :func:`release` did."""

    RELEASED = "released"
    NOT_FOUND = "not_found"
    #: The record is completed (or not replayable) and ``force`` was not given.
    REFUSED = "refused"
    #: The record changed between the read and the delete (a request settled it): try again.
    CHANGED = "changed"


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """The outcome, and the record as it was found (``None`` when there was none)."""

    outcome: ReleaseOutcome
    record: RecordView | None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts of a store's records.

    ``expired`` (awaiting the purge) is ``None`` for Redis, which deletes records itself;
    ``oldest_in_progress`` is ``None`` when nothing is in progress or the store keeps no
    creation time (Redis); ``size_bytes`` is the table's (or keys') size where the store tells it.
    """

    by_status: Mapping[RecordStatus, int]
    expired: int | None
    oldest_in_progress: datetime | None
    size_bytes: int | None
    now: datetime

    @property
    def total(self) -> int:
        """All records, expired ones included."""
        return sum(self.by_status.values())


class _View(Protocol):
    async def read(self, scope: str, key: str, *, with_body: bool) -> tuple[RecordView, str] | None:
        """The record and its token, or ``None``."""
        ...

    async def delete(self, record: RecordView, token: str) -> bool:
        """Delete the record if it still holds ``token`` and its status."""
        ...

    async def stats(self) -> StoreStats: ...


async def inspect(
    url: str,
    key: str,
    *,
    scope: str = "",
    with_body: bool = False,
    prefix: str = DEFAULT_REDIS_PREFIX,
) -> RecordView | None:
    """The record of ``key`` in ``scope``, or ``None`` when the store has none."""
    async with _open(url, prefix) as view:
        found = await view.read(scope, key, with_body=with_body)
    return None if found is None else found[0]


async def release(
    url: str,
    key: str,
    *,
    scope: str = "",
    force: bool = False,
    prefix: str = DEFAULT_REDIS_PREFIX,
) -> ReleaseResult:
    """Delete the record of ``key`` so that its next request runs again.

    Only a record in progress is deleted, unless ``force`` (then a completed one too, whose
    response will no longer be replayed). The delete takes the record only as it was read,
    so a request that settles it meanwhile is never undone silently.
    """
    async with _open(url, prefix) as view:
        found = await view.read(scope, key, with_body=False)
        if found is None:
            return ReleaseResult(ReleaseOutcome.NOT_FOUND, None)
        record, token = found
        if record.status is not RecordStatus.IN_PROGRESS and not force:
            return ReleaseResult(ReleaseOutcome.REFUSED, record)
        deleted = await view.delete(record, token)
    return ReleaseResult(ReleaseOutcome.RELEASED if deleted else ReleaseOutcome.CHANGED, record)


async def stats(url: str, *, prefix: str = DEFAULT_REDIS_PREFIX) -> StoreStats:
    """How many records the store holds, by status, and how many await the purge."""
    async with _open(url, prefix) as view:
        return await view.stats()


@asynccontextmanager
async def _open(url: str, prefix: str) -> AsyncIterator[_View]:
    if is_redis_url(url):
        async with _redis_view(url, prefix) as redis_view:
            yield redis_view
    else:
        async with _sql_view(url) as sql_view:
            yield sql_view


# --- SQL ----------------------------------------------------------------------------------------


@asynccontextmanager
async def _sql_view(url: str) -> AsyncIterator[_SQLView]:
    from sqlalchemy import inspect as inspect_schema
    from sqlalchemy import make_url
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import NullPool

    from idempotency_mw.stores.sql import async_url
    from idempotency_mw.stores.sql.schema import TABLE_NAME

    database = async_url(url)
    _refuse_a_missing_sqlite_file(database)
    engine = create_async_engine(database, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            if not await conn.run_sync(lambda sync: inspect_schema(sync).has_table(TABLE_NAME)):
                shown = make_url(url).render_as_string(hide_password=True)
                raise SchemaError(
                    f"the table {TABLE_NAME!r} does not exist: run "
                    f"`idempotency-mw migrate --url {shown}`"
                )
            yield _SQLView(conn)
    except (SQLAlchemyError, OSError) as exc:
        raise StoreError(describe(exc)) from exc
    finally:
        await engine.dispose()


def _refuse_a_missing_sqlite_file(database: URL) -> None:
    # SQLite would create a missing file: an operator's typo must not make a new database.
    path = database.database
    in_a_file = database.get_backend_name() == "sqlite" and path not in (None, "", ":memory:")
    if in_a_file and not Path(str(path)).exists():
        raise ConfigurationError(f"no SQLite database at {path}")


class _SQLView:
    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def read(self, scope: str, key: str, *, with_body: bool) -> tuple[RecordView, str] | None:
        from sqlalchemy import func, select

        from idempotency_mw.stores.sql.schema import records
        from idempotency_mw.stores.sql.statements import NOW

        columns = [
            records.c.status,
            records.c.request_hash,
            records.c.created_at,
            records.c.lease_expires_at,
            records.c.expires_at,
            records.c.response_status,
            func.length(records.c.result_payload),
            NOW,
            records.c.token,
        ]
        if with_body:
            columns.append(records.c.result_payload)
        row = (await self._conn.execute(select(*columns).where(_key_is(scope, key)))).first()
        if row is None:
            return None
        status, request_hash, created, lease, expires, response_status, size, now, token = row[:9]
        view = RecordView(
            scope=scope,
            key=key,
            status=RecordStatus(status),
            request_hash=request_hash,
            created_at=_time(created),
            lease_expires_at=_utc(lease),
            expires_at=_utc(expires),
            response_status=response_status,
            response_size=size,
            body=bytes(row[9]) if with_body and row[9] is not None else None,
            now=_utc(now),
        )
        return view, token

    async def delete(self, record: RecordView, token: str) -> bool:
        from sqlalchemy import delete

        from idempotency_mw.stores.sql.schema import records

        result = await self._conn.execute(
            delete(records).where(
                _key_is(record.scope, record.key),
                records.c.token == token,
                records.c.status == record.status.value,
            )
        )
        await self._conn.commit()
        return bool(result.rowcount == 1)

    async def stats(self) -> StoreStats:
        from sqlalchemy import func, select

        from idempotency_mw.stores.sql.schema import records
        from idempotency_mw.stores.sql.statements import EXPIRED, NOW

        by_status: dict[RecordStatus, int] = dict.fromkeys(RecordStatus, 0)
        oldest: int | None = None
        rows = await self._conn.execute(
            select(records.c.status, func.count(), func.min(records.c.created_at)).group_by(
                records.c.status
            )
        )
        for status, count, first_created in rows:
            by_status[RecordStatus(status)] = count
            if status == RecordStatus.IN_PROGRESS:
                oldest = first_created
        expired_count = select(func.count()).select_from(records).where(EXPIRED)
        expired, now = (
            await self._conn.execute(select(expired_count.scalar_subquery(), NOW))
        ).one()
        return StoreStats(
            by_status=by_status,
            expired=expired,
            oldest_in_progress=_time(oldest),
            size_bytes=await self._size(),
            now=_utc(now),
        )

    async def _size(self) -> int | None:
        from sqlalchemy import text

        from idempotency_mw.stores.sql.schema import TABLE_NAME

        query = _SIZE_QUERIES.get(self._conn.dialect.name)
        if query is None:
            return None
        size = await self._conn.scalar(text(query), {"table": TABLE_NAME})
        return None if size is None else int(size)


def _key_is(scope: str, key: str) -> Any:
    from idempotency_mw.stores.sql.schema import records
    from idempotency_mw.stores.sql.store import stored_name

    return (records.c.scope == stored_name(scope)) & (records.c.key == stored_name(key))


_SIZE_QUERIES = {
    # Table, indexes and TOAST.
    "postgresql": "SELECT pg_total_relation_size(CAST(:table AS regclass))",
    # InnoDB's own estimate, refreshed by its statistics.
    "mysql": (
        "SELECT data_length + index_length FROM information_schema.tables "
        "WHERE table_schema = DATABASE() AND table_name = :table"
    ),
    "mariadb": (
        "SELECT data_length + index_length FROM information_schema.tables "
        "WHERE table_schema = DATABASE() AND table_name = :table"
    ),
    # The pages of the table and of its indexes.
    "sqlite": (
        "SELECT SUM(pgsize) FROM dbstat "
        "WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = :table)"
    ),
}


# --- Redis --------------------------------------------------------------------------------------

_RECORD_FIELDS = (
    "status",
    "token",
    "request_hash",
    "lease_expires_at",
    "expires_at",
    "response_status",
)

# KEYS[1] record; ARGV token, status. Deletes the record only as it was read.
_DELETE_AS_READ = """
local r = redis.call('HMGET', KEYS[1], 'token', 'status')
if r[1] ~= ARGV[1] or r[2] ~= ARGV[2] then return 0 end
return redis.call('DEL', KEYS[1])
"""


@asynccontextmanager
async def _redis_view(url: str, prefix: str) -> AsyncIterator[_RedisView]:
    from redis.exceptions import RedisError

    from idempotency_mw.stores.redis import RedisStore

    store = RedisStore(url, prefix=prefix)
    try:
        yield _RedisView(store)
    except (RedisError, OSError) as exc:
        raise StoreError(describe(exc)) from exc
    finally:
        await store.aclose()


class _RedisView:
    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._client = store.client

    async def read(self, scope: str, key: str, *, with_body: bool) -> tuple[RecordView, str] | None:
        redis_key = self._store.redis_key(scope, key)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hmget(redis_key, _RECORD_FIELDS)
            pipe.hstrlen(redis_key, "result_payload")
            pipe.time()
            if with_body:
                pipe.hget(redis_key, "result_payload")
            fields, size, (seconds, microseconds), *body = await pipe.execute()
        status, token, request_hash, lease, expires, response_status = (
            None if value is None else bytes(value).decode() for value in fields
        )
        if status is None or token is None:
            return None
        completed = status == RecordStatus.COMPLETED
        view = RecordView(
            scope=scope,
            key=key,
            status=RecordStatus(status),
            request_hash=request_hash or "",
            created_at=None,
            lease_expires_at=_utc(int(lease or 0)),
            expires_at=_utc(int(expires or 0)),
            response_status=int(response_status) if completed and response_status else None,
            response_size=size if completed else None,
            body=bytes(body[0]) if body and completed and body[0] is not None else None,
            now=_utc(int(seconds) * 1000 + int(microseconds) // 1000),
        )
        return view, token

    async def delete(self, record: RecordView, token: str) -> bool:
        redis_key = self._store.redis_key(record.scope, record.key)
        deleted = await self._client.eval(_DELETE_AS_READ, 1, redis_key, token, record.status.value)
        return bool(deleted)

    async def stats(self) -> StoreStats:
        by_status: dict[RecordStatus, int] = dict.fromkeys(RecordStatus, 0)
        size = 0

        async def count(keys: list[bytes]) -> None:
            nonlocal size
            async with self._client.pipeline(transaction=False) as pipe:
                for redis_key in keys:
                    pipe.hget(redis_key, "status")
                    pipe.memory_usage(redis_key)
                replies = await pipe.execute()
            for status, usage in zip(replies[::2], replies[1::2], strict=True):
                if status is not None:  # expired between the scan and the read
                    by_status[RecordStatus(bytes(status).decode())] += 1
                    size += usage or 0

        # The prefix is literal text: escape the glob characters it may contain.
        pattern = "".join(f"\\{char}" if char in "*?[]\\" else char for char in self._store.prefix)
        batch: list[bytes] = []
        async for redis_key in self._client.scan_iter(match=pattern + "*", count=1000):
            batch.append(redis_key)
            if len(batch) == 1000:
                await count(batch)
                batch = []
        await count(batch)
        seconds, microseconds = await self._client.time()
        return StoreStats(
            by_status=by_status,
            expired=None,
            oldest_in_progress=None,
            size_bytes=size,
            now=_utc(int(seconds) * 1000 + int(microseconds) // 1000),
        )
