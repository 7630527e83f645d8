"""The statements every dialect shares: reading a record, and renewing, settling, purging it.

Statements are built once, with bound parameters, so each is compiled only once. Times come
from the database server's clock, in milliseconds since the Unix epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Table,
    and_,
    bindparam,
    delete,
    func,
    literal_column,
    not_,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import (
    ClauseElement,
    ColumnElement,
    Delete,
    Executable,
    FunctionElement,
    Select,
    Update,
)
from sqlalchemy.types import BigInteger, Integer

from idempotency_mw.stores.sql.schema import records
from idempotency_mw.values.outcome import Fenced, Found
from idempotency_mw.values.records import RecordStatus, StoredResponse, unpack_headers


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


NOW = _NowMs()
IN_PROGRESS = RecordStatus.IN_PROGRESS.value
KEY_COLUMNS = ("scope", "key")
KEY_IS = and_(records.c.scope == bindparam("p_scope"), records.c.key == bindparam("p_key"))
#: In progress under this request's token.
MINE = and_(records.c.status == IN_PROGRESS, records.c.token == bindparam("p_token"))
#: Past its TTL and not held by a live lease: as good as absent.
EXPIRED = and_(
    records.c.expires_at <= NOW,
    or_(records.c.status != IN_PROGRESS, records.c.lease_expires_at <= NOW),
)
#: Still in progress under this token, and not yet as good as absent.
OWNED = and_(KEY_IS, MINE, not_(EXPIRED))
#: The credentials the record is bound to ('' for none).
BINDING = records.c.caller_binding
#: Expired (any request may take it), or the same request's lease lapsed before it committed
#: an effect.
CAN_TAKE_OVER = or_(
    EXPIRED,
    and_(
        records.c.status == IN_PROGRESS,
        records.c.lease_expires_at <= NOW,
        records.c.request_hash == bindparam("p_fingerprint"),
        bindparam("p_binding") == BINDING,
        records.c.committed_at.is_(None),
    ),
)
#: The columns of a record just claimed.
NEW_RECORD: dict[str, Any] = {
    "scope": bindparam("p_scope"),
    "key": bindparam("p_key"),
    "request_hash": bindparam("p_fingerprint"),
    "status": IN_PROGRESS,
    "token": bindparam("p_token"),
    "created_at": NOW,
    "lease_expires_at": NOW + bindparam("p_lease_ms", type_=BigInteger),
    "expires_at": NOW + bindparam("p_ttl_ms", type_=BigInteger),
    "response_status": None,
    "response_headers": None,
    "result_payload": None,
    "caller_binding": bindparam("p_binding"),
    "committed_at": None,
}
#: In progress, its effect committed, and its lease lapsed for the first time since its holder
#: last renewed it, found by the same request of the same caller: a claim answers it
#: in-progress and puts it on probation (:data:`PROBATION`).
PROBATION_DUE = and_(
    records.c.status == IN_PROGRESS,
    records.c.committed_at > 0,
    records.c.lease_expires_at <= NOW,
    records.c.request_hash == bindparam("p_fingerprint"),
    bindparam("p_binding") == BINDING,
    not_(EXPIRED),
)
#: The clock a record is read by, one row: joined to the record (if any), what decide() takes.
_CLOCK = select(NOW.label("clock_ms")).subquery("clock")
#: A key's record as a claim or a lookup reads it, the clock first (:func:`found_of`): one row,
#: the record's columns NULL when there is none.
READ = select(
    _CLOCK.c.clock_ms,
    records.c.request_hash,
    records.c.status,
    records.c.token,
    records.c.lease_expires_at,
    records.c.expires_at,
    BINDING.label("binding"),
    records.c.committed_at,
    records.c.response_status,
    records.c.response_headers,
    records.c.result_payload,
).select_from(_CLOCK.outerjoin(records, KEY_IS))
#: Not first sent longer ago than the claim's ttl, nor ahead of the skew (``p_first_sent_ms``
#: NULL: it did not say): decide()'s rule, for a take made in the same statement.
FRESH = or_(
    bindparam("p_first_sent_ms", type_=BigInteger).is_(None),
    and_(
        bindparam("p_first_sent_ms", type_=BigInteger)
        >= NOW - bindparam("p_ttl_ms", type_=BigInteger),
        bindparam("p_first_sent_ms", type_=BigInteger)
        <= NOW + bindparam("p_skew_ms", type_=BigInteger),
    ),
)


def found_of(row: Sequence[Any]) -> tuple[Found | None, float]:
    """The record and the clock (seconds) of a row of :data:`READ`."""
    clock_ms, request_hash, status, token, lease_ms, expires_ms, binding, committed_at = row[:8]
    if status is None:
        return None, clock_ms / 1000
    response = None
    if status == RecordStatus.COMPLETED.value:
        response_status, headers, payload = row[8:11]
        response = StoredResponse(response_status, unpack_headers(headers), bytes(payload))
    found = Found(
        RecordStatus(status),
        request_hash,
        token,
        binding,
        lease_ms / 1000,
        expires_ms / 1000,
        _fenced(committed_at),
        response,
    )
    return found, clock_ms / 1000


def _fenced(committed_at: int | None) -> Fenced:
    """A committed effect's mark. A record whose lease lapsed once after its effect committed
    is given one more lease by a claim (its holder may still be alive behind a store that
    stalled): ``committed_at`` is negated while on probation, and made positive again by the
    holder's renewal or settlement."""
    if committed_at is None:
        return Fenced.NO
    return Fenced.ON_PROBATION if committed_at < 0 else Fenced.COMMITTED


#: The record's holder given one more lease, on probation: one statement whose condition
#: decides, so of concurrent claims that found it due exactly one grants it.
PROBATION = (
    update(records)
    .where(KEY_IS, PROBATION_DUE)
    .values(
        lease_expires_at=NOW + bindparam("p_lease_ms", type_=BigInteger),
        committed_at=-records.c.committed_at,
    )
)
#: A committed effect's mark with its probation ended (the holder was heard from).
_COMMITTED_AT = func.abs(records.c.committed_at)
WINNER = select(records.c.token).where(KEY_IS)
#: A caller's look at its key's record (one bound to other credentials is not found), with
#: the clock it is read by.
LOOKUP = READ.where(bindparam("p_binding") == BINDING)
RENEW = (
    update(records)
    .where(OWNED)
    .values(
        lease_expires_at=NOW + bindparam("p_lease_ms", type_=BigInteger),
        committed_at=_COMMITTED_AT,
    )
)
#: Still in progress under this token, or already settled by this very completion (its own
#: earlier delivery, whose reply was lost): either way it answers one row.
COMPLETE = (
    update(records)
    .where(
        KEY_IS,
        records.c.token == bindparam("p_token"),
        records.c.status.in_([IN_PROGRESS, bindparam("p_status")]),
        not_(EXPIRED),
    )
    .values(
        status=bindparam("p_status"),
        response_status=bindparam("p_response_status"),
        response_headers=bindparam("p_response_headers"),
        result_payload=bindparam("p_result_payload"),
        lease_expires_at=NOW,
        expires_at=NOW + bindparam("p_ttl_ms", type_=BigInteger),
        committed_at=_COMMITTED_AT,
    )
)
#: A claim given up before its effect was committed: gone, so a retry runs.
RELEASE = delete(records).where(OWNED, records.c.committed_at.is_(None))
#: A claim given up after its effect was committed: it never runs again.
RELEASE_COMMITTED = (
    update(records)
    .where(OWNED, records.c.committed_at.is_not(None))
    .values(status=RecordStatus.COMMITTED.value, lease_expires_at=NOW, committed_at=_COMMITTED_AT)
)
#: The channel on which PostgreSQL announces settled records; the payload is a key's digest.
SETTLED_CHANNEL = "idempotency_mw_settled"


def announced(change: Update | Delete) -> Select[Any]:
    """``change`` and, in the same statement, a NOTIFY of ``p_digest`` if it changed the record
    (PostgreSQL): one row per row changed, and no extra round trip."""
    changed = change.returning(literal_column("1")).cte("changed")
    return select(func.pg_notify(SETTLED_CHANNEL, bindparam("p_digest"))).select_from(changed)


@dataclass(frozen=True)
class Settling:
    """A dialect's statements that settle a record. When they ``announce`` it, each notifies
    the settlement feeds too (given ``p_digest``) and answers one row per row it changed."""

    complete: Executable
    release: Executable
    release_committed: Executable
    announce: bool = False


#: Each dialect's settling statements (the others announce nothing).
SETTLING = {
    "postgresql": Settling(
        announced(COMPLETE), announced(RELEASE), announced(RELEASE_COMMITTED), announce=True
    )
}
SILENT = Settling(COMPLETE, RELEASE, RELEASE_COMMITTED)

#: A fenced commit: inside the application's own transaction, this request's claim (still in
#: progress under its token) marks its effect as committed, and keeps the record a TTL from
#: the commit, as a proof of the proof table lives: kept from its claim, a record fenced late in
#: its TTL would expire, and be taken over, soon after the effect committed.
FENCE = (
    update(records)
    .where(KEY_IS, MINE)
    .values(committed_at=NOW, expires_at=NOW + bindparam("p_ttl_ms", type_=BigInteger))
)
_REFENCED = {**NEW_RECORD, "committed_at": NOW}
#: A fenced commit whose claim's record is gone (a claim not flushed before a crash, a record
#: purged): the record written again as this token's, its effect committed, unless any record
#: of the key is there (then the key is another request's).
REFENCE: dict[str, Executable] = {
    "sqlite": sqlite.insert(records).values(_REFENCED).on_conflict_do_nothing(),
    "postgresql": postgresql.insert(records).values(_REFENCED).on_conflict_do_nothing(),
    "mysql": mysql.insert(records).values(_REFENCED).prefix_with("IGNORE"),
    "mariadb": mysql.insert(records).values(_REFENCED).prefix_with("IGNORE"),
}

_BATCH = bindparam("p_batch_size", type_=Integer)


class DeleteLimit(Executable, ClauseElement):
    """``DELETE ... LIMIT :p_batch_size``: MariaDB takes no LIMIT in an IN subquery.

    SQLAlchemy's own ``mysql_limit`` writes the number into the SQL, so every batch size would
    be a statement of its own; the MySQL drivers fill in a bound LIMIT like any parameter.
    """

    inherit_cache = True

    def __init__(self, statement: Delete) -> None:
        self.statement = statement


@compiles(DeleteLimit)
def _compile_delete_limit(element: DeleteLimit, compiler: SQLCompiler, **kw: Any) -> str:
    return f"{compiler.process(element.statement, **kw)} LIMIT {compiler.process(_BATCH, **kw)}"


def purges_of(table: Table, expired: ColumnElement[bool]) -> dict[str, Executable]:
    """Each dialect's purge of ``table`` (keyed by scope and key, expiring at ``expires_at``):
    at most ``p_batch_size`` rows that are ``expired``.

    PostgreSQL and SQLite delete the oldest first; SKIP LOCKED lets concurrent purgers and
    claims pass each other on PostgreSQL instead of waiting or deadlocking (SQLite, one writer
    at a time, ignores it). MariaDB/MySQL delete in no order.
    """
    oldest = delete(table).where(
        tuple_(table.c.scope, table.c.key).in_(
            select(table.c.scope, table.c.key)
            .where(expired)
            .order_by(table.c.expires_at)
            .limit(_BATCH)
            .with_for_update(skip_locked=True)
        )
    )
    limited = DeleteLimit(delete(table).where(expired))
    return {"sqlite": oldest, "postgresql": oldest, "mysql": limited, "mariadb": limited}


#: Each dialect's purge of expired records, run with ``p_batch_size``.
PURGES = purges_of(records, EXPIRED)
#: The same, of one scope's records only (``p_scope``).
SCOPED_PURGES = purges_of(records, and_(EXPIRED, records.c.scope == bindparam("p_scope")))
