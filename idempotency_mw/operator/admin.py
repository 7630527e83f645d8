"""The operator's view of a store: a URL → store dispatch, for the CLI and the panel.

Every function takes a store URL: a SQL database (its ``idempotency_records`` table) or Redis
(the records a :class:`~idempotency_mw.RedisStore` with the same ``prefix`` writes; a Redis
Cluster is recognised by itself). The stores do the reading and the deleting, through their
own statements and scripts (:class:`~idempotency_mw.stores.base.Inspectable`); times are read
from the store's clock, as the store itself reads them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from idempotency_mw._urls import shown_url
from idempotency_mw.stores.checks import findings
from idempotency_mw.values.exceptions import ConfigurationError, SchemaError, StoreError, describe
from idempotency_mw.values.records import RecordView, StoreStats

if TYPE_CHECKING:
    from idempotency_mw.stores.base import Inspectable, Store
    from idempotency_mw.values.findings import Finding

DEFAULT_REDIS_PREFIX = "idem:"
#: How many of a key's other scopes :func:`inspect` names.
_SCOPES_SHOWN = 10
_REDIS_SCHEMES = ("redis:", "rediss:", "unix:")


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server rather than a SQL database."""
    return url.startswith(_REDIS_SCHEMES)


def relative_time(moment: datetime, now: datetime) -> str:
    """``moment`` as an operator reads it beside ``now``: "in 5 min", "2 h 3 min ago"."""
    seconds = (moment - now).total_seconds()
    return f"in {_duration(seconds)}" if seconds >= 0 else f"{_duration(-seconds)} ago"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 120:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


class ReleaseOutcome(enum.StrEnum):
    """What :func:`release` did."""

    RELEASED = "released"
    NOT_FOUND = "not_found"
    #: The record is completed, or its effect was committed, and ``force`` was not given.
    REFUSED = "refused"
    #: The record changed between the read and the delete (a request settled it): try again.
    CHANGED = "changed"


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """The outcome, and the record as it was found (``None`` when there was none)."""

    outcome: ReleaseOutcome
    record: RecordView | None
    #: As :attr:`Lookup.other_scopes`, when there was no record to release.
    other_scopes: tuple[str, ...] | None = ()


@dataclass(frozen=True, slots=True)
class Lookup:
    """What :func:`inspect` found: the record, or where else the key has records."""

    record: RecordView | None
    #: Scopes holding a record of the key when it has none in the scope asked for (``None``:
    #: the store cannot tell, as Redis keeps only a digest of scope and key).
    other_scopes: tuple[str, ...] | None = ()


async def _other_scopes(store: InspectableStore, key: str) -> tuple[str, ...] | None:
    others = await store.scopes_of(key, limit=_SCOPES_SHOWN)
    return None if others is None else tuple(others)


async def inspect(
    url: str,
    key: str,
    *,
    scope: str = "",
    with_body: bool = False,
    prefix: str = DEFAULT_REDIS_PREFIX,
) -> Lookup:
    """The record of ``key`` in ``scope`` and, when there is none, the key's other scopes."""
    async with open_store(url, prefix=prefix) as store:
        record = await store.find_record(store.record_ref(scope, key), with_body=with_body)
        if record is not None:
            return Lookup(dataclasses.replace(record, scope=scope, key=key))
        return Lookup(None, await _other_scopes(store, key))


async def release(
    url: str,
    key: str,
    *,
    scope: str = "",
    force: bool = False,
    prefix: str = DEFAULT_REDIS_PREFIX,
) -> ReleaseResult:
    """Delete the record of ``key`` so that its next request runs again (see
    :func:`release_record`)."""
    async with open_store(url, prefix=prefix) as store:
        record = await store.find_record(store.record_ref(scope, key))
        if record is None:
            return ReleaseResult(ReleaseOutcome.NOT_FOUND, None, await _other_scopes(store, key))
        return await release_record(
            store, dataclasses.replace(record, scope=scope, key=key), force=force
        )


async def release_record(store: Inspectable, record: RecordView, *, force: bool) -> ReleaseResult:
    """Delete ``record`` as it was read, so that its key's next request runs again.

    Only a record in progress whose effect was not committed is deleted, unless ``force``
    (then a completed or fenced one too: its request may run again). A request that settled
    the record since it was read is never undone: that is ``CHANGED``.
    """
    if not (record.releasable or force):
        return ReleaseResult(ReleaseOutcome.REFUSED, record)
    deleted = await store.force_release(record)
    return ReleaseResult(ReleaseOutcome.RELEASED if deleted else ReleaseOutcome.CHANGED, record)


async def stats(url: str, *, prefix: str = DEFAULT_REDIS_PREFIX) -> StoreStats:
    """How many records the store holds, by status, fenced, and awaiting the purge."""
    async with open_store(url, prefix=prefix) as store:
        return await store.record_stats()


async def check(url: str, *, prefix: str = DEFAULT_REDIS_PREFIX) -> tuple[Finding, ...]:
    """The settings of the server at ``url`` that can lose records, and the app's clock
    against its own (:func:`~idempotency_mw.stores.checks.findings`); its table need not exist
    yet."""
    store = await build_store(url, prefix=prefix)
    try:
        return await findings(store)
    finally:
        await store.aclose()


async def build_store(url: str, *, prefix: str = DEFAULT_REDIS_PREFIX) -> InspectableStore:
    """The store at ``url``, built as :func:`open_store` builds it, not started."""
    if is_redis_url(url):
        from idempotency_mw.stores.redis import RedisStore

        return RedisStore(url, prefix=prefix, cluster=await _is_cluster(url))
    from idempotency_mw.stores.sql import SQLStore, async_url

    _refuse_a_missing_sqlite_file(url)
    async_url(url)  # an unsupported database is a ConfigurationError before any driver
    return SQLStore(url)


@asynccontextmanager
async def open_store(
    url: str, *, prefix: str = DEFAULT_REDIS_PREFIX
) -> AsyncIterator[InspectableStore]:
    """The store at ``url``, checked (a missing table is a SchemaError), closed afterwards.

    A SQLite file that does not exist is refused rather than made; a Redis URL that names a
    node of a cluster opens the cluster.
    """
    store = await build_store(url, prefix=prefix)
    try:
        await store.startup()
        yield store
    finally:
        await store.aclose()


@asynccontextmanager
async def open_proof_table(url: str) -> AsyncIterator[ProofTable]:
    """The fence() proof table of the database at ``url``, checked (a missing table is a
    SchemaError naming ``migrate --proofs``); its engine is disposed afterwards."""
    from sqlalchemy import inspect

    from idempotency_mw.engine.proofs import PROOF_TABLE, ProofTable
    from idempotency_mw.stores.sql.migrate import plain_engine

    _refuse_a_missing_sqlite_file(url)
    engine = plain_engine(url)
    try:
        async with engine.connect() as connection:
            present = await connection.run_sync(lambda conn: inspect(conn).has_table(PROOF_TABLE))
        if not present:
            raise SchemaError(
                f"the table {PROOF_TABLE!r} does not exist: run `idempotency-mw migrate --proofs "
                "--store <database url>` (or create it in your own Alembic project: the docs' "
                "Migrations page)"
            )
        yield ProofTable(engine)
    finally:
        await engine.dispose()


if TYPE_CHECKING:
    from idempotency_mw.engine.proofs import ProofTable

    class InspectableStore(Store, Inspectable, Protocol):
        """A store an operator can look into."""


async def _is_cluster(url: str) -> bool:
    import redis.asyncio
    from redis.exceptions import RedisError

    from idempotency_mw._redis_client import binary_client

    client, _ = binary_client(
        url,
        None,
        lambda address: redis.asyncio.Redis.from_url(
            address, socket_timeout=5, socket_connect_timeout=5
        ),
        owner="idempotency-mw",
        holds="records hold binary response bodies",
    )
    try:
        info = await client.info("cluster")
    except (RedisError, OSError) as exc:
        raise StoreError(describe(exc)) from exc
    finally:
        await client.aclose()
    return bool(info.get("cluster_enabled"))


def _refuse_a_missing_sqlite_file(url: str) -> None:
    # SQLite would create a missing file: an operator's typo must not make a new database.
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        database = make_url(url)
    except ArgumentError as exc:
        raise ConfigurationError(f"not a database URL: {shown_url(url)!r}") from exc
    path = database.database
    in_a_file = database.get_backend_name() == "sqlite" and path not in (None, "", ":memory:")
    if in_a_file and not Path(str(path)).exists():
        raise ConfigurationError(f"no SQLite database at {path}")
