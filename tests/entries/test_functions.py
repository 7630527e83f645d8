"""Idempotent functions on the claim engine: once per key, replayed, refused, waited for,
released on failure unless fenced, taken over after a crash, on every store."""

from __future__ import annotations

import asyncio
import sys
import threading
import uuid
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import (
    ConfigurationError,
    InvalidKey,
    SchemaError,
    SQLStore,
    Store,
    fence,
    fence_sync,
)
from idempotency_mw.client import sync_url
from idempotency_mw.functions import (
    BytesCodec,
    CommittedWithoutResult,
    IdempotentFunctions,
    KeyReused,
    ResultNotReplayable,
    StillRunning,
)
from idempotency_mw.stores.sql import async_url
from tests.conftest import (
    POSTGRESQL_URL,
    REDIS_URL,
    forget_redis_prefix,
    fresh_sql_store,
    redis_prefix,
    require_server,
)
from tests.support.function_worker import LEASE, charge, protected, store_at
from tests.support.queue_consumer import effects, metadata

pytestmark = pytest.mark.anyio


async def test_a_call_runs_once_and_a_repeat_gets_its_result(store: Store) -> None:
    protect = IdempotentFunctions(store)
    runs: list[str] = []

    @protect(key=lambda order, **_: f"charge:{order}")
    async def charge(order: str, amount: int = 10) -> dict[str, Any]:
        runs.append(order)
        return {"order": order, "amount": amount, "run": len(runs)}

    first = await charge("o-1")
    # The same call, however its arguments come (key= gets them by name).
    again = await charge(order="o-1", amount=10)
    positional = await charge("o-1", 10)
    assert first == again == positional == {"order": "o-1", "amount": 10, "run": 1}
    assert runs == ["o-1"]
    with pytest.raises(KeyReused, match="other arguments"):
        await charge("o-1", amount=99)
    assert runs == ["o-1"]


async def test_a_sync_function_runs_in_a_worker_thread(store: Store) -> None:
    protect = IdempotentFunctions(store)
    threads: list[int] = []

    def job(day: str) -> str:
        threads.append(threading.get_ident())
        return f"report {day}"

    results = [await protect.run(f"report:{day}", job, day) for day in ("mon", "mon", "tue")]
    assert results == ["report mon", "report mon", "report tue"]
    assert len(threads) == 2
    assert threading.get_ident() not in threads


async def test_an_exception_releases_the_key_so_a_retry_runs(store: Store) -> None:
    protect = IdempotentFunctions(store)
    attempts: list[int] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("the card network timed out")
        return "charged"

    with pytest.raises(RuntimeError, match="timed out"):
        await protect.run("k", flaky)
    assert await protect.run("k", flaky) == "charged"
    assert await protect.run("k", flaky) == "charged"
    assert len(attempts) == 2


async def test_run_passes_arguments_named_like_its_own(store: Store) -> None:
    protect = IdempotentFunctions(store)

    async def lookup(key: str, fn: str) -> str:
        return f"{key}/{fn}"

    assert await protect.run("k", lookup, key="a", fn="b") == "a/b"
    assert await protect.run("k", lookup, "a", fn="b") == "a/b"


async def test_concurrent_duplicates_run_once_and_wait_for_the_result(store: Store) -> None:
    protect = IdempotentFunctions(store, wait=5)
    runs: list[int] = []
    results: list[str] = []

    async def slow() -> str:
        runs.append(1)
        await anyio.sleep(0.3)
        return "done"

    async def one() -> None:
        results.append(await protect.run("k", slow))

    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(one)
    assert results == ["done"] * 5
    assert runs == [1]


async def test_a_repeat_past_its_wait_is_told_to_retry_later(store: Store) -> None:
    protect = IdempotentFunctions(store, wait=0.2)
    started, release = anyio.Event(), anyio.Event()

    async def held() -> str:
        started.set()
        await release.wait()
        return "done"

    async with anyio.create_task_group() as group:
        group.start_soon(protect.run, "k", held)
        await started.wait()
        with anyio.fail_after(3), pytest.raises(StillRunning) as refused:
            await protect.run("k", held)
        release.set()
    assert refused.value.retry_after > 0
    assert await protect.run("k", held) == "done"


@pytest.mark.parametrize(
    ("codec", "value"),
    [
        (None, {"nested": [1, 2.5, None, "é"], "ok": True}),
        (BytesCodec(), b"\x00\xff binary"),
    ],
)
async def test_results_round_trip_through_their_codec(
    store: Store, codec: BytesCodec | None, value: Any
) -> None:
    protect = IdempotentFunctions(store, codec=codec)
    runs: list[int] = []

    async def make() -> Any:
        runs.append(1)
        return value

    assert await protect.run("k", make) == value
    assert await protect.run("k", make) == value
    assert runs == [1]


class Fraction:
    def __init__(self, top: int, bottom: int) -> None:
        self.top, self.bottom = top, bottom


class FractionCodec:
    """A user's own codec."""

    def encode(self, value: Any) -> bytes:
        return f"{value.top}/{value.bottom}".encode()

    def decode(self, data: bytes) -> Any:
        top, bottom = data.decode().split("/")
        return Fraction(int(top), int(bottom))


async def test_a_users_own_codec() -> None:
    from idempotency_mw.testing import MemoryStore

    protect = IdempotentFunctions(MemoryStore(), codec=FractionCodec())
    await protect.run("k", lambda: Fraction(3, 4))
    replayed = await protect.run("k", lambda: Fraction(3, 4))
    assert (replayed.top, replayed.bottom) == (3, 4)


async def test_a_result_too_large_or_not_encodable_is_recorded_as_not_replayable(
    store: Store,
) -> None:
    protect = IdempotentFunctions(store, max_result_bytes=100)
    runs: list[str] = []

    async def big(kind: str) -> Any:
        runs.append(kind)
        return "x" * 200 if kind == "big" else {1, 2}  # a set is not JSON

    assert await protect.run("big", big, "big") == "x" * 200
    assert await protect.run("set", big, "set") == {1, 2}  # the first caller gets its value
    for key, kind in (("big", "big"), ("set", "set")):
        with pytest.raises(ResultNotReplayable):
            await protect.run(key, big, kind)
    assert runs == ["big", "set"]


async def test_arguments_that_are_not_json_need_a_fingerprint() -> None:
    from idempotency_mw.testing import MemoryStore

    protect = IdempotentFunctions(MemoryStore())
    with pytest.raises(ConfigurationError, match="fingerprint="):
        await protect.run("k", lambda when: when, object())

    @protect(key=lambda item: "k", fingerprint=lambda item: str(item.top))
    async def keep(item: Fraction) -> int:
        return item.top

    assert await keep(Fraction(1, 2)) == 1
    with pytest.raises(KeyReused):
        await keep(Fraction(2, 2))


@pytest.fixture
async def effect_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_url(database_url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(effects.delete())
    yield engine
    await engine.dispose()


async def count(engine: AsyncEngine, ref: str) -> int:
    async with engine.connect() as conn:
        result = await conn.scalar(
            select(func.count()).select_from(effects).where(effects.c.message_id == ref)
        )
    return int(result or 0)


async def test_a_fenced_effect_that_then_fails_is_never_run_again(
    database_url: str, effect_engine: AsyncEngine
) -> None:
    store = await fresh_sql_store(database_url)
    protect = IdempotentFunctions(store)

    async def ship(ref: str) -> None:
        async with effect_engine.begin() as conn:
            await conn.execute(effects.insert().values(message_id=ref))
            await fence(conn)
        raise RuntimeError("the mailer failed after the commit")

    with pytest.raises(RuntimeError):
        await protect.run("k", ship, "r")
    with pytest.raises(CommittedWithoutResult):
        await protect.run("k", ship, "r")
    assert await count(effect_engine, "r") == 1
    await store.aclose()


async def test_fence_sync_in_a_sync_function(database_url: str, effect_engine: AsyncEngine) -> None:
    store = await fresh_sql_store(database_url)
    protect = IdempotentFunctions(store)
    engine = create_engine(sync_url(database_url))

    def ship(ref: str) -> int:
        with engine.begin() as conn:
            conn.execute(effects.insert().values(message_id=ref))
            fence_sync(conn)
        return 1

    assert [await protect.run("k", ship, "s") for _ in range(2)] == [1, 1]
    assert await count(effect_engine, "s") == 1
    engine.dispose()
    await store.aclose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "redis"])
async def test_a_crashed_workers_key_is_taken_over_once_its_lease_lapses(
    backend: str, tmp_path: Path
) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'idempotency.db'}"
        await (await fresh_sql_store(url)).aclose()
    elif backend == "postgresql":
        url = POSTGRESQL_URL
        require_server(url)
        await (await fresh_sql_store(url)).aclose()
    else:
        url = REDIS_URL
        require_server(url)
    prefix = redis_prefix("fn")
    key = f"charge:{uuid.uuid4().hex}"
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.function_worker", url, prefix, key, stdout=PIPE
    )
    try:
        assert worker.stdout is not None
        assert (await worker.stdout.readline()).strip() == b"started"
        worker.kill()  # between its claim and its outcome
        await worker.wait()
        store = store_at(url, prefix)
        protect = protected(store)
        with pytest.raises(StillRunning):  # its lease has not lapsed yet
            await protect.call(key, "charge:o-1", lambda: charge("o-1"), name="charge")
        await anyio.sleep(LEASE)
        result = await protect.call(key, "charge:o-1", lambda: charge("o-1"), name="charge")
        again = await protect.call(key, "charge:o-1", lambda: charge("o-2"), name="charge")
        assert result == again == {"charged": "o-1", "by": "the retry"}
        await protect.aclose()
        await store.aclose()
    finally:
        if worker.returncode is None:
            worker.kill()
            await worker.wait()
        if backend == "redis":
            forget_redis_prefix(prefix)


def test_options_are_checked() -> None:
    from idempotency_mw.testing import MemoryStore

    for options in ({"scope": ""}, {"max_result_bytes": -1}, {"on_lease_lost": "ignore"}):
        with pytest.raises(ConfigurationError):
            IdempotentFunctions(MemoryStore(), **options)


@pytest.mark.parametrize("key", ["a\x00b", "a\r\nb", "clé", "a b", "", "x" * 256])
async def test_a_key_an_http_request_could_not_carry_is_refused_before_anything_runs(
    store: Store, key: str
) -> None:
    protect = IdempotentFunctions(store)
    runs: list[str] = []

    @protect(key=lambda order: key)
    async def charge(order: str) -> str:
        runs.append(order)
        return order

    with pytest.raises(InvalidKey, match="1-255 visible ASCII characters") as refused:
        await charge("o-1")
    assert isinstance(refused.value, ConfigurationError)  # never retryable as it is
    assert runs == []


async def test_the_first_call_checks_the_stores_schema(tmp_path: Path) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'empty.db'}")
    protect = IdempotentFunctions(store)
    runs: list[str] = []
    for _ in range(2):  # a table that is still missing says so again
        with pytest.raises(SchemaError, match="idempotency-mw migrate"):
            await protect.run("k", runs.append, "ran")
    await store.aclose()
    assert runs == []


def test_a_lease_is_kept_on_a_loop_that_anyio_did_not_start() -> None:
    """Under uvicorn, or ``asyncio.run``, nothing tells anyio which library runs the loop but
    the running task: the lease keeper must start from the call's task, not a loop callback."""
    from idempotency_mw.testing import MemoryStore

    class CountedRenewals(MemoryStore):
        renewals = 0

        async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
            self.renewals += 1
            return await super().renew(scope, key, token, lease=lease)

    problems: list[dict[str, Any]] = []
    store = CountedRenewals()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: problems.append(context))
        protect = IdempotentFunctions(store, lease=0.3)

        async def work() -> int:
            await asyncio.sleep(0.25)  # past a third of the lease: a renewal is due
            return 1

        result: int = await protect.call("k", "f", work, name="work")
        return result

    assert asyncio.run(main()) == 1
    assert problems == []
    assert store.renewals >= 1
