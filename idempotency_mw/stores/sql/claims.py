"""How each dialect claims a key: one class per dialect, each with the SQL it sends.

Every class answers one attempt at a claim: it reads the record with the database's clock and
hands them to :func:`~idempotency_mw.values.outcome.decide`, and takes the key with one atomic
upsert only when that says the key is free. Of concurrent requests that all found the key free, the
upsert's condition (decide()'s rule, checked on the latest committed row) lets exactly one take
it; the others read again.

A record whose effect was committed and whose lease lapsed is put on probation by one
conditional UPDATE (:data:`PROBATION`), whose condition decides: the claim that changed it
answers in progress; one that changed nothing (another claim, or the holder, changed the
record first) reads it again in its next attempt.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, and_, bindparam, cast, exists, func, literal_column, null, select
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.sql.expression import Executable

from idempotency_mw.stores.sql.database import Database as Driver
from idempotency_mw.stores.sql.schema import records
from idempotency_mw.stores.sql.statements import (
    CAN_TAKE_OVER,
    FRESH,
    KEY_COLUMNS,
    NEW_RECORD,
    NOW,
    PROBATION,
    READ,
    WINNER,
    found_of,
)
from idempotency_mw.values.outcome import Asking, decide
from idempotency_mw.values.records import Claim, ClaimOutcome

Row = Sequence[Any]


class ClaimSQL(abc.ABC):
    """One dialect's claim."""

    #: The statements it sends.
    statements: tuple[Executable, ...]

    @abc.abstractmethod
    async def attempt(
        self,
        driver: Driver,
        params: dict[str, Any],
        asking: Asking,
        deadline: float,
        *,
        durable: bool,
    ) -> Claim | None:
        """The claim's answer, or ``None`` when the record changed under it (read again);
        ``durable``: whether its write must wait for its own flush."""


def _upsert_returning(dialect: Any, rows: Any, *, also: Any = None) -> Any:
    """INSERT ``rows`` ON CONFLICT DO UPDATE ... WHERE ... (and ``also``) RETURNING."""
    insert = dialect.insert(records).from_select(NEW_RECORD, rows)
    return insert.on_conflict_do_update(
        index_elements=[records.c.scope, records.c.key],
        set_={name: insert.excluded[name] for name in NEW_RECORD if name not in KEY_COLUMNS},
        where=CAN_TAKE_OVER if also is None else and_(CAN_TAKE_OVER, also),
    ).returning(records.c.token)


def _new_record(where: Any) -> Any:
    """The new record's row, where ``where`` holds."""
    return select(
        *(
            cast(null() if value is None else value, records.c[name].type).label(name)
            for name, value in NEW_RECORD.items()
        )
    ).where(where)


class ReadThenTake(ClaimSQL):
    """A dialect whose claim reads the record first, and sends its upsert only when the read
    decides the key is free (a replay is one statement)."""

    async def attempt(
        self,
        driver: Driver,
        params: dict[str, Any],
        asking: Asking,
        deadline: float,
        *,
        durable: bool,
    ) -> Claim | None:
        rows = await driver.fetch(READ, params, deadline=deadline)
        decision = decide(*found_of(rows[0]), asking)
        if decision.take:
            winner = await self.take(driver, params, deadline, durable=durable)
            if winner and winner[0][0] == asking.token:
                return Claim(ClaimOutcome.ACQUIRED, token=asking.token)
            return None  # another claim took the key first
        if decision.probation and not await driver.change(
            PROBATION, params, deadline=deadline, durable=durable
        ):
            return None
        return decision.claim(asking.token)

    @abc.abstractmethod
    async def take(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> Sequence[Row]:
        """The upsert; the rows that name the record's token after it."""


class SQLiteClaim(ReadThenTake):
    """SQLite: a read, and only when decide() finds the key free, an upsert::

        SELECT now, request_hash, status, token, ... FROM (SELECT now) AS clock
          LEFT OUTER JOIN idempotency_records ON scope = :scope AND key = :key;
        INSERT INTO idempotency_records (...)
          SELECT :scope, :key, ..., :token, now, now + :lease, ... WHERE now < :until
          ON CONFLICT (scope, key) DO UPDATE SET ... = excluded....
          WHERE <expired, or the same request's lease lapsed> AND now < :until
          RETURNING token;

    The request took the key when the returned token is its own. A live record the read
    found due for probation is put on it instead of the upsert (see the module).

    ``until`` is when the caller stops waiting: a statement runs in the driver's thread, and
    one that waited there for the lock past that moment changes nothing, so a claim answered
    as failed never takes the key afterwards. SQLite is in the process: its ``now`` is the
    system clock, which ``until`` is read from too.
    """

    def __init__(self) -> None:
        in_time = bindparam("p_until_ms", type_=BigInteger) > NOW
        self._upsert = _upsert_returning(sqlite, _new_record(in_time), also=in_time)
        self.statements = (READ, PROBATION, self._upsert)

    async def take(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> Sequence[Row]:
        # The deadline on the system clock, read as SQLite's now() reads it: from the OS, not
        # through time.time(), which a test (or a tool) may replace without SQLite seeing it.
        until = datetime.now(UTC).timestamp() + deadline - time.monotonic()
        params = {**params, "p_until_ms": int(until * 1000)}
        return await driver.fetch(self._upsert, params, deadline=deadline, durable=durable)


class PostgreSQLClaim(ClaimSQL):
    """PostgreSQL: the read and, when it finds no live record, the upsert, in one statement::

        WITH existing AS (SELECT now, request_hash, ..., free FROM (SELECT now) AS clock
                          LEFT OUTER JOIN idempotency_records ON <the key>),
             taken AS (INSERT INTO idempotency_records (...)
                       SELECT :scope, :key, ... WHERE NOT EXISTS
                           (SELECT free FROM existing WHERE NOT free) AND <first sent fresh>
                       ON CONFLICT (scope, key) DO UPDATE SET ... = excluded....
                       WHERE <expired, or the same request's lease lapsed>
                         AND <first sent fresh>
                       RETURNING token),
             probation AS (UPDATE idempotency_records SET lease_expires_at = ...,
                           committed_at = -committed_at WHERE ... <due> RETURNING 1)
        SELECT now, request_hash, ..., (SELECT token FROM taken),
               EXISTS (SELECT * FROM probation) FROM existing;

    All parts see one snapshot; the upsert's and the update's WHERE still decide on the latest
    committed row. The first-sent time is judged in the statement, since it takes the key
    without asking decide() first; decide() then reads what it did not take.
    """

    def __init__(self) -> None:
        existing = READ.add_columns(CAN_TAKE_OVER.label("free")).cte("existing")
        live = exists(select(existing.c.free).where(~existing.c.free))
        new_record = _new_record(and_(~live, FRESH))
        taken = _upsert_returning(postgresql, new_record, also=FRESH).cte("taken")
        probation = PROBATION.returning(literal_column("1").label("granted")).cte("probation")
        self._statement: Executable = select(
            *list(existing.c)[:-1],
            select(taken.c.token).scalar_subquery(),
            exists(select(probation.c.granted)),
        ).select_from(existing)
        self.statements = (self._statement,)

    async def attempt(
        self,
        driver: Driver,
        params: dict[str, Any],
        asking: Asking,
        deadline: float,
        *,
        durable: bool,
    ) -> Claim | None:
        rows = await driver.fetch(self._statement, params, deadline=deadline, durable=durable)
        *read, token, granted = rows[0]
        if token == asking.token:
            return Claim(ClaimOutcome.ACQUIRED, token=token)
        decision = decide(*found_of(read), asking)
        if decision.take or (decision.probation and not granted):
            return None  # another step changed the record first
        return decision.claim(asking.token)


class MySQLClaim(ReadThenTake):
    """MariaDB/MySQL: a read (SQLite's), and only when decide() finds the key free, an upsert
    and a read of the winner::

        INSERT INTO idempotency_records (...) VALUES (..., :token, ...)
          ON DUPLICATE KEY UPDATE
            token = IF(<expired, or the same request's lease lapsed>, VALUES(token), token),
            request_hash = IF(token = VALUES(token), VALUES(request_hash), request_hash), ...;
        SELECT token FROM idempotency_records WHERE scope = :scope AND key = :key;

    MySQL has no WHERE on ON DUPLICATE KEY UPDATE and applies assignments left to right: the
    token is decided first, and every other column follows whether the token changed. No
    transaction is needed: a record that holds this request's fresh token is this request's
    (only the token's owner can release it, and no one can take it over while its lease runs).
    A record the read found due for probation is put on it instead (see the module).
    """

    def __init__(self) -> None:
        insert = mysql.insert(records).values(NEW_RECORD)
        new = insert.inserted
        assignments: list[tuple[str, Any]] = [
            ("token", func.IF(CAN_TAKE_OVER, new.token, records.c.token))
        ]
        assignments += [
            (name, func.IF(records.c.token == new.token, new[name], records.c[name]))
            for name in NEW_RECORD
            if name not in (*KEY_COLUMNS, "token")
        ]
        self._upsert = insert.on_duplicate_key_update(assignments)
        self.statements = (READ, PROBATION, self._upsert, WINNER)

    async def take(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> Sequence[Row]:
        await driver.change(self._upsert, params, deadline=deadline, durable=durable)
        return await driver.fetch(WINNER, params, deadline=deadline)


_MYSQL = MySQLClaim()
#: Each dialect's claim, built once (so its statements are compiled once per connection).
CLAIMS: dict[str, ClaimSQL] = {
    "sqlite": SQLiteClaim(),
    "postgresql": PostgreSQLClaim(),
    "mysql": _MYSQL,
    "mariadb": _MYSQL,
}
