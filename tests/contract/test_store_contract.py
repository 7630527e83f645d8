"""The Store contract, checked directly on every store, built every way a user can build it."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import Claim, ClaimOutcome, SQLStore, Store, StoredResponse
from idempotency_mw.records import new_token
from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.stores.sql import async_url
from tests.conftest import (
    DATABASES,
    SERVER_DATABASES,
    STORE_PATHS,
    built_store,
    fresh_sql_store,
    require_server,
)
from tests.support import claimers
from tests.support.claimers import outcomes_from_processes
from tests.support.garbage import garbage_of_ours

pytestmark = pytest.mark.anyio

#: A URL with ``driver="sqlalchemy"``: SQLAlchemy's engine where the store has a native driver.
SQLALCHEMY_FROM_URL = [f"{database}-url-sqlalchemy" for database in DATABASES]


@asynccontextmanager
async def contract_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """An empty store built the way ``request.param`` names (a path of ``STORE_PATHS`` or of
    ``SQLALCHEMY_FROM_URL``)."""
    if request.param not in SQLALCHEMY_FROM_URL:
        async with built_store(request.param, request) as made:
            yield made
        return
    database = request.param.partition("-")[0]
    if database == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'idempotency.db'}"
    else:
        url = SERVER_DATABASES[database]
        require_server(url)
    await (await fresh_sql_store(url)).aclose()
    sql_store = SQLStore(url, driver="sqlalchemy")
    yield sql_store
    await sql_store.aclose()


@pytest.fixture(params=[*STORE_PATHS, *SQLALCHEMY_FROM_URL])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """An empty store for each way of building one (see ``STORE_PATHS``) and each driver."""
    async with contract_store(request) as made:
        yield made


#: The stores that keep a mark of a fenced commit in their own record (the SQL stores; Redis
#: and ``MemoryStore`` leave the proof to the application's database).
MARKING_PATHS = [
    path for path in [*STORE_PATHS, *SQLALCHEMY_FROM_URL] if path.partition("-")[0] in DATABASES
]


@pytest.fixture(params=MARKING_PATHS)
async def marking_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """An empty store of each way of building one that marks fenced commits in its record."""
    async with contract_store(request) as made:
        assert isinstance(made, SQLStore)
        yield made


TTL = 60.0
LEASE = 30.0
RESPONSE = StoredResponse(
    201, ((b"content-type", b"application/json"), (b"x-a", b"1")), b'{"id":1}'
)


async def acquire(store: Store, key: str = "k", fingerprint: str = "f", **times: float) -> str:
    claim = await store.claim(
        "", key, fingerprint, ttl=times.get("ttl", TTL), lease=times.get("lease", LEASE)
    )
    assert claim.outcome is ClaimOutcome.ACQUIRED
    assert claim.token
    return claim.token


async def test_the_same_claim_delivered_twice_acquires_both_times(store: Store) -> None:
    # A claim whose reply was lost is delivered again (by the driver, or by the store's own
    # rerun of a dead pooled connection): it must not find itself in the way.
    token = new_token()
    seam = cast(ClaimsWithToken, store)
    first = await seam._claim("", "k", "f", ttl=TTL, lease=LEASE, token=token)
    again = await seam._claim("", "k", "f", ttl=TTL, lease=LEASE, token=token)
    assert first == again == Claim(ClaimOutcome.ACQUIRED, token=token)
    # Every other request still finds the key taken.
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.IN_PROGRESS
    )
    assert await store.complete("", "k", token, RESPONSE, ttl=TTL)
    replay = await seam._claim("", "k", "f", ttl=TTL, lease=LEASE, token=token)
    assert replay.outcome is ClaimOutcome.REPLAY


@pytest.mark.parametrize("response", [RESPONSE, None], ids=["replayable", "unreplayable"])
async def test_a_completion_delivered_twice_is_acknowledged_both_times(
    store: Store, response: StoredResponse | None
) -> None:
    # Run again after its reply was lost, a completion must not read as a takeover.
    token = await acquire(store)
    assert await store.complete("", "k", token, response, ttl=TTL)
    assert await store.complete("", "k", token, response, ttl=TTL)
    again = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    if response is None:
        assert again.outcome is ClaimOutcome.UNREPLAYABLE
    else:
        assert again == Claim(ClaimOutcome.REPLAY, response=response)
    # Another token, or the other kind of outcome, still changes nothing.
    assert not await store.complete("", "k", new_token(), RESPONSE, ttl=TTL)
    assert not await store.complete("", "k", token, None if response else RESPONSE, ttl=TTL)
    assert await store.claim("", "k", "f", ttl=TTL, lease=LEASE) == again


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


async def test_complete_after_ttl_and_lease_both_passed_is_refused(store: Store) -> None:
    # Nobody took the key over, but it counts as absent now: a late writer must not revive it.
    token = await acquire(store, ttl=0.2, lease=0.2)
    await anyio.sleep(0.4)
    assert not await store.renew("", "k", token, lease=LEASE)
    assert not await store.complete("", "k", token, RESPONSE, ttl=TTL)
    assert not await store.release("", "k", token)
    await acquire(store, fingerprint="any request may take the key")


async def test_first_claim_acquires_and_repeat_is_in_progress(store: Store) -> None:
    await acquire(store)
    again = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    assert again.token is None


async def test_completed_record_replays_exact_response(store: Store) -> None:
    token = await acquire(store)
    assert await store.complete("", "k", token, RESPONSE, ttl=TTL)
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.outcome is ClaimOutcome.REPLAY
    assert claim.response == RESPONSE


async def test_other_fingerprint_is_mismatch_in_progress_and_completed(store: Store) -> None:
    token = await acquire(store)
    assert (await store.claim("", "k", "other", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.MISMATCH
    )
    await store.complete("", "k", token, RESPONSE, ttl=TTL)
    assert (await store.claim("", "k", "other", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.MISMATCH
    )


async def test_steps_that_skip_their_flush_have_the_same_outcomes(store: Store) -> None:
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, durable=False)
    assert claim.outcome is ClaimOutcome.ACQUIRED
    assert claim.token is not None
    again = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, durable=False)
    assert again.outcome is ClaimOutcome.IN_PROGRESS
    other = await store.claim("", "k", "other", ttl=TTL, lease=LEASE, durable=False)
    assert other.outcome is ClaimOutcome.MISMATCH
    assert await store.complete("", "k", claim.token, RESPONSE, ttl=TTL, durable=False)
    # Delivered twice: acknowledged again.
    assert await store.complete("", "k", claim.token, RESPONSE, ttl=TTL, durable=False)
    assert not await store.complete("", "k", "not-mine", RESPONSE, ttl=TTL, durable=False)
    replay = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.response == RESPONSE


async def test_unreplayable_record(store: Store) -> None:
    token = await acquire(store)
    assert await store.complete("", "k", token, None, ttl=TTL)
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.outcome is ClaimOutcome.UNREPLAYABLE


async def test_release_lets_the_next_claim_run(store: Store) -> None:
    token = await acquire(store)
    assert await store.release("", "k", token)
    await acquire(store, fingerprint="another request may now use the key")


async def test_lapsed_lease_is_taken_over_and_stale_token_is_refused(store: Store) -> None:
    stale = await acquire(store, lease=0.2)
    await anyio.sleep(0.4)
    fresh = await acquire(store)
    assert fresh != stale
    assert not await store.complete("", "k", stale, RESPONSE, ttl=TTL)
    assert not await store.renew("", "k", stale, lease=LEASE)
    assert not await store.release("", "k", stale)
    # The stale worker changed nothing: the new owner still holds the key.
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.IN_PROGRESS
    )
    assert await store.complete("", "k", fresh, RESPONSE, ttl=TTL)


async def test_lapsed_lease_with_other_fingerprint_is_mismatch(store: Store) -> None:
    await acquire(store, lease=0.2)
    await anyio.sleep(0.4)
    claim = await store.claim("", "k", "other", ttl=TTL, lease=LEASE)
    assert claim.outcome is ClaimOutcome.MISMATCH


async def test_a_record_is_bound_to_its_callers_credentials(store: Store) -> None:
    claim = await store.claim("", "k", "f", ttl=TTL, lease=0.1, binding="alice")
    assert claim.token
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE, binding="bob")).outcome is (
        ClaimOutcome.CREDENTIAL_MISMATCH
    )
    await anyio.sleep(0.2)
    # A lapsed lease is taken over by the same request of the same caller only.
    for other in ("bob", ""):
        late = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, binding=other)
        assert late.outcome is ClaimOutcome.CREDENTIAL_MISMATCH
    retry = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, binding="alice")
    assert retry.outcome is ClaimOutcome.ACQUIRED
    assert retry.token
    assert await store.complete("", "k", retry.token, RESPONSE, ttl=TTL)
    # Checked before the fingerprint: another caller learns nothing of the request.
    other_body = await store.claim("", "k", "other", ttl=TTL, lease=LEASE, binding="bob")
    assert other_body.outcome is ClaimOutcome.CREDENTIAL_MISMATCH
    replay = await store.claim("", "k", "f", ttl=TTL, lease=LEASE, binding="alice")
    assert replay.outcome is ClaimOutcome.REPLAY


async def test_renew_keeps_the_lease(store: Store) -> None:
    token = await acquire(store, lease=0.5)
    for _ in range(4):
        await anyio.sleep(0.2)
        assert await store.renew("", "k", token, lease=0.5)
    assert (await store.claim("", "k", "f", ttl=TTL, lease=LEASE)).outcome is (
        ClaimOutcome.IN_PROGRESS
    )


async def test_expired_record_is_absent_for_any_request(store: Store) -> None:
    token = await acquire(store, ttl=0.3)
    await store.complete("", "k", token, RESPONSE, ttl=0.3)
    await anyio.sleep(0.5)
    await acquire(store, fingerprint="a different request")


async def test_scopes_are_isolated(store: Store) -> None:
    token = await acquire(store)
    await store.complete("", "k", token, RESPONSE, ttl=TTL)
    other = await store.claim("caller-b", "k", "f", ttl=TTL, lease=LEASE)
    assert other.outcome is ClaimOutcome.ACQUIRED


async def test_keys_are_case_sensitive(store: Store) -> None:
    await acquire(store, key="Key-A")
    await acquire(store, key="key-a")


async def test_fifty_concurrent_claims_have_one_winner(store: Store) -> None:
    outcomes: list[ClaimOutcome] = []

    async def claim() -> None:
        result = await store.claim("", "hot", "f", ttl=TTL, lease=LEASE)
        outcomes.append(result.outcome)

    async with anyio.create_task_group() as group:
        for _ in range(50):
            group.start_soon(claim)
    assert outcomes.count(ClaimOutcome.ACQUIRED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 49


async def test_large_binary_payload_round_trips(store: Store) -> None:
    body = os.urandom(3 << 20) + bytes(range(256))
    response = StoredResponse(200, ((b"content-type", b"application/octet-stream"),), body)
    token = await acquire(store)
    await store.complete("", "k", token, response, ttl=TTL)
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.response == response


async def test_times_come_from_the_store_not_the_worker_clock(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await acquire(store, lease=LEASE)
    # A worker whose clock runs a day ahead must still see the lease as held.
    ahead = time.time() + 86400
    monkeypatch.setattr(time, "time", lambda: ahead)
    monkeypatch.setattr(time, "time_ns", lambda: int(ahead * 1e9))
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.outcome is ClaimOutcome.IN_PROGRESS


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
    statement, params = store.fence_statement("", key, token)
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
