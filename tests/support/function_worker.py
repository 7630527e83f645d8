"""A worker process of the idempotent-function tests that crashes mid-call.

``python -m tests.support.function_worker URL PREFIX KEY``: runs :func:`charge` under KEY on
the store at URL (Redis keys under PREFIX) with a lease of :data:`LEASE` seconds, prints
``started`` once the body runs, and never finishes (the test kills it).
"""

from __future__ import annotations

import asyncio
import sys

import anyio

from idempotency_mw import RedisStore, SQLStore, Store
from idempotency_mw.functions import IdempotentFunctions

#: Long enough for the test to open a store and see the key held on a loaded machine.
LEASE = 2.0


def store_at(url: str, prefix: str) -> Store:
    return RedisStore(url, prefix=prefix) if url.startswith("redis") else SQLStore(url)


async def charge(order: str, *, hang: bool = False) -> dict[str, str]:
    """The effect; ``hang`` is left out of the fingerprint, see :func:`protected`."""
    if hang:
        print("started", flush=True)
        await anyio.sleep_forever()
    return {"charged": order, "by": "the retry"}


def protected(store: Store) -> IdempotentFunctions:
    return IdempotentFunctions(store, lease=LEASE)


async def main(url: str, prefix: str, key: str) -> None:
    protect = protected(store_at(url, prefix))
    await protect.call(key, "charge:o-1", lambda: charge("o-1", hang=True), name="charge")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
