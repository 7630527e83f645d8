"""What fence() adds to a first request: ``python -m benchmarks.fenced``.

One route whose handler inserts a row and commits, timed side by side in one run, in chunks
that alternate: **plain** (the route without the middleware: the same INSERT and COMMIT),
**fenced** (the middleware in front, a key per request, ``fence()`` in the handler's
transaction: three durable flushes) and **declared** (the same, the route declared
``@idempotent(fenced=True)``: its claim and completion skip their own flush). Three set-ups:
SQLite in WAL with the store on the same file, PostgreSQL with the store on the same database
(one row of one table), and a RedisStore beside a PostgreSQL app database (the proof row in
``idempotency_proofs``). Printed: p50 and p99 in µs, and what each
fenced request adds as a multiple of the plain one. Uses the bench database and Redis db 15
(see ``benchmarks/common.py``).

    python -m benchmarks.fenced [--requests 600] [--chunk 100]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import (
    POSTGRESQL_URL,
    REDIS_PREFIX,
    REDIS_URL,
    Lifespan,
    Summary,
    call,
    fmt,
    markdown_table,
    now_us,
    prepare_sql,
    server_reachable,
    sqlite_url,
    wipe_redis,
)

PATH = "/orders"
BODY = b'{"item": "tea"}'


def order_app(engine: Any, store: Any | None, *, declared: bool = False) -> Any:
    """The route; with ``store``, behind the middleware and fenced (``declared``: and
    declared so)."""
    from fastapi import FastAPI
    from sqlalchemy import text

    from idempotency_mw import IdempotencyMiddleware, fence, idempotent

    app = FastAPI()
    if store is not None:
        app.add_middleware(IdempotencyMiddleware, store=store)
    insert = text("INSERT INTO bench_orders (id, item) VALUES (:id, :item)")

    @app.post(PATH, status_code=201)
    @idempotent(fenced=declared)
    async def order() -> dict[str, str]:
        order_id = uuid.uuid4().hex
        async with engine.begin() as connection:
            await connection.execute(insert, {"id": order_id, "item": "tea"})
            if store is not None:
                await fence(connection)
        return {"id": order_id}

    return app


@asynccontextmanager
async def app_database(url: str) -> AsyncIterator[Any]:
    """``url``'s engine, with the route's table and the proof table, both empty. SQLite's file
    is put in WAL (which lasts, so the store's connections to it use WAL too)."""
    from sqlalchemy import event, text
    from sqlalchemy.ext.asyncio import create_async_engine

    from idempotency_mw.engine.proofs import proof_metadata
    from idempotency_mw.stores.sql import async_url

    engine = create_async_engine(async_url(url))
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def wal(dbapi_connection: Any, _: Any) -> None:
            dbapi_connection.execute("PRAGMA journal_mode=WAL")

    async with engine.begin() as connection:
        await connection.execute(text("DROP TABLE IF EXISTS bench_orders"))
        await connection.execute(
            text("CREATE TABLE bench_orders (id VARCHAR(32) PRIMARY KEY, item TEXT)")
        )
        await connection.run_sync(proof_metadata.drop_all)
        await connection.run_sync(proof_metadata.create_all)
    try:
        yield engine
    finally:
        await engine.dispose()


async def side_by_side(
    name: str, app_url: str, store_url: str, requests: int, chunk: int
) -> list[object]:
    from idempotency_mw import RedisStore, SQLStore

    if store_url.startswith("redis"):
        await wipe_redis(store_url)
        store: Any = RedisStore(store_url, prefix=REDIS_PREFIX)
    else:
        await prepare_sql(store_url)
        store = SQLStore(store_url)
    async with app_database(app_url) as engine, AsyncExitStack() as stack:
        apps = {
            "plain": order_app(engine, None),
            "fenced": order_app(engine, store),
            "declared": order_app(engine, store, declared=True),
        }
        for app in apps.values():
            await stack.enter_async_context(Lifespan(app))
        samples: dict[str, list[float]] = {mode: [] for mode in apps}
        for app in apps.values():  # warm up
            for _ in range(30):
                await call(app, PATH, BODY, key=uuid.uuid4().hex)
        gc.collect()
        for _ in range(max(1, requests // chunk)):
            for mode, app in apps.items():
                for _ in range(chunk):
                    started = now_us()
                    reply = await call(app, PATH, BODY, key=uuid.uuid4().hex)
                    samples[mode].append(now_us() - started)
                    if reply.status != 201:
                        raise RuntimeError(f"{name} {mode}: {reply.status} {reply.body!r}")
    await store.aclose()
    plain = Summary.of(samples["plain"])
    row: list[object] = [name, f"{fmt(plain.p50)} / {fmt(plain.p99)}"]
    for mode in ("fenced", "declared"):
        fenced = Summary.of(samples[mode])
        added = fenced.p50 - plain.p50
        row += [
            f"{fmt(fenced.p50)} / {fmt(fenced.p99)}",
            f"+{fmt(added)}, {added / plain.p50:.2f}x",
        ]
    return row


async def main_async(args: argparse.Namespace) -> str:
    directory = Path(tempfile.mkdtemp(prefix="bench-fenced-"))
    setups: list[tuple[str, str, str | None]] = [
        ("SQLite (WAL), store on the same file", sqlite_url(directory), None)
    ]
    if server_reachable(POSTGRESQL_URL):
        setups.append(("PostgreSQL, store on the same database", POSTGRESQL_URL, None))
        if server_reachable(REDIS_URL):
            setups.append(("PostgreSQL app database, RedisStore", POSTGRESQL_URL, REDIS_URL))
    rows = []
    for name, app_url, store_url in setups:
        rows.append(
            await side_by_side(name, app_url, store_url or app_url, args.requests, args.chunk)
        )
    return markdown_table(
        [
            "set-up",
            "plain p50 / p99 µs",
            "fenced p50 / p99 µs",
            "fenced adds p50 µs, / plain",
            "fenced=True p50 / p99 µs",
            "fenced=True adds p50 µs, / plain",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=600, help="per mode and set-up")
    parser.add_argument("--chunk", type=int, default=100, help="requests per turn")
    print(asyncio.run(main_async(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
