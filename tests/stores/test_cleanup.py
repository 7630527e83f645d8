"""The purge of expired records: in batches, concurrent, in the background, and from the CLI."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import anyio
import pytest
from asgi_lifespan import LifespanManager
from sqlalchemy import event, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import ClaimOutcome, RedisStore, SQLStore, StoredResponse
from idempotency_mw.engine.cleanup import PurgeSchedule, background_purge, purge
from idempotency_mw.operator.cli import main
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import records
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.exceptions import ConfigurationError
from tests.conftest import REDIS_URL, fresh_sql_store, require_server
from tests.support.apps import make_app

pytestmark = pytest.mark.anyio

#: Enough expired rows for several batches of each purge below (the batches' size is the test's).
EXPIRED = 20_000
LIVE = 1_000


async def fill(engine: AsyncEngine, *, expired: int, live: int) -> None:
    """Rows past their TTL, rows still live, and in-progress rows that must survive."""
    now = int(time.time() * 1000)
    hour = 3_600_000

    def row(key: str, status: str, lease_end: int, ttl_end: int) -> dict[str, Any]:
        return {
            "scope": "",
            "key": key,
            "request_hash": "f" * 64,
            "status": status,
            "token": "t" * 32,
            "created_at": now - 2 * hour,
            "lease_expires_at": lease_end,
            "expires_at": ttl_end,
            "response_status": 200,
            "response_headers": b"",
            "result_payload": b"{}",
            "caller_binding": "",
        }

    rows = [row(f"old-{i}", "completed", now - hour, now - hour) for i in range(expired)]
    rows += [row(f"live-{i}", "completed", now, now + hour) for i in range(live)]
    # In progress past its TTL but within its lease: a running request, never purged.
    rows.append(row("running", "in_progress", now + hour, now - hour))
    async with engine.begin() as conn:
        for start in range(0, len(rows), 10_000):
            await conn.execute(insert(records), rows[start : start + 10_000])


async def count(engine: AsyncEngine, prefix: str) -> int:
    async with engine.connect() as conn:
        result = await conn.execute(
            select(func.count()).select_from(records).where(records.c.key.like(f"{prefix}%"))
        )
        return int(result.scalar_one())


async def test_purge_deletes_expired_rows_in_batches_and_keeps_the_rest(
    sql_store: SQLStore, sql_engine: AsyncEngine
) -> None:
    await fill(sql_engine, expired=EXPIRED, live=LIVE)
    report = await purge(sql_store, batch_size=5_000)
    assert report.deleted == EXPIRED
    assert report.batches == EXPIRED // 5_000 + 1
    assert await count(sql_engine, "old-") == 0
    assert await count(sql_engine, "live-") == LIVE
    assert await count(sql_engine, "running") == 1


async def test_two_purges_at_once_both_finish_cleanly(
    sql_store: SQLStore, sql_engine: AsyncEngine, database_url: str
) -> None:
    await fill(sql_engine, expired=EXPIRED // 2, live=LIVE)
    second = SQLStore(database_url)
    reports = []

    async def run(store: SQLStore) -> None:
        reports.append(await purge(store, batch_size=1_000))

    async with anyio.create_task_group() as group:
        group.start_soon(run, sql_store)
        group.start_soon(run, second)
    await second.aclose()
    # A purger stops at a short batch, which rows held by the other can cause: one more
    # round finds whatever is left.
    reports.append(await purge(sql_store, batch_size=1_000))
    assert sum(r.deleted for r in reports) == EXPIRED // 2
    assert await count(sql_engine, "old-") == 0
    assert await count(sql_engine, "live-") == LIVE


async def test_purge_does_not_touch_a_running_claim(sql_store: SQLStore) -> None:
    claim = await sql_store.claim("", "k", "f", ttl=0.1, lease=60)
    assert claim.token
    await anyio.sleep(0.3)
    assert (await purge(sql_store)).deleted == 0
    response = StoredResponse(200, (), b"ok")
    assert await sql_store.complete("", "k", claim.token, response, ttl=60)
    replay = await sql_store.claim("", "k", "f", ttl=60, lease=60)
    assert replay.outcome is ClaimOutcome.REPLAY


async def test_redis_needs_no_purge() -> None:
    require_server(REDIS_URL)
    store = RedisStore(REDIS_URL)
    report = await purge(store)
    await store.aclose()
    assert report.self_expiring
    assert report.deleted == 0


async def test_background_purge_runs_in_the_apps_lifespan(
    sql_store: SQLStore, sql_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    await fill(sql_engine, expired=50, live=5)
    app = make_app(sql_store, purge=PurgeSchedule(interval=0.1, jitter=0.5))
    with caplog.at_level(logging.INFO, logger="idempotency_mw"):
        async with LifespanManager(app):
            # The rows are gone once the purge's delete commits; its log line comes after.
            for _ in range(100):
                if "purged 50 expired idempotency records" in caplog.text:
                    break
                await anyio.sleep(0.05)
    assert await count(sql_engine, "old-") == 0
    assert await count(sql_engine, "live-") == 5
    assert "purged 50 expired idempotency records" in caplog.text


async def test_background_purge_context_manager_survives_store_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = SQLStore("postgresql://postgres@127.0.0.1:1/test")
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        async with background_purge(dead, PurgeSchedule(interval=0.05, jitter=0)):
            await anyio.sleep(0.3)
    await dead.aclose()
    assert caplog.text.count("purge of expired idempotency records failed") >= 2


class FailingPurges(MemoryStore):
    """A store whose purges raise ``error`` the first ``failures`` times; it notes when."""

    def __init__(self, error: BaseException, failures: int) -> None:
        super().__init__()
        self.error = error
        self.failures = failures
        self.attempts: list[float] = []

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None:
        self.attempts.append(time.monotonic())
        if len(self.attempts) <= self.failures:
            raise self.error
        return await super().purge_expired(batch_size=batch_size, scope=scope)


async def test_any_purge_failure_is_logged_counted_and_retried_with_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FailingPurges(RuntimeError("a bug, not a StoreError"), failures=3)
    schedule = PurgeSchedule(interval=1, jitter=0, first_retry=0.05)
    with caplog.at_level(logging.WARNING, logger="idempotency_mw"):
        async with background_purge(store, schedule) as stats:
            for _ in range(100):
                if stats.purges:
                    break
                await anyio.sleep(0.05)
    assert stats.failures == 3
    assert stats.purges >= 1
    gaps = [later - earlier for earlier, later in itertools.pairwise(store.attempts)]
    # Retried sooner than the interval, then twice as long each time.
    assert 0.05 <= gaps[0] < 0.5
    assert gaps[1] >= 0.1
    assert gaps[2] >= 0.2
    failures = [r for r in caplog.records if "purge of expired" in r.getMessage()]
    assert len(failures) == 3
    assert all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in failures)


class Fatal(BaseException):
    """Not an Exception: nothing in the purge loop may swallow it."""


async def test_a_purge_task_that_died_is_reported_at_shutdown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FailingPurges(Fatal("gone"), failures=1)
    with caplog.at_level(logging.ERROR, logger="idempotency_mw"):
        async with background_purge(store, PurgeSchedule(interval=0.01, jitter=0)):
            await anyio.sleep(0.2)
    assert len(store.attempts) == 1
    [record] = [r for r in caplog.records if "had stopped" in r.getMessage()]
    assert record.exc_info
    assert isinstance(record.exc_info[1], Fatal)


def test_schedule_is_validated() -> None:
    for options in ({"interval": 0}, {"jitter": 1.5}, {"batch_size": 0}, {"first_retry": -1}):
        with pytest.raises(ConfigurationError):
            PurgeSchedule(**options)


async def test_cli_purge(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = await fresh_sql_store(database_url)
    engine = create_async_engine(async_url(database_url))
    await fill(engine, expired=300, live=10)
    assert (
        await anyio.to_thread.run_sync(
            main, ["purge", "--url", database_url, "--batch-size", "100"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "purged 300 expired records" in out
    assert "4 batches" in out
    assert await count(engine, "live-") == 10
    await engine.dispose()
    await store.aclose()


def test_cli_purge_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["purge", "--url", "nonsense"]) == 2
    assert main(["purge", "--url", "postgresql://postgres@127.0.0.1:1/test"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert all(line.startswith("idempotency-mw: ") for line in err)


def test_cli_purge_on_redis(capsys: pytest.CaptureFixture[str]) -> None:
    require_server(REDIS_URL)
    assert main(["purge", "--url", REDIS_URL]) == 0
    assert "nothing to purge" in capsys.readouterr().out


async def test_purges_send_one_statement_whatever_the_batch_size(
    sql_store: SQLStore, sql_engine: AsyncEngine
) -> None:
    # The batch size is a bound parameter: every batch, of any size, is the same statement to
    # the database and to SQLAlchemy's statement cache.
    await fill(sql_engine, expired=300, live=0)
    sent: set[str] = set()

    def saw(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        sent.add(statement)

    event.listen(sql_store.engine.sync_engine, "before_cursor_execute", saw)
    for batch_size in (1, 2, 3, 7, 50, 1000):
        await purge(sql_store, batch_size=batch_size)
    assert len(sent) == 1
