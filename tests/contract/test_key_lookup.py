"""KeyLookup: a caller's look at its own key's record, on every store of the package."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import cast

import anyio
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import ClaimOutcome, SQLStore, Store, StoredResponse
from idempotency_mw.stores.base import KeyLookup
from idempotency_mw.stores.sql import async_url
from idempotency_mw.values.records import KeyState
from tests.conftest import DATABASES, built_store

pytestmark = pytest.mark.anyio

TTL = 60.0
LEASE = 30.0
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')


class Both(Store, KeyLookup):
    """What the tests hold: a store that looks keys up too."""


@pytest.fixture(params=[*(f"{database}-url" for database in DATABASES), "redis-url", "memory"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Both]:
    async with built_store(request.param, request) as made:
        assert isinstance(made, KeyLookup)
        yield cast(Both, made)


async def test_a_key_never_claimed_is_not_found(store: Both) -> None:
    assert await store.lookup("", "never") is None


async def test_a_claim_in_progress_is_found_with_its_lease(store: Both) -> None:
    before = time.time()
    claim = await store.claim("s", "k", "f", ttl=TTL, lease=LEASE, binding="b")
    assert claim.outcome is ClaimOutcome.ACQUIRED
    found = await store.lookup("s", "k", binding="b")
    assert found is not None
    assert found.state is KeyState.IN_PROGRESS
    assert found.lease_until is not None
    # The store's clock is another machine's: a second of slack either way.
    assert before + LEASE - 1 <= found.lease_until <= time.time() + LEASE + 1
    assert before + TTL - 1 <= found.expires_at <= time.time() + TTL + 1
    assert not found.replayable


async def test_another_callers_record_is_not_found(store: Both) -> None:
    await store.claim("s", "k", "f", ttl=TTL, lease=LEASE, binding="b")
    assert await store.lookup("s", "k", binding="other") is None
    assert await store.lookup("s", "k") is None
    assert await store.lookup("other", "k", binding="b") is None


async def test_a_completed_record_is_found_with_its_answer(store: Both) -> None:
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.token is not None
    assert await store.complete("", "k", claim.token, RESPONSE, ttl=TTL)
    found = await store.lookup("", "k")
    assert found is not None
    assert found.state is KeyState.COMPLETED
    assert found.status == 201
    assert found.response == RESPONSE
    # The claim that replays it says the same end of the record.
    replay = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.expires_at == pytest.approx(found.expires_at, abs=0.002)
    mismatch = await store.claim("", "k", "g", ttl=TTL, lease=LEASE)
    assert mismatch.expires_at == pytest.approx(found.expires_at, abs=0.002)


async def test_an_unreplayable_record_is_completed_without_a_replay(store: Both) -> None:
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.token is not None
    assert await store.complete("", "k", claim.token, None, ttl=TTL)
    found = await store.lookup("", "k")
    assert found is not None
    assert (found.state, found.status, found.replayable) == (KeyState.COMPLETED, None, False)


async def test_a_released_or_expired_record_is_not_found(store: Both) -> None:
    claim = await store.claim("", "k", "f", ttl=TTL, lease=LEASE)
    assert claim.token is not None
    assert await store.release("", "k", claim.token)
    assert await store.lookup("", "k") is None
    short = await store.claim("", "s", "f", ttl=0.05, lease=LEASE)
    assert short.token is not None
    assert await store.complete("", "s", short.token, RESPONSE, ttl=0.05)
    await anyio.sleep(0.1)
    assert await store.lookup("", "s") is None


@pytest.mark.parametrize("path", [f"{database}-url" for database in DATABASES])
async def test_a_fenced_effect_whose_claim_was_given_up_is_committed(
    path: str, request: pytest.FixtureRequest
) -> None:
    async with built_store(path, request) as made:
        assert isinstance(made, SQLStore)
        claim = await made.claim("", "k", "f", ttl=TTL, lease=LEASE)
        assert claim.token is not None
        statement, params = made.fence_statement("", "k", claim.token, TTL)
        engine = create_async_engine(async_url(made.url))
        try:
            async with engine.begin() as connection:
                await connection.execute(statement, params)
        finally:
            await engine.dispose()
        running = await made.lookup("", "k")
        assert running is not None
        assert running.state is KeyState.IN_PROGRESS
        assert await made.release("", "k", claim.token)
        found = await made.lookup("", "k")
        assert found is not None
        assert found.state is KeyState.COMMITTED


async def test_a_claim_in_progress_past_its_ttl_is_kept_while_its_lease_holds(
    store: Both,
) -> None:
    claim = await store.claim("", "k", "f", ttl=0.05, lease=LEASE)
    assert claim.outcome is ClaimOutcome.ACQUIRED
    await anyio.sleep(0.1)
    found = await store.lookup("", "k")
    assert found is not None
    assert found.state is KeyState.IN_PROGRESS
    assert found.expires_at == found.lease_until
