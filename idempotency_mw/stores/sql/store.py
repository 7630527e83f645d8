"""SQLStore: idempotency records in a SQL table (SQLite, PostgreSQL, MariaDB/MySQL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.expression import Executable

from idempotency_mw._urls import shown_url
from idempotency_mw.stores.base import ClaimFields, ClaimsWithToken
from idempotency_mw.stores.feed import Feeds
from idempotency_mw.stores.sql import notify
from idempotency_mw.stores.sql.admin import SQLInspection
from idempotency_mw.stores.sql.checks import server_check
from idempotency_mw.stores.sql.claims import CLAIMS
from idempotency_mw.stores.sql.database import Database, engine_for
from idempotency_mw.stores.sql.schema import check_schema, stored_name
from idempotency_mw.stores.sql.sqlite import Synchronous, check_options
from idempotency_mw.stores.sql.statements import (
    FENCE,
    LOOKUP,
    PURGES,
    REFENCE,
    RENEW,
    SCOPED_PURGES,
    SETTLING,
    SILENT,
    found_of,
)
from idempotency_mw.values.exceptions import (
    ConfigurationError,
    SettlementFeedUnsupported,
    StoreError,
    store_error,
)
from idempotency_mw.values.findings import ServerCheck
from idempotency_mw.values.metrics import key_hash
from idempotency_mw.values.outcome import FIRST_SENT_SKEW, Asking, lookup_state
from idempotency_mw.values.records import (
    Claim,
    RecordState,
    RecordStatus,
    StoredResponse,
    pack_headers,
)

T = TypeVar("T")
#: The share of the operation timeout a statement may spend waiting for a lock (SQLite), or
#: before it runs again.
_LOCK_SHARE = 0.9


class SQLStore(SQLInspection, ClaimsWithToken):
    """Idempotency records in the ``idempotency_records`` table of a SQL database.

    ``database`` is a SQLAlchemy URL (with or without an async driver name) or an
    :class:`~sqlalchemy.ext.asyncio.AsyncEngine` of your own, which the store uses as it is and
    never disposes. From a URL the store makes its engine (see
    :func:`~idempotency_mw.stores.sql.database.engine_for`): asyncpg for PostgreSQL, asyncmy
    for MariaDB/MySQL and aiosqlite for SQLite unless the URL names another async driver; the
    URL's options reach the driver (PgBouncer's ``?prepared_statement_cache_size=0``, ``ssl``,
    ``application_name``...). ``operation_timeout`` bounds every database call (seconds).

    The store switches a SQLite file it opens from a URL to WAL journal mode, in which readers
    and a writer of several processes do not wait for each other, with ``synchronous=FULL``: a
    recorded answer survives a power cut. ``sqlite_wal=False`` leaves the file's journal mode
    as it is; ``sqlite_synchronous="NORMAL"`` makes commits much cheaper (no fsync each), and a
    power cut can then lose the latest ones (never corrupt the file).

    The claims and completions of a route declared ``fenced=True`` (``durable=False``) skip
    their own flush on PostgreSQL: each runs in a transaction with ``SET LOCAL
    synchronous_commit = off``. Elsewhere they stay durable.

    With ``settlement_notices=True``, on PostgreSQL through asyncpg, the store also offers a
    :class:`~idempotency_mw.stores.base.SettlementFeed` (for ``wait=`` across workers):
    ``complete`` and ``release`` announce the record they settle with ``pg_notify`` in the same
    statement, and :meth:`watch_settlements` listens on one connection the engine opens. It is
    off by default: PostgreSQL commits notifying transactions one at a time, which halves how
    many settlements it takes per second under concurrency.

    The store is :class:`~idempotency_mw.stores.base.Inspectable` (the CLI and the panel) and
    :class:`~idempotency_mw.stores.base.ServerChecked` (``idempotency-mw check``).
    """

    def __init__(
        self,
        database: str | URL | AsyncEngine,
        *,
        operation_timeout: float = 10.0,
        sqlite_wal: bool | None = None,
        sqlite_synchronous: Synchronous = "FULL",
        settlement_notices: bool = False,
    ) -> None:
        if isinstance(database, AsyncEngine):
            check_options(sqlite_wal, sqlite_synchronous, sqlite_file=False)
            engine, owned = database, False
        else:
            engine = engine_for(
                database,
                sqlite_wal=sqlite_wal,
                sqlite_synchronous=sqlite_synchronous,
                # A statement that waits for a lock gives up before the caller stops waiting:
                # one that ran after the request was answered 503 would hold the key for nothing.
                busy_timeout=operation_timeout * _LOCK_SHARE,
            )
            owned = True
        dialect = engine.dialect.name
        self._claim_sql = CLAIMS[dialect]
        self._purge = PURGES[dialect]
        self._scoped_purge = SCOPED_PURGES[dialect]
        self._settling = SETTLING.get(dialect, SILENT) if settlement_notices else SILENT
        settling = self._settling
        # The statements of a first request and of a replay.
        request_path = (
            *self._claim_sql.statements,
            settling.complete,
            settling.release,
            settling.release_committed,
        )
        self._database = Database(engine, owned=owned, direct=request_path)
        self._operation_timeout = operation_timeout
        self._errors: tuple[type[Exception], ...] = (
            *self._database.errors,
            OSError,
            TimeoutError,
        )
        self._feeds = Feeds()

    def __repr__(self) -> str:
        return f"SQLStore({shown_url(self._database.url)})"

    async def _claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        token: str,
        binding: str = "",
        durable: bool = True,
        first_sent: float | None = None,
    ) -> Claim:
        params = {
            **_record_of(scope, key),
            "p_fingerprint": fingerprint,
            "p_binding": binding,
            "p_token": token,
            "p_ttl_ms": int(ttl * 1000),
            "p_lease_ms": int(lease * 1000),
            "p_first_sent_ms": None if first_sent is None else int(first_sent * 1000),
            "p_skew_ms": int(FIRST_SENT_SKEW * 1000),
        }
        asking = Asking(fingerprint, binding, token, ttl, first_sent)
        # A record the read finds decides the outcome without a write (a replay is one
        # statement). Otherwise the atomic upsert decides; if another request won it in between,
        # the next attempt reads that request's record.
        for _ in range(3):
            claim = await self._call(
                "claim",
                lambda ends: self._claim_sql.attempt(
                    self._database, params, asking, ends, durable=durable
                ),
            )
            if claim is not None:
                return claim
        raise StoreError(f"claim on {self!r} failed: the record kept changing while it was claimed")

    async def lookup(self, scope: str, key: str, *, binding: str = "") -> RecordState | None:
        """See :class:`~idempotency_mw.stores.base.KeyLookup`: one SELECT."""
        params = {**_record_of(scope, key), "p_binding": binding}
        rows = await self._call(
            "lookup", lambda ends: self._database.fetch(LOOKUP, params, deadline=ends)
        )
        return lookup_state(*found_of(rows[0])) if rows else None

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        params = {**_record_of(scope, key), "p_token": token, "p_lease_ms": int(lease * 1000)}
        return await self._call("renew", lambda ends: self._change(RENEW, params, ends)) == 1

    async def complete(
        self,
        scope: str,
        key: str,
        token: str,
        response: StoredResponse | None,
        *,
        ttl: float,
        durable: bool = True,
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
        return await self._settle(
            "complete", self._settling.complete, scope, key, params, durable=durable
        )

    async def release(self, scope: str, key: str, token: str) -> bool:
        params = {**_record_of(scope, key), "p_token": token}
        if await self._settle("release", self._settling.release, scope, key, params):
            return True
        # Still here: its effect was committed (or it is not this token's any more).
        return await self._settle("release", self._settling.release_committed, scope, key, params)

    async def _settle(
        self,
        operation: str,
        statement: Executable,
        scope: str,
        key: str,
        params: dict[str, Any],
        *,
        durable: bool = True,
    ) -> bool:
        """Run a statement that settles the record: whether it changed it."""
        database = self._database
        if self._settling.announce:
            params = {**params, "p_digest": key_hash(scope, key)}
            rows = await self._call(
                operation,
                lambda ends: database.fetch(statement, params, deadline=ends, durable=durable),
            )
            return len(rows) == 1
        changed = await self._call(
            operation,
            lambda ends: database.change(statement, params, deadline=ends, durable=durable),
        )
        return changed == 1

    async def watch_settlements(self, on_settled: Callable[[str], None]) -> None:
        """Pass the digest of each record any worker settles to ``on_settled``, until cancelled
        or closed (see :class:`~idempotency_mw.stores.base.SettlementFeed`).

        PostgreSQL through asyncpg only: one connection that the engine opens, taken out of its
        pool, LISTENs, opened here and again after a loss. Raises
        :class:`~idempotency_mw.values.exceptions.SettlementFeedUnsupported` on SQLite and
        MariaDB/MySQL, and for an engine on another PostgreSQL driver.
        """
        connect = notify.connector(self._database.engine, repr(self))
        if not self._settling.announce:
            raise SettlementFeedUnsupported(
                f"{self!r} announces no settlements, so waiters poll: give it "
                "settlement_notices=True to wake them at once"
            )
        await self._feeds.run(
            repr(self),
            lambda: notify.listen(connect, on_settled, answer_within=self._operation_timeout),
        )

    def fence_statement(
        self, scope: str, key: str, token: str, ttl: float
    ) -> tuple[Executable, dict[str, Any]]:
        """The statement (and its parameters) that marks a claim's effect committed, to run in
        the application's own transaction, and keeps its record ``ttl`` seconds from then; it
        changes one row while the token still holds the claim, none otherwise."""
        return FENCE, {**_record_of(scope, key), "p_token": token, "p_ttl_ms": int(ttl * 1000)}

    def refence_statement(self, claim: ClaimFields) -> tuple[Executable, dict[str, Any]]:
        """The statement to run in the same transaction when :meth:`fence_statement` changed
        nothing: it writes the claim's record again, its effect committed, if no record of the
        key is there (the claim was lost in a crash before its flush, or purged), and changes
        one row if it did."""
        return REFENCE[self._database.dialect_name], {
            **_record_of(claim.scope, claim.key),
            "p_token": claim.token,
            "p_fingerprint": claim.fingerprint,
            "p_binding": claim.binding,
            "p_ttl_ms": int(claim.ttl * 1000),
            "p_lease_ms": int(claim.lease * 1000),
        }

    @property
    def url(self) -> URL:
        """The database's URL (with its password), to compare with an application's engine."""
        return self._database.url

    @property
    def engine(self) -> AsyncEngine:
        """The engine the store runs on: the one it was given, or the one it made."""
        return self._database.engine

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None:
        params: dict[str, Any] = {"p_batch_size": batch_size}
        purge = self._purge
        if scope is not None:
            params["p_scope"], purge = stored_name(scope), self._scoped_purge
        return await self._call("purge", lambda ends: self._change(purge, params, ends))

    async def startup(self) -> None:
        """Check the table (:class:`~idempotency_mw.values.exceptions.SchemaError` when it is
        missing or old); a setting of the URL the server refuses (an unknown or invalid
        PostgreSQL parameter) raises :class:`~idempotency_mw.values.exceptions.ConfigurationError`:
        it would fail every connection, however long the service waits."""
        try:
            await self._call(
                "startup check", lambda ends: self._database.run_sync(check_schema, deadline=ends)
            )
        except StoreError as exc:
            refusal = _driver_error(exc)
            if refusal is not None and getattr(refusal, "sqlstate", None) in _REFUSED_SETTINGS:
                raise ConfigurationError(
                    f"{self!r}: the database refused a setting of the URL: {refusal}"
                ) from exc
            raise

    async def check_server(self) -> ServerCheck:
        """See :class:`~idempotency_mw.stores.base.ServerChecked`: how commits reach the disk,
        the timeouts shorter than ``operation_timeout``, and the server's clock."""
        return await self._call(
            "server check",
            lambda ends: server_check(self._database, self._operation_timeout, ends),
        )

    async def aclose(self) -> None:
        await self._feeds.close()
        await self._database.aclose()

    def _change(self, statement: Executable, params: dict[str, Any], ends: float) -> Awaitable[int]:
        return self._database.change(statement, params, deadline=ends)

    async def _call(self, operation: str, call: Callable[[float], Awaitable[T]]) -> T:
        """``call(deadline)`` within the operation timeout; its failures become StoreError."""
        # No statement runs again once the caller is about to stop waiting.
        ends = time.monotonic() + self._operation_timeout * _LOCK_SHARE
        try:
            async with asyncio.timeout(self._operation_timeout):
                return await call(ends)
        except self._errors as exc:
            raise store_error(operation, repr(self), exc, self._operation_timeout) from exc


#: PostgreSQL's answers to a connection setting it does not know (undefined_object) or takes
#: no such value for (invalid_parameter_value).
_REFUSED_SETTINGS = frozenset({"42704", "22023"})


def _driver_error(exc: BaseException) -> BaseException | None:
    """The driver's error under ``exc`` that carries a SQLSTATE (asyncpg's and psycopg's
    errors do), if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(getattr(seen, "sqlstate", None), str):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _record_of(scope: str, key: str) -> dict[str, str]:
    return {"p_scope": stored_name(scope), "p_key": stored_name(key)}
