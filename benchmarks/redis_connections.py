"""RedisStore's Redis traffic through three connections, side by side in one run.

Each request is what the store sends for a first request: the claim script, then the complete
script (EVALSHA, a 200-byte body). Through: our pipelined connection
(``idempotency_mw.stores.redis.resp``), redis-py's asyncio client, and coredis (which
multiplexes commands over few connections). Printed per connection: p50 and p99 of one request
alone (µs), and with 64 requests at once, requests per second and the CPU time this process
spent per request (µs).

    python -m benchmarks.redis_connections [--url redis://127.0.0.1:6379/15] [--requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import redis.asyncio

from benchmarks.common import REDIS_URL
from idempotency_mw.stores.redis import scripts
from idempotency_mw.stores.redis.resp import PipelinedConnection
from idempotency_mw.stores.redis.store import _plain_address

#: Runs one script: ``(sha, key, *args)``; loads one: ``(source)``.
EvalSha = Callable[..., Awaitable[Any]]
Load = Callable[[str], Awaitable[Any]]
Connection = tuple[EvalSha, Load]
BODY = b"x" * 200
CONCURRENCY = 64


@asynccontextmanager
async def pipelined(url: str) -> AsyncIterator[Connection]:
    address = _plain_address(url)
    assert address is not None, "the pipelined connection takes a plain redis:// URL"
    connection = PipelinedConnection(address, timeout=5)

    async def evalsha(sha: str, key: str, *args: Any) -> Any:
        return await connection.execute("EVALSHA", sha, 1, key, *args)

    async def load(source: str) -> Any:
        return await connection.execute("SCRIPT", "LOAD", source)

    try:
        yield evalsha, load
    finally:
        await connection.aclose()


@asynccontextmanager
async def redis_py(url: str) -> AsyncIterator[Connection]:
    client = redis.asyncio.Redis.from_url(url, socket_timeout=5)

    async def evalsha(sha: str, key: str, *args: Any) -> Any:
        return await client.evalsha(sha, 1, key, *args)

    try:
        yield evalsha, client.script_load
    finally:
        await client.aclose()


@asynccontextmanager
async def coredis_client(url: str) -> AsyncIterator[Connection]:
    import coredis  # the bench extra's; without it the row is left out

    client: coredis.Redis[bytes] = coredis.Redis.from_url(url, stream_timeout=5)

    async def evalsha(sha: str, key: str, *args: Any) -> Any:
        return await client.evalsha(sha, keys=[key], args=list(args))

    async with client:
        yield evalsha, client.script_load


CONNECTIONS: dict[str, Callable[[str], AbstractAsyncContextManager[Connection]]] = {
    "ours (pipelined)": pipelined,
    "redis-py": redis_py,
    "coredis": coredis_client,
}


async def first_request(evalsha: EvalSha, prefix: str) -> None:
    key, token = f"{prefix}{{{uuid.uuid4().hex}}}", uuid.uuid4().hex
    await evalsha(scripts.CLAIM.sha, key, "f" * 64, token, 60_000, 30_000)
    channel, digest = f"{prefix}settled", "0" * 12  # nobody listens: the PUBLISH costs no fan-out
    await evalsha(
        scripts.COMPLETE.sha, key, token, 60_000, channel, digest, "completed", 201, b"", BODY
    )


async def measure(name: str, url: str, requests: int) -> dict[str, float]:
    prefix = f"bench-conn-{uuid.uuid4().hex[:8]}:"
    async with CONNECTIONS[name](url) as (evalsha, load):
        for script in scripts.ALL:
            await load(script.source)
        for _ in range(200):  # warm-up
            await first_request(evalsha, prefix)
        alone = []
        for _ in range(requests // 5):
            began = time.perf_counter()
            await first_request(evalsha, prefix)
            alone.append((time.perf_counter() - began) * 1e6)
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                await first_request(evalsha, prefix)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    cleaner = redis.asyncio.Redis.from_url(url)
    keys = [key async for key in cleaner.scan_iter(match=f"{prefix}*", count=1000)]
    for start in range(0, len(keys), 1000):
        await cleaner.delete(*keys[start : start + 1000])
    await cleaner.aclose()
    return {
        "p50 alone (µs)": statistics.median(alone),
        "p99 alone (µs)": statistics.quantiles(alone, n=100)[98],
        f"req/s at {CONCURRENCY}": requests / wall,
        "CPU µs/req": cpu / requests * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=REDIS_URL)
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    results = {}
    for name in CONNECTIONS:
        try:
            results[name] = asyncio.run(measure(name, args.url, args.requests))
        except ImportError as exc:
            print(f"{name}: left out ({exc})", file=sys.stderr)
    columns = list(next(iter(results.values())))
    print(f"| connection | {' | '.join(columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for name, figures in results.items():
        print(f"| {name} | {' | '.join(f'{figures[c]:,.0f}' for c in columns)} |")


if __name__ == "__main__":
    main()
