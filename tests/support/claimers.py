"""One key claimed at once from several processes, spawned so that they share nothing but the
store. A module of its own: each process imports only this and the store it opens."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from idempotency_mw.stores.base import Store

#: The claims each process sends at once.
CLAIMS_PER_PROCESS = 10


def sql_store(url: str) -> Store:
    from idempotency_mw import SQLStore

    return SQLStore(url)


def redis_store(url: str, prefix: str) -> Store:
    from idempotency_mw import RedisStore

    return RedisStore(url, prefix=prefix)


def _claim(open_store: Callable[[], Store], results: multiprocessing.Queue[str]) -> None:
    async def run() -> list[str]:
        store = open_store()
        try:
            claims = await asyncio.gather(
                *(
                    store.claim("", "shared", "f", ttl=60, lease=30)
                    for _ in range(CLAIMS_PER_PROCESS)
                )
            )
        finally:
            await store.aclose()
        return [claim.outcome.value for claim in claims]

    for outcome in asyncio.run(run()):
        results.put(outcome)


async def outcomes_from_processes(
    open_store: Callable[[], Store], *, processes: int = 4
) -> list[str]:
    """The outcomes of every claim of the key ``"shared"`` that ``processes`` processes, started
    together, send at once, each on the store ``open_store()`` (a picklable callable) gives it."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[str] = context.Queue()
    workers = [context.Process(target=_claim, args=(open_store, results)) for _ in range(processes)]
    for worker in workers:
        worker.start()

    def collect() -> list[str]:
        outcomes = [results.get(timeout=60) for _ in range(processes * CLAIMS_PER_PROCESS)]
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0
        return outcomes

    return await asyncio.to_thread(collect)
