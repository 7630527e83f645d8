"""Records whose effect a fenced commit marked: never released, never taken over (SQL stores)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import ClaimOutcome, SQLStore, StoredResponse
from idempotency_mw.stores.sql import async_url

pytestmark = pytest.mark.anyio

TTL = 60.0
RESPONSE = StoredResponse(201, (), b"{}")


@pytest.fixture
async def app_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """The application's own engine on the store's database."""
    engine = create_async_engine(async_url(database_url))
    yield engine
    await engine.dispose()


async def fenced(
    store: SQLStore, engine: AsyncEngine, key: str, token: str, ttl: float = TTL
) -> int:
    """Run the fence statement in a transaction of the application's; the rows it changed."""
    statement, params = store.fence_statement("", key, token, ttl)
    async with engine.begin() as conn:
        return int((await conn.execute(statement, params)).rowcount)


async def acquire(store: SQLStore, key: str = "k", lease: float = 30.0, ttl: float = TTL) -> str:
    claim = await store.claim("", key, "f", ttl=ttl, lease=lease)
    assert claim.outcome is ClaimOutcome.ACQUIRED
    assert claim.token
    return claim.token


async def test_a_committed_record_is_never_released(
    sql_store: SQLStore, app_engine: AsyncEngine
) -> None:
    token = await acquire(sql_store)
    assert await fenced(sql_store, app_engine, "k", token) == 1
    assert await sql_store.release("", "k", token)
    for _ in range(2):
        again = await sql_store.claim("", "k", "f", ttl=TTL, lease=30)
        assert again.outcome is ClaimOutcome.COMMITTED_WITHOUT_RESPONSE
    other = await sql_store.claim("", "k", "other", ttl=TTL, lease=30)
    assert other.outcome is ClaimOutcome.MISMATCH


async def test_a_committed_record_is_not_taken_over_when_its_lease_lapses(
    sql_store: SQLStore, app_engine: AsyncEngine
) -> None:
    # A lease long enough for the fence and a claim within it on a loaded machine (with 0.2 s,
    # that claim once came after the lease and began the probation with its own lease of 30 s).
    token = await acquire(sql_store, lease=1.0)
    claimed_by = time.monotonic()  # the store's clock read the claim's time before this
    assert await fenced(sql_store, app_engine, "k", token) == 1
    during = await sql_store.claim("", "k", "f", ttl=TTL, lease=30)
    assert during.outcome is ClaimOutcome.IN_PROGRESS
    await anyio.sleep(claimed_by + 1.1 - time.monotonic())  # the lease lapsed
    # One more lease for its holder (see the contract suite), then never run again.
    probation = await sql_store.claim("", "k", "f", ttl=TTL, lease=0.2)
    assert probation.outcome is ClaimOutcome.IN_PROGRESS
    await anyio.sleep(0.3)
    after = await sql_store.claim("", "k", "f", ttl=TTL, lease=30)
    assert after.outcome is ClaimOutcome.COMMITTED_WITHOUT_RESPONSE
    # Its owner may still record the response, which is then replayed.
    assert await sql_store.complete("", "k", token, RESPONSE, ttl=TTL)
    replay = await sql_store.claim("", "k", "f", ttl=TTL, lease=30)
    assert replay.outcome is ClaimOutcome.REPLAY


async def test_a_fence_by_a_token_that_lost_the_key_changes_nothing(
    sql_store: SQLStore, app_engine: AsyncEngine
) -> None:
    stale = await acquire(sql_store, lease=0.1)
    await anyio.sleep(0.2)
    current = await acquire(sql_store)
    assert await fenced(sql_store, app_engine, "k", stale) == 0
    assert await fenced(sql_store, app_engine, "k", current) == 1


async def test_a_committed_record_runs_again_once_its_ttl_ends(
    sql_store: SQLStore, app_engine: AsyncEngine
) -> None:
    token = await acquire(sql_store, lease=0.1, ttl=0.3)
    assert await fenced(sql_store, app_engine, "k", token, ttl=0.3) == 1
    await anyio.sleep(0.4)
    await acquire(sql_store)


async def test_a_committed_record_is_kept_a_ttl_from_its_commit_not_from_its_claim(
    sql_store: SQLStore, app_engine: AsyncEngine
) -> None:
    # The protocol's model found this (tests/model, -DSAME_DB): a record kept a TTL from its
    # claim, fenced late in that TTL, expired soon after the effect committed; its worker died,
    # and once the lease lapsed a retry took the key over and committed the effect again.
    # Here the claim's TTL is short and the commit's long, as for a handler that fences late.
    token = await acquire(sql_store, lease=0.2, ttl=0.3)
    assert await fenced(sql_store, app_engine, "k", token, ttl=TTL) == 1
    await anyio.sleep(0.4)  # the claim's TTL and its lease have passed; its worker is gone
    retry = await sql_store.claim("", "k", "f", ttl=TTL, lease=30)
    assert retry.outcome is ClaimOutcome.IN_PROGRESS  # on probation, never taken over
