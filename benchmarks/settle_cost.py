"""What announcing settled records costs ``complete()``: ``python -m benchmarks.settle_cost``.

For PostgreSQL and Redis it times ``complete()`` of records claimed beforehand: one at a time
(median and p99 latency) and from ``--tasks`` concurrent tasks (completes per second), while
``--listeners`` other processes watch the store's settlement feed, as the workers of a service
do. On PostgreSQL the feed is ``settlement_notices=True``; a store without it (the default)
runs beside it, rounds alternating, so the two rows differ by the NOTIFY alone.
Uses the ``idempotency_bench`` database and Redis db 15 (see ``benchmarks/common.py``).

    python -m benchmarks.settle_cost [--records 2000] [--tasks 32] [--listeners 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

from benchmarks.common import (
    POSTGRESQL_URL,
    REDIS_URL,
    check_loopback,
    markdown_table,
    prepare_sql,
    wipe_redis,
)
from idempotency_mw import RedisStore, SQLStore, Store, StoredResponse

RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id": 1}')


def make_store(url: str, prefix: str, *, announced: bool = True) -> Store:
    if url.startswith("redis"):
        return RedisStore(url, prefix=prefix)
    return SQLStore(url, settlement_notices=announced)


async def claimed(store: Store, count: int) -> list[tuple[str, str, str]]:
    scope = uuid.uuid4().hex
    records = []
    for index in range(count):
        claim = await store.claim(scope, f"k{index}", "f" * 64, ttl=600, lease=60)
        assert claim.token is not None
        records.append((scope, f"k{index}", claim.token))
    return records


async def one_at_a_time(store: Store, count: int) -> tuple[float, float]:
    """Median and p99 of ``complete()``, in microseconds."""
    took = []
    for scope, key, token in await claimed(store, count):
        began = time.perf_counter()
        assert await store.complete(scope, key, token, RESPONSE, ttl=600)
        took.append((time.perf_counter() - began) * 1e6)
    took.sort()
    return statistics.median(took), took[int(len(took) * 0.99)]


async def concurrently(store: Store, count: int, tasks: int) -> float:
    """Completes per second from ``tasks`` tasks."""
    records = iter(await claimed(store, count))

    async def worker() -> None:
        for scope, key, token in records:
            assert await store.complete(scope, key, token, RESPONSE, ttl=600)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(tasks)))
    return count / (time.perf_counter() - began)


@contextlib.contextmanager
def listeners(url: str, prefix: str, count: int) -> Iterator[None]:
    """``count`` processes that each watch the store's settlement feed."""
    command = [sys.executable, "-m", "benchmarks.settle_cost", "--listen", url, prefix]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(count)]
    try:
        for process in processes:
            assert process.stdout is not None
            assert process.stdout.readline() == b"listening\n"
        yield
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


async def listen(url: str, prefix: str) -> None:
    store = make_store(url, prefix)
    assert isinstance(store, SQLStore | RedisStore)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    watch = asyncio.ensure_future(store.watch_settlements(lambda digest: None))
    await asyncio.sleep(0.5)  # connected and subscribed by then
    print("listening", flush=True)
    await stop.wait()
    await store.aclose()
    await watch


async def measure(url: str, args: argparse.Namespace) -> list[list[str]]:
    prefix = f"bench-settle-{uuid.uuid4().hex[:8]}:"
    variants = {"announced": make_store(url, prefix)}
    if not url.startswith("redis"):
        variants = {"silent": make_store(url, prefix, announced=False), **variants}
    rows = []
    with listeners(url, prefix, args.listeners):
        for store in variants.values():
            await one_at_a_time(store, 200)  # warm-up
        for _ in range(args.rounds):
            for name, store in variants.items():
                median, p99 = await one_at_a_time(store, args.records)
                throughput = await concurrently(store, args.records, args.tasks)
                backend = url.partition(":")[0]
                rows.append([backend, name, f"{median:.0f}", f"{p99:.0f}", f"{throughput:.0f}"])
                print(" | ".join(rows[-1]), flush=True)
    for store in variants.values():
        await store.aclose()
    if url.startswith("redis"):
        await wipe_redis(url, prefix)
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--listeners", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--listen", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.listen:
        await listen(*args.listen)
        return
    await prepare_sql(POSTGRESQL_URL)
    rows = []
    for url in (check_loopback(POSTGRESQL_URL), check_loopback(REDIS_URL)):
        rows += await measure(url, args)
    await prepare_sql(POSTGRESQL_URL)
    headers = ["store", "statements", "median µs", "p99 µs", f"{args.tasks} tasks: completes/s"]
    print()
    print(f"{args.listeners} listening processes, {args.records} records per figure")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    asyncio.run(main())
