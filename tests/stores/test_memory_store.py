"""MemoryStore's own clock: tests move time forward instead of sleeping (the contract suite
runs on it too, through the `store` fixture)."""

from __future__ import annotations

import pytest

from idempotency_mw import ClaimOutcome, Store, StoredResponse
from idempotency_mw.testing import MemoryStore

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_given_clock_decides_leases_ttls_and_purges() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    assert isinstance(store, Store)
    first = await store.claim("", "k", "f", ttl=60, lease=10)
    assert first.token
    clock.now += 9.9
    assert (await store.claim("", "k", "f", ttl=60, lease=10)).outcome is ClaimOutcome.IN_PROGRESS
    clock.now += 0.2
    second = await store.claim("", "k", "f", ttl=60, lease=10)
    assert second.outcome is ClaimOutcome.ACQUIRED
    assert second.token
    assert not await store.complete("", "k", first.token, None, ttl=60)
    assert await store.complete("", "k", second.token, StoredResponse(200, (), b"ok"), ttl=60)

    assert await store.purge_expired(batch_size=10) == 0
    clock.now += 60
    assert len(store) == 1
    assert await store.purge_expired(batch_size=10) == 1
    assert len(store) == 0
