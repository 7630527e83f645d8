"""What a key adds to an MCP tool call, next to what it adds to an HTTP request, per store.

In one run, on each store (MemoryStore, SQLite, Redis), four things are timed in turn, one call
of each after another in a shuffled order, so that drift and cold caches hit all alike: a plain
tool call (the mcp SDK's in-process client and server, no key), a protected one
(``IdempotentTools``, a fresh ``_meta.idempotencyKey`` each: claim, run, record), a plain HTTP
request (hand-built ASGI into a Starlette endpoint behind the middleware, no key) and a keyed
one (a fresh ``Idempotency-Key`` each). The figures are µs per call (p50), what the key adds in
each, and the ratio of the two additions: at most 1 means a protected tool call adds no more
than a keyed HTTP request on that store.

    python -m benchmarks.tool_calls [-n 1500] [--stores memory,sqlite,redis]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mcp.client.client import Client
from mcp.server.mcpserver import MCPServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from benchmarks.common import (
    REDIS_PREFIX,
    REDIS_URL,
    Summary,
    call,
    fmt,
    loadavg,
    markdown_table,
    prepare_sql,
    server_reachable,
    sqlite_url,
    wipe_redis,
)
from idempotency_mw import IdempotencyMiddleware, RedisStore, SQLStore, Store
from idempotency_mw.client.mcp import key_meta
from idempotency_mw.mcp import IdempotentMCPServer, IdempotentTools
from idempotency_mw.testing import MemoryStore

STORES = ("memory", "sqlite", "redis")
BODY = b'{"title": "printer on fire"}'
KINDS = ("tool", "tool+key", "http", "http+key")


async def open_store(name: str, directory: Path) -> Store | None:
    """The store ``name``, empty; ``None`` when its server is not running."""
    if name == "memory":
        return MemoryStore()
    if name == "sqlite":
        url = sqlite_url(directory)
        await prepare_sql(url)
        return SQLStore(url)
    if not server_reachable(REDIS_URL):
        return None
    await wipe_redis()
    return RedisStore(REDIS_URL, prefix=REDIS_PREFIX)


def http_app(store: Store) -> Any:
    async def create_ticket(request: Request) -> JSONResponse:
        return JSONResponse({"id": 1, **await request.json()}, status_code=201)

    app = Starlette(routes=[Route("/tickets", create_ticket, methods=["POST"])])
    return IdempotencyMiddleware(app, store=store)


def tool_server(store: Store) -> MCPServer:
    server = IdempotentMCPServer("bench", extensions=[IdempotentTools(store)], log_level="WARNING")

    @server.tool()
    async def create_ticket(title: str) -> dict[str, Any]:
        return {"id": 1, "title": title}

    return server


async def measure(store: Store, n: int, warmup: int) -> dict[str, Summary]:
    """Each kind's µs per call on ``store``, ``n`` calls of each."""
    app = http_app(store)
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    async with Client(tool_server(store)) as client:
        arguments = {"title": "printer on fire"}
        kinds: dict[str, Callable[[], Awaitable[object]]] = {
            "tool": lambda: client.call_tool("create_ticket", arguments),
            "tool+key": lambda: client.call_tool(
                "create_ticket", arguments, meta=key_meta(uuid.uuid4().hex)
            ),
            "http": lambda: call(app, "/tickets", BODY),
            "http+key": lambda: call(app, "/tickets", BODY, key=uuid.uuid4().hex),
        }
        for _ in range(warmup):
            for one in kinds.values():
                await one()
        # One call of each kind in turn, so that the machine's drift (other processes, a VM's
        # neighbours) weighs on the four alike; in a shuffled order, since a call that follows
        # one of the other entry starts on a cold cache, and a fixed order would favour a kind.
        order = list(KINDS)
        shuffler = random.Random(0)
        for _ in range(n):
            shuffler.shuffle(order)
            for kind in order:
                started = time.perf_counter()
                await kinds[kind]()
                samples[kind].append((time.perf_counter() - started) * 1e6)
    return {kind: Summary.of(values) for kind, values in samples.items()}


def row(name: str, figures: dict[str, Summary]) -> list[str]:
    p50 = {kind: figures[kind].p50 for kind in KINDS}
    tool_added = p50["tool+key"] - p50["tool"]
    http_added = p50["http+key"] - p50["http"]
    ratio = tool_added / http_added if http_added > 0 else float("nan")
    return [
        name,
        *(fmt(p50[kind]) for kind in KINDS),
        fmt(tool_added),
        fmt(http_added),
        fmt(ratio, 2),
    ]


async def main_async(args: argparse.Namespace) -> str:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as tmp:
        for name in args.stores.split(","):
            store = await open_store(name, Path(tmp))
            if store is None:
                rows.append([name, *["-"] * 7 + ["server not running"]][:8])
                continue
            try:
                figures = await measure(store, args.calls, args.warmup)
            finally:
                await store.aclose()
                if name == "redis":
                    await wipe_redis()
            rows.append(row(name, figures))
    headers = [
        "store",
        *(f"{kind} p50 µs" for kind in KINDS),
        "key adds to a tool call",
        "key adds to an HTTP request",
        "ratio (tool / HTTP)",
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--calls", type=int, default=1500, help="timed calls of each kind")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls of each kind")
    parser.add_argument("--stores", default=",".join(STORES), help=f"of {','.join(STORES)}")
    args = parser.parse_args(argv)
    before = loadavg()
    print(asyncio.run(main_async(args)))
    print(f"\nLoad average before / after: {before} / {loadavg()}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
