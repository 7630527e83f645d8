"""The Store contract, checked directly on every store, built every way a user can build it.

The contract's cases are the shipped pytest cases (``idempotency_mw.testing.StoreConformance``),
one test per case and store; what only this project's stores promise is checked here besides.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import anyio
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import Claim, ClaimOutcome, SQLStore, Store, StoredResponse
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import StoreConformance
from tests.conftest import (
    DATABASES,
    STORE_PATHS,
    built_store,
)
from tests.support import claimers
from tests.support.claimers import outcomes_from_processes
from tests.support.garbage import garbage_of_ours

pytestmark = pytest.mark.anyio


@pytest.fixture(params=STORE_PATHS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """An empty store for each way of building one (see ``STORE_PATHS``)."""
    async with built_store(request.param, request) as made:
        yield made


#: The stores that keep a mark of a fenced commit in their own record (the SQL stores; Redis
#: and ``MemoryStore`` leave the proof to the application's database).
MARKING_PATHS = [path for path in STORE_PATHS if path.partition("-")[0] in DATABASES]


@pytest.fixture(params=MARKING_PATHS)
async def marking_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """An empty store of each way of building one that marks fenced commits in its record."""
    async with built_store(request.param, request) as made:
        assert isinstance(made, SQLStore)
        yield made


TTL = 60.0
LEASE = 30.0
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"1")), b'{"id":1}'
)


class TestEveryStoreConforms(StoreConformance):
    """The shipped cases on each way of building a store (this module's ``store``)."""

    @pytest.fixture
    def tick(self) -> float:
        # Our stores count milliseconds: a lease of 50 ms lapses as surely as one of 100.
        return 0.05


async def acquire(store: Store, key: str = "k", fingerprint: str = "f", **times: float) -> str:
    claim = await store.claim(
        "", key, fingerprint, ttl=times.get("ttl", TTL), lease=times.get("lease", LEASE)
    )
    assert claim.outcome is ClaimOutcome.ACQUIRED
    assert claim.token
    return claim.token


async def test_store_calls_leave_no_garbage_for_the_collector(store: Store) -> None:
    async def calls(key: str) -> tuple[Claim, bool]:
        token = await acquire(store, key)
        assert await store.renew("", key, token, lease=LEASE)
        assert await store.complete("", key, token, RESPONSE, ttl=TTL)
        replay = await store.claim("", key, "f", ttl=TTL, lease=LEASE)
        return replay, await store.release("", f"{key}-gone", await acquire(store, f"{key}-gone"))

    # Each call made first (connections opened, statements and scripts loaded), on keys
    # enough to reach every node of a cluster: what the calls leave on every request counts,
    # not what a first connection or a first use of a script costs once.
    for n in range(16):
        await calls(f"warm-{n}")
    with garbage_of_ours() as garbage:
        replay, released = await calls("k")
    assert replay.outcome is ClaimOutcome.REPLAY
    assert released
    assert garbage == []


async def test_claims_from_several_processes_have_one_winner(
    database_url: str, sql_store: Store
) -> None:
    outcomes = await outcomes_from_processes(functools.partial(claimers.sql_store, database_url))
    assert outcomes.count(ClaimOutcome.ACQUIRED.value) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS.value) == 39


# ---------------------------------------------------------------- a committed record's lapse


async def mark_committed(store: SQLStore, key: str, token: str) -> None:
    """Mark ``token``'s effect committed, as ``fence()`` does in an application's transaction."""
    engine = create_async_engine(async_url(store.url.render_as_string(hide_password=False)))
    statement, params = store.fence_statement("", key, token, TTL)
    async with engine.begin() as conn:
        assert (await conn.execute(statement, params)).rowcount == 1
    await engine.dispose()


async def test_a_committed_record_whose_lease_lapsed_is_in_progress_for_one_more_lease(
    marking_store: SQLStore,
) -> None:
    # Its holder may be alive behind a store that stalled past the lease, and about to record
    # its answer: the retries that find the lease lapsed are told to come back, and one of
    # them gives the record one more lease.
    store = marking_store
    outcomes: list[ClaimOutcome] = []

    async def claim(key: str) -> None:
        outcomes.append((await store.claim("", key, "f", ttl=TTL, lease=1.0)).outcome)

    async def burst(key: str) -> None:
        async with anyio.create_task_group() as group:
            for _ in range(10):
                group.start_soon(claim, key)

    await burst("warm")  # the store's connections opened: the burst below takes no time
    token = await acquire(store, lease=0.2)
    await mark_committed(store, "k", token)
    await anyio.sleep(0.3)
    outcomes.clear()
    await burst("k")
    assert outcomes == [ClaimOutcome.IN_PROGRESS] * 10
    # Another request, or another caller, learns what it would have learnt anyway.
    assert (await store.claim("", "k", "other", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.MISMATCH
    )
    mallory = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, binding="mallory")
    assert mallory.outcome is ClaimOutcome.CREDENTIAL_MISMATCH
    # Lapsed again on probation: the holder was not heard from for a whole lease.
    await anyio.sleep(1.1)
    for _ in range(2):
        late = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
        assert late.outcome is ClaimOutcome.COMMITTED_WITHOUT_RESPONSE
    # The holder may still record its answer, which is then replayed.
    assert await store.complete("", "k", token, RESPONSE, ttl=TTL)
    assert await store.claim("", "k", "f", ttl=TTL, lease=LEASE) == Claim(
        ClaimOutcome.REPLAY, response=RESPONSE
    )


async def test_the_holders_renewal_ends_the_probation(marking_store: SQLStore) -> None:
    store = marking_store
    token = await acquire(store, lease=0.2)
    await mark_committed(store, "k", token)
    await anyio.sleep(0.3)
    assert (await store.claim("", "k", "f", ttl=TTL, lease=0.3)).outcome is (
        ClaimOutcome.IN_PROGRESS
    )
    # The store is back and so is the holder: a later lapse is a first one again.
    assert await store.renew("", "k", token, lease=0.2)
    await anyio.sleep(0.3)
    assert (await store.claim("", "k", "f", ttl=TTL, lease=0.3)).outcome is (
        ClaimOutcome.IN_PROGRESS
    )
    await anyio.sleep(0.4)
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.COMMITTED_WITHOUT_RESPONSE
    )
    # Released by its holder after that, it stays committed, never runs again.
    assert await store.release("", "k", token)
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.COMMITTED_WITHOUT_RESPONSE
    )
