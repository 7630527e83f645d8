"""Idempotent functions after a timeout, on SQLite, PostgreSQL and Redis: a caller looks its
key up, a call first sent longer ago than the key is kept runs nothing, and a function's
downstream keys are the same on every run of the call."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest

from idempotency_mw import (
    ConfigurationError,
    IdempotentFunctions,
    KeyExpired,
    Store,
    downstream_key,
)
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.records import Claim, KeyState

pytestmark = pytest.mark.anyio

RETENTION = 2.0


@pytest.fixture
def store(backend_store: Store) -> Store:
    """SQLite, PostgreSQL and Redis in turn."""
    return backend_store


async def test_a_call_first_sent_before_the_retention_and_the_purge_runs_nothing(
    store: Store,
) -> None:
    protect = IdempotentFunctions(store, ttl=RETENTION, lease=RETENTION / 2)
    runs: list[str] = []

    @protect(key=lambda order, **_: order, first_sent=lambda sent, **_: sent)
    async def charge(order: str, sent: float) -> int:
        runs.append(order)
        return len(runs)

    first_sent = time.time()
    assert await charge("o-1", first_sent) == 1
    assert await charge("o-1", first_sent) == 1  # within the retention: the result again
    await anyio.sleep(RETENTION + 0.2)
    await store.purge_expired(batch_size=100)
    with pytest.raises(KeyExpired, match="did not run"):
        await charge("o-1", first_sent)
    assert runs == ["o-1"]
    assert await protect.lookup("o-1") is None  # the refusal left no record behind
    assert await charge("o-2", time.time()) == 2
    # Ahead of the clock beyond the skew, too (an aware datetime is taken as well).
    with pytest.raises(KeyExpired):
        await protect.call(
            "o-3",
            "f",
            anyio.lowlevel.checkpoint,
            name="x",
            first_sent=datetime.fromtimestamp(time.time() + 3600, UTC),
        )
    assert runs == ["o-1", "o-2"]


class EarlierProtocolStore(MemoryStore):
    """A store written before claims took ``first_sent=``."""

    async def claim(  # type: ignore[override]
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        binding: str = "",
        durable: bool = True,
    ) -> Claim:
        return await super().claim(
            scope, key, fingerprint, ttl=ttl, lease=lease, binding=binding, durable=durable
        )


async def test_a_store_that_cannot_judge_a_first_sent_time_refuses_to_guess() -> None:
    """Judging it on the worker's clock is what ran a stale retry twice: said, never done."""
    # Not a Store to the type checker (no first_sent=), but one at run time.
    protect = IdempotentFunctions(cast(Store, EarlierProtocolStore()), ttl=60, lease=30)
    runs: list[str] = []

    async def work() -> str:
        runs.append("ran")
        return "done"

    assert await protect.call("k-1", "f", work, name="x") == "done"
    with pytest.raises(ConfigurationError, match="first_sent"):
        await protect.call("k-2", "f", work, name="x", first_sent=time.time())
    assert runs == ["ran"]


async def test_a_caller_looks_its_key_up_without_running_it(store: Store) -> None:
    protect = IdempotentFunctions(store, ttl=600)
    gate = anyio.Event()

    @protect(key=lambda order, **_: order)
    async def charge(order: str) -> dict[str, Any]:
        await gate.wait()
        return {"charged": order}

    assert await protect.lookup("o-1") is None
    async with anyio.create_task_group() as group:
        group.start_soon(charge, "o-1")
        for _ in range(200):
            running = await protect.lookup("o-1")
            if running is not None:
                break
            await anyio.sleep(0.01)
        assert running is not None
        assert running.state is KeyState.IN_PROGRESS
        gate.set()
    done = await protect.lookup("o-1")
    assert done is not None
    assert done.state is KeyState.COMPLETED
    assert done.replayable
    assert done.response is not None
    assert protect.codec.decode(done.response.body) == {"charged": "o-1"}
    # Another scope's functions do not see it.
    assert await IdempotentFunctions(store, scope="other").lookup("o-1") is None


async def test_a_functions_downstream_keys_are_the_same_on_every_run(store: Store) -> None:
    protect = IdempotentFunctions(store)
    seen: list[tuple[str, str]] = []

    async def charge() -> None:
        seen.append((downstream_key("provider"), downstream_key("ledger")))

    async def crash() -> None:
        await charge()
        raise RuntimeError("crashed after calling the provider")  # the key is released

    for _ in range(2):
        with pytest.raises(RuntimeError):
            await protect.call("o-1", "f", crash, name="charge")
    await protect.call("o-2", "f", charge, name="charge")
    (provider, ledger), again, other = seen
    assert again == (provider, ledger)
    assert provider != ledger
    assert len(provider) == 64
    assert all(c in "0123456789abcdef" for c in provider)
    assert other[0] != provider
    with pytest.raises(ConfigurationError, match="under a key"):
        downstream_key("provider")
