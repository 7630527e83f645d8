"""How each dialect claims a key: one class per dialect, each with the SQL it sends.

Every class answers one attempt at a claim: the record a read found live (it decides the
outcome without a write, so a replay is one statement), or whether this request took the key
with one atomic upsert. Of concurrent requests that all found the key free, the upsert's
condition, checked on the latest committed row, lets exactly one take it. A record in progress
under the request's own token (the same claim delivered twice) is read as the request's own.

A record whose effect was committed and whose lease lapsed is put on probation by one
conditional UPDATE (:data:`PROBATION`), whose condition decides: the claim that changed it
reads the record in progress; one that changed nothing (another claim, or the holder, changed
the record first) reads it again in its next attempt.
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
    CLAIM_READ,
    KEY_COLUMNS,
    NEW_RECORD,
    NOW,
    PROBATION,
    WINNER,
)

Row = Sequence[Any]


class ClaimSQL(abc.ABC):
    """One dialect's claim."""

    #: The statements it sends.
    statements: tuple[Executable, ...]

    @abc.abstractmethod
    async def attempt(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> tuple[Row | None, bool]:
        """The row of ``READ`` of a live record found (else ``None``), and whether the request
        took the key (``durable``: whether its write must wait for its own flush)."""


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


async def _read_live(
    driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
) -> tuple[Row | None, bool]:
    """The record of the key if it is live (its outcome needs no write), else ``None``; and
    whether to read it again (it was due for probation, but another step changed it first).

    A record due for probation is put on it here, and then reads as in progress.
    """
    rows = await driver.fetch(CLAIM_READ, params, deadline=deadline)
    if not rows or rows[0][-2]:
        return None, False
    *read, due = rows[0]
    if due and not await driver.change(PROBATION, params, deadline=deadline, durable=durable):
        return None, True
    return read, False


class SQLiteClaim(ClaimSQL):
    """SQLite: a read, and only when it finds no live record, an upsert::

        SELECT request_hash, status, ..., status = 'in_progress' AND token = :token AS mine,
               <expired, or the same request's lease lapsed> AS free
          FROM idempotency_records WHERE scope = :scope AND key = :key;
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
        self.statements = (CLAIM_READ, PROBATION, self._upsert)

    async def attempt(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> tuple[Row | None, bool]:
        live, again = await _read_live(driver, params, deadline, durable=durable)
        if live is not None or again:
            return live, False
        # The deadline on the system clock, read as SQLite's now() reads it: from the OS, not
        # through time.time(), which a test (or a tool) may replace without SQLite seeing it.
        until = datetime.now(UTC).timestamp() + deadline - time.monotonic()
        params = {**params, "p_until_ms": int(until * 1000)}
        rows = await driver.fetch(self._upsert, params, deadline=deadline, durable=durable)
        return None, bool(rows) and rows[0][0] == params["p_token"]


class PostgreSQLClaim(ClaimSQL):
    """PostgreSQL: the read and, when it finds no live record, the upsert, in one statement::

        WITH existing AS (SELECT request_hash, ..., mine, free, due FROM idempotency_records
                          WHERE scope = :scope AND key = :key),
             taken AS (INSERT INTO idempotency_records (...)
                       SELECT :scope, :key, ... WHERE NOT EXISTS
                           (SELECT free FROM existing WHERE NOT free)
                       ON CONFLICT (scope, key) DO UPDATE SET ... = excluded....
                       WHERE <expired, or the same request's lease lapsed>
                       RETURNING token),
             probation AS (UPDATE idempotency_records SET lease_expires_at = ...,
                           committed_at = -committed_at WHERE ... <due> RETURNING 1)
        SELECT (SELECT request_hash FROM existing), ..., (SELECT token FROM taken),
               EXISTS (SELECT * FROM probation);

    All parts see one snapshot; the upsert's and the update's WHERE still decide on the latest
    committed row.
    """

    def __init__(self) -> None:
        existing = CLAIM_READ.cte("existing")
        new_record = _new_record(~exists(select(existing.c.free).where(~existing.c.free)))
        taken = _upsert_returning(postgresql, new_record).cte("taken")
        probation = PROBATION.returning(literal_column("1").label("granted")).cte("probation")
        self._statement: Executable = select(
            *(select(column).scalar_subquery() for column in existing.c),
            select(taken.c.token).scalar_subquery(),
            exists(select(probation.c.granted)),
        )
        self.statements = (self._statement,)

    async def attempt(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> tuple[Row | None, bool]:
        rows = await driver.fetch(self._statement, params, deadline=deadline, durable=durable)
        *read, due, token, granted = rows[0]
        if read[0] is None or (due and not granted):
            # No record, or one due for probation that another step changed first.
            return None, token == params["p_token"]
        return read, token == params["p_token"]


class MySQLClaim(ClaimSQL):
    """MariaDB/MySQL: a read, and only when it finds no live record, an upsert and a read of
    the winner::

        SELECT request_hash, ..., mine, free FROM idempotency_records
          WHERE scope = :scope AND key = :key;
        INSERT INTO idempotency_records (...) VALUES (..., :token, ...)
          ON DUPLICATE KEY UPDATE
            token = IF(<expired, or the same request's lease lapsed>, VALUES(token), token),
            request_hash = IF(token = VALUES(token), VALUES(request_hash), request_hash), ...;
        SELECT token FROM idempotency_records WHERE scope = :scope AND key = :key;

    MySQL has no WHERE on ON DUPLICATE KEY UPDATE and applies assignments left to right: the
    token is decided first, and every other column follows whether the token changed. No
    transaction is needed: a record that holds this request's fresh token is this request's
    (only the token's owner can release it, and no one can take it over while its lease runs).
    A live record the read found due for probation is put on it instead (see the module).
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
        self.statements = (CLAIM_READ, PROBATION, self._upsert, WINNER)

    async def attempt(
        self, driver: Driver, params: dict[str, Any], deadline: float, *, durable: bool
    ) -> tuple[Row | None, bool]:
        live, again = await _read_live(driver, params, deadline, durable=durable)
        if live is not None or again:
            return live, False
        await driver.change(self._upsert, params, deadline=deadline, durable=durable)
        rows = await driver.fetch(WINNER, params, deadline=deadline)
        return None, bool(rows) and rows[0][0] == params["p_token"]


_MYSQL = MySQLClaim()
#: Each dialect's claim, built once (so its statements are compiled once per connection).
CLAIMS: dict[str, ClaimSQL] = {
    "sqlite": SQLiteClaim(),
    "postgresql": PostgreSQLClaim(),
    "mysql": _MYSQL,
    "mariadb": _MYSQL,
}
