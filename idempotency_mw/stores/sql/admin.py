"""SQLStore's :class:`~idempotency_mw.stores.base.Inspectable` half: the operator's reads and
deletes of the table, run through the store's own engine and timeout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import bindparam, delete, func, select, text
from sqlalchemy.types import Integer

from idempotency_mw.stores.sql.schema import TABLE_NAME, records, stored_name
from idempotency_mw.stores.sql.statements import EXPIRED, KEY_IS, NOW
from idempotency_mw.values.records import (
    RecordStatus,
    RecordView,
    StoreStats,
    pair_of,
    pair_ref,
    record_version,
    utc_ms,
)

if TYPE_CHECKING:
    from idempotency_mw.stores.sql.database import Database

T = TypeVar("T")

_COLUMNS = (
    records.c.scope,
    records.c.key,
    records.c.status,
    records.c.token,
    records.c.committed_at.is_not(None).label("fenced"),
    records.c.request_hash,
    records.c.created_at,
    records.c.lease_expires_at,
    records.c.expires_at,
    records.c.response_status,
    func.length(records.c.result_payload),
    NOW,
)
_LIMIT = bindparam("p_limit", type_=Integer)
_FIND = select(*_COLUMNS).where(KEY_IS)
_FIND_WITH_BODY = select(*_COLUMNS, records.c.result_payload).where(KEY_IS)
_LIST = (
    select(*_COLUMNS)
    .where(records.c.status == bindparam("p_status"))
    .order_by(records.c.lease_expires_at)
    .limit(_LIMIT)
)
_SCOPES = (
    select(records.c.scope)
    .where(records.c.key == bindparam("p_key"))
    .order_by(records.c.scope)
    .limit(_LIMIT)
)
_AS_READ = (
    KEY_IS,
    records.c.token == bindparam("p_token"),
    records.c.status == bindparam("p_status"),
)
#: The record as it was read: same claim, same status, and fenced or not as it was.
_DELETE = {
    False: delete(records).where(*_AS_READ, records.c.committed_at.is_(None)),
    True: delete(records).where(*_AS_READ, records.c.committed_at.is_not(None)),
}
_COUNTS = select(
    records.c.status,
    func.count(),
    func.count(records.c.committed_at),
    func.min(records.c.created_at),
).group_by(records.c.status)
_EXPIRED_AND_NOW = select(
    select(func.count()).select_from(records).where(EXPIRED).scalar_subquery(), NOW
)
_MYSQL_SIZE = text(
    # InnoDB's own estimate, refreshed by its statistics.
    "SELECT data_length + index_length FROM information_schema.tables "
    "WHERE table_schema = DATABASE() AND table_name = :p_table"
)
_SIZES = {
    # Table, indexes and TOAST.
    "postgresql": text("SELECT pg_total_relation_size(CAST(:p_table AS regclass))"),
    "mysql": _MYSQL_SIZE,
    "mariadb": _MYSQL_SIZE,
    # The pages of the table and of its indexes.
    "sqlite": text(
        "SELECT SUM(pgsize) FROM dbstat "
        "WHERE name IN (SELECT name FROM sqlite_master WHERE tbl_name = :p_table)"
    ),
}


class SQLInspection:
    """Inspection for :class:`~idempotency_mw.stores.sql.SQLStore` (mixed into it)."""

    _database: Database

    if TYPE_CHECKING:

        async def _call(self, operation: str, call: Callable[[float], Awaitable[T]]) -> T: ...

    def record_ref(self, scope: str, key: str) -> str:
        return pair_ref(stored_name(scope), stored_name(key))

    async def find_record(self, ref: str, *, with_body: bool = False) -> RecordView | None:
        statement = _FIND_WITH_BODY if with_body else _FIND
        rows = await self._call(
            "inspect", lambda ends: self._database.fetch(statement, _key_of(ref), deadline=ends)
        )
        return _view(rows[0], with_body=with_body) if rows else None

    async def list_records(self, status: RecordStatus, *, limit: int) -> list[RecordView]:
        params = {"p_status": status.value, "p_limit": limit}
        rows = await self._call(
            "list", lambda ends: self._database.fetch(_LIST, params, deadline=ends)
        )
        return [_view(row, with_body=False) for row in rows]

    async def scopes_of(self, key: str, *, limit: int) -> list[str] | None:
        params = {"p_key": stored_name(key), "p_limit": limit}
        return [
            row[0]
            for row in await self._call(
                "inspect", lambda ends: self._database.fetch(_SCOPES, params, deadline=ends)
            )
        ]

    async def force_release(self, record: RecordView) -> bool:
        rows = await self._call(
            "inspect", lambda ends: self._database.fetch(_FIND, _key_of(record.ref), deadline=ends)
        )
        if not rows:
            return False
        token, fenced = rows[0][3], bool(rows[0][4])
        status = RecordStatus(rows[0][2])
        if record_version(token, status, fenced) != record.version:
            return False
        params = {**_key_of(record.ref), "p_token": token, "p_status": status.value}
        return (
            await self._call(
                "release",
                lambda ends: self._database.change(_DELETE[fenced], params, deadline=ends),
            )
            == 1
        )

    async def record_stats(self) -> StoreStats:
        by_status: dict[RecordStatus, int] = dict.fromkeys(RecordStatus, 0)
        fenced = 0
        oldest: int | None = None
        for status, count, fenced_count, first_created in await self._call(
            "stats", lambda ends: self._database.fetch(_COUNTS, {}, deadline=ends)
        ):
            by_status[RecordStatus(status)] = count
            fenced += fenced_count
            if status == RecordStatus.IN_PROGRESS:
                oldest = first_created
        ((expired, now),) = await self._call(
            "stats", lambda ends: self._database.fetch(_EXPIRED_AND_NOW, {}, deadline=ends)
        )
        size_query = _SIZES.get(self._database.dialect_name)
        size = None
        if size_query is not None:
            rows = await self._call(
                "stats",
                lambda ends: self._database.fetch(
                    size_query, {"p_table": TABLE_NAME}, deadline=ends
                ),
            )
            size = None if not rows or rows[0][0] is None else int(rows[0][0])
        return StoreStats(
            by_status=by_status,
            fenced=fenced,
            expired=expired,
            oldest_in_progress=None if oldest is None else utc_ms(oldest),
            size_bytes=size,
            now=utc_ms(now),
        )


def _key_of(ref: str) -> dict[str, str]:
    scope, key = pair_of(ref, "SQLStore")
    return {"p_scope": scope, "p_key": key}


def _view(row: Sequence[Any], *, with_body: bool) -> RecordView:
    (scope, key, status, token, fenced, request_hash, created, lease, expires) = row[:9]
    response_status, size, now = row[9:12]
    state = RecordStatus(status)
    return RecordView(
        ref=pair_ref(scope, key),
        scope=scope,
        key=key,
        status=state,
        fenced=bool(fenced),
        request_hash=request_hash,
        created_at=utc_ms(created),
        lease_expires_at=utc_ms(lease),
        expires_at=utc_ms(expires),
        response_status=response_status,
        response_size=size,
        body=bytes(row[12]) if with_body and row[12] is not None else None,
        now=utc_ms(now),
        version=record_version(token, state, bool(fenced)),
    )
