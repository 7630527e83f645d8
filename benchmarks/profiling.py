"""Where a keyed request's time goes: micro-costs, a per-request breakdown, and profiles.

1. Micro-costs, each timed alone (wall p50/p99 and process CPU per operation): thread hops,
   aiosqlite with and without SQLAlchemy, sync sqlite3 in WAL mode, the store's own calls on
   each backend (and on PostgreSQL through SQLAlchemy's engine), asyncpg's pool beside the
   store's, Redis, and the middleware's own steps.
2. Breakdown of a first request through the FastAPI app on each store: total, ``claim``,
   ``complete`` (timed by a delegating store wrapper), and the rest.
3. Driver calls per claim/complete: aiosqlite thread hops, PostgreSQL round trips.
4. A pyinstrument profile of first requests and of replays on each store: the top functions by own
   time (the full text reports go to ``--profile-dir``).

    python -m benchmarks.profiling [-n 1000] [--profile-dir benchmarks/profiles]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sqlite3
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.datastructures import Headers

from benchmarks.apps import BODY, PATH, build_app, prepare, unavailable
from benchmarks.common import (
    MARIADB_URL,
    POSTGRESQL_URL,
    REDIS_PREFIX,
    REDIS_URL,
    Lifespan,
    Summary,
    call,
    fmt,
    http_scope,
    loadavg,
    markdown_table,
    now_us,
    prepare_sql,
    server_reachable,
    sqlite_url,
    write_json,
)
from idempotency_mw import SQLStore
from idempotency_mw._asgi import parse_key
from idempotency_mw.fingerprint import request_fingerprint
from idempotency_mw.middleware import IdempotencyMiddleware
from idempotency_mw.records import Claim, ClaimOutcome, StoredResponse
from idempotency_mw.stores.sql import async_url

FP = "f" * 64
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id": "x"}')
TTL, LEASE = 86400.0, 60.0


@dataclass
class Cost:
    section: str
    what: str
    wall: Summary
    cpu_us: float
    note: str = ""


async def timed(
    fn: Callable[[], Awaitable[Any]], n: int, warmup: int = 50
) -> tuple[Summary, float]:
    for _ in range(warmup):
        await fn()
    gc.collect()
    samples = []
    cpu = time.process_time()
    for _ in range(n):
        started = now_us()
        await fn()
        samples.append(now_us() - started)
    return Summary.of(samples), (time.process_time() - cpu) / n * 1e6


def timed_sync(fn: Callable[[], Any], n: int, warmup: int = 50) -> tuple[Summary, float]:
    for _ in range(warmup):
        fn()
    gc.collect()
    samples = []
    cpu = time.process_time()
    for _ in range(n):
        started = now_us()
        fn()
        samples.append(now_us() - started)
    return Summary.of(samples), (time.process_time() - cpu) / n * 1e6


def tune_sqlite(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


# ---------------------------------------------------------------- counting driver calls


@contextmanager
def counting(target: Any, attribute: str, counts: Counter[str], label: str) -> Iterator[None]:
    """Count calls of ``target.attribute`` (an async method) while inside the block."""
    original = getattr(target, attribute)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[label] += 1
        return await original(*args, **kwargs)

    setattr(target, attribute, wrapper)
    try:
        yield
    finally:
        setattr(target, attribute, original)


@contextmanager
def counting_sync(target: Any, attribute: str, counts: Counter[str], label: str) -> Iterator[None]:
    """Count calls of ``target.attribute`` (a plain method) while inside the block."""
    original = getattr(target, attribute)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[label] += 1
        return original(*args, **kwargs)

    setattr(target, attribute, wrapper)
    try:
        yield
    finally:
        setattr(target, attribute, original)


@contextmanager
def driver_counters(counts: Counter[str]) -> Iterator[None]:
    """Thread hops (aiosqlite's queue, run_in_executor) and socket writes (round trips)."""
    import asyncio.base_events
    import asyncio.selector_events

    import aiosqlite.core

    with (
        counting(aiosqlite.core.Connection, "_execute", counts, "aiosqlite hop"),
        counting_sync(asyncio.base_events.BaseEventLoop, "run_in_executor", counts, "executor hop"),
        counting_sync(
            getattr(asyncio.selector_events, "_SelectorSocketTransport"),  # noqa: B009
            "write",
            counts,
            "socket write",
        ),
    ):
        yield


async def store_calls(name: str, store: Any) -> list[tuple[str, str, str]]:
    """Driver calls of one claim (new key), complete, and claim of a completed key."""
    rows = []
    await store.startup()
    for _ in range(3):  # warm up: pool connections, prepared statements, script SHAs
        key = f"hw-{uuid.uuid4().hex}"
        claim = await store.claim("", key, FP, ttl=TTL, lease=LEASE)
        assert claim.token
        await store.complete("", key, claim.token, RESPONSE, ttl=TTL)
        await store.claim("", key, FP, ttl=TTL, lease=LEASE)
    for op in ("claim", "complete", "claim (replay)"):
        counts: Counter[str] = Counter()
        key = f"h-{uuid.uuid4().hex}"
        if op == "claim":
            with driver_counters(counts):
                await store.claim("", key, FP, ttl=TTL, lease=LEASE)
        else:
            claim = await store.claim("", key, FP, ttl=TTL, lease=LEASE)
            assert claim.token
            if op == "complete":
                with driver_counters(counts):
                    await store.complete("", key, claim.token, RESPONSE, ttl=TTL)
            else:
                await store.complete("", key, claim.token, RESPONSE, ttl=TTL)
                with driver_counters(counts):
                    await store.claim("", key, FP, ttl=TTL, lease=LEASE)
        detail = ", ".join(f"{v} {k}s" for k, v in sorted(counts.items())) or "none"
        rows.append((name, f"store.{op}", detail))
    await store.aclose()
    return rows


async def driver_calls(directory: Path, have_pg: bool) -> list[tuple[str, str, str]]:
    """Thread hops and socket writes (~ round trips) per store operation, and per SELECT."""
    import aiosqlite.core

    url = sqlite_url(directory, "hops.db")
    await prepare_sql(url)
    rows = await store_calls("SQLStore, SQLite", SQLStore(url))
    select_one = text("SELECT 1")
    auto = {"isolation_level": "AUTOCOMMIT"}
    for label, engine_kw, option in (
        ("SQLAlchemy, engine.begin(), default engine", {}, None),
        ("SQLAlchemy, engine created with isolation_level=AUTOCOMMIT", auto, None),
        ("SQLAlchemy, engine.execution_options(isolation_level=AUTOCOMMIT)", {}, "AUTOCOMMIT"),
    ):
        base = create_async_engine(async_url(url), **engine_kw)
        engine = base.execution_options(isolation_level=option) if option else base
        for _ in range(3):
            async with engine.begin() as conn:
                await conn.execute(select_one)
        counts: Counter[str] = Counter()
        with driver_counters(counts):
            async with engine.begin() as conn:
                await conn.execute(select_one)
        hops = counts["aiosqlite hop"]
        rows.append(("aiosqlite", f"one SELECT: {label}", f"{hops} aiosqlite hops"))
        await base.dispose()
    raw = await aiosqlite.core.connect(str(async_url(url).database))
    counts = Counter()
    with driver_counters(counts):
        await raw.execute_fetchall("SELECT 1")
    hops = counts["aiosqlite hop"]
    rows.append(("aiosqlite", "one SELECT: raw execute_fetchall", f"{hops} aiosqlite hops"))
    await raw.close()
    if have_pg:
        await prepare_sql(POSTGRESQL_URL)
        rows += await store_calls("SQLStore, PostgreSQL", SQLStore(POSTGRESQL_URL))
    if server_reachable(MARIADB_URL):
        await prepare_sql(MARIADB_URL)
        rows += await store_calls("SQLStore, MariaDB", SQLStore(MARIADB_URL))
    if server_reachable(REDIS_URL):
        from idempotency_mw.stores.redis import RedisStore

        redis_store = RedisStore(REDIS_URL, prefix=f"{REDIS_PREFIX}calls:")
        rows += await store_calls("RedisStore", redis_store)
    return rows


# ---------------------------------------------------------------- micro-costs


async def micro_costs(n: int, directory: Path, have_pg: bool, have_redis: bool) -> list[Cost]:
    costs: list[Cost] = []

    def add(section: str, what: str, result: tuple[Summary, float], note: str = "") -> None:
        costs.append(Cost(section, what, result[0], result[1], note))
        print(f"  {section}: {what}: p50 {result[0].p50:.1f} µs", file=sys.stderr, flush=True)

    # -- event loop and threads
    async def noop() -> None:
        return None

    add("asyncio", "await asyncio.sleep(0)", await timed(lambda: asyncio.sleep(0), n))
    add(
        "asyncio",
        "await asyncio.to_thread(noop)",
        await timed(lambda: asyncio.to_thread(lambda: None), n),
        "one thread hop and back",
    )

    async def task_cancel() -> None:
        task = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0)

    add(
        "asyncio",
        "create_task(sleep) + cancel (the lease keeper)",
        await timed(task_cancel, n),
        "includes 2 loop turns",
    )

    async def shielded() -> None:
        with anyio.CancelScope(shield=True):
            await noop()

    add("asyncio", "anyio.CancelScope(shield=True) around a no-op", await timed(shielded, n))

    # -- SQLite
    url = sqlite_url(directory, "micro.db")
    await prepare_sql(url)
    path = str(async_url(url).database)
    import aiosqlite

    raw = await aiosqlite.connect(path)

    async def aiosqlite_select() -> None:
        cursor = await raw.execute("SELECT 1")
        await cursor.fetchall()
        await cursor.close()

    add("SQLite", "raw aiosqlite: execute + fetchall + close", await timed(aiosqlite_select, n))
    await raw.close()

    engine = create_async_engine(async_url(url))
    event.listen(engine.sync_engine, "connect", tune_sqlite)
    select_one = text("SELECT 1")
    async with engine.connect() as conn:

        async def sa_select() -> None:
            await conn.execute(select_one)

        add("SQLite", "SQLAlchemy async (aiosqlite): execute(SELECT 1)", await timed(sa_select, n))

    async def sa_begin_select() -> None:
        async with engine.begin() as conn:
            await conn.execute(select_one)

    add(
        "SQLite",
        "SQLAlchemy async: engine.begin() + SELECT 1 + commit",
        await timed(sa_begin_select, n),
        "pool checkout/checkin included",
    )
    await engine.dispose()

    sync = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    sync.execute("PRAGMA journal_mode=WAL")
    add("SQLite", "sync sqlite3 (WAL): SELECT 1", timed_sync(lambda: sync.execute("SELECT 1"), n))
    sync.close()

    store = SQLStore(url)
    await store.startup()
    add("SQLite", "SQLStore.claim, new key (working tree)", await timed(lambda: _claim(store), n))
    add(
        "SQLite",
        "SQLStore.claim + complete (working tree)",
        await timed(lambda: _claim_complete(store), n),
    )
    replay_key = await _completed_key(store)
    add(
        "SQLite",
        "SQLStore.claim of a completed key (working tree)",
        await timed(lambda: store.claim("", replay_key, FP, ttl=TTL, lease=LEASE), n),
    )
    await store.aclose()

    # -- PostgreSQL
    if have_pg:
        costs += await pg_costs(n, add)

    # -- Redis
    if have_redis:
        from idempotency_mw.stores.redis import RedisStore

        rstore = RedisStore(REDIS_URL, prefix=f"{REDIS_PREFIX}micro:")
        await rstore.startup()
        add("Redis", "redis-py PING", await timed(rstore.client.ping, n))
        add("Redis", "RedisStore.claim", await timed(lambda: _claim(rstore), n))
        add("Redis", "RedisStore.claim + complete", await timed(lambda: _claim_complete(rstore), n))
        rkey = await _completed_key(rstore)
        add(
            "Redis",
            "RedisStore.claim of a completed key (replay)",
            await timed(lambda: rstore.claim("", rkey, FP, ttl=TTL, lease=LEASE), n),
        )
        await rstore.aclose()

    # -- the middleware's own steps
    built = build_app("bare", sqlite_dir=directory)
    app = built.app
    scope = http_scope(PATH, headers=[(b"idempotency-key", b"abc")], body_length=len(BODY))
    scope["app"] = app
    middleware = IdempotencyMiddleware(app, store=SQLStore(sqlite_url(directory, "unused.db")))
    routes = middleware.routes
    add(
        "middleware",
        "RouteTable.resolve (cached route match for the template)",
        timed_sync(lambda: routes.resolve(app, scope), n),
        "FastAPI matches again in its router",
    )
    add("middleware", "Headers(scope=scope).getlist(key)", timed_sync(
        lambda: Headers(scope=scope).getlist("Idempotency-Key"), n
    ))  # fmt: skip
    add("middleware", "parse_key", timed_sync(lambda: parse_key("3f1c6a0e-key-0001"), n))
    add(
        "middleware",
        "request_fingerprint alone",
        timed_sync(lambda: request_fingerprint("POST", PATH, PATH, b"", [], BODY), n),
    )
    add("middleware", "uuid.uuid4().hex (token)", timed_sync(lambda: uuid.uuid4().hex, n))
    return costs


async def _claim(store: Any) -> Claim:
    claim: Claim = await store.claim("", f"m-{uuid.uuid4().hex}", FP, ttl=TTL, lease=LEASE)
    assert claim.outcome is ClaimOutcome.ACQUIRED
    return claim


async def _claim_complete(store: Any) -> None:
    key = f"m-{uuid.uuid4().hex}"
    claim = await store.claim("", key, FP, ttl=TTL, lease=LEASE)
    assert claim.token
    await store.complete("", key, claim.token, RESPONSE, ttl=TTL)


async def _completed_key(store: Any) -> str:
    key = f"r-{uuid.uuid4().hex}"
    await _claim_complete_key(store, key)
    return key


async def _claim_complete_key(store: Any, key: str) -> None:
    claim = await store.claim("", key, FP, ttl=TTL, lease=LEASE)
    assert claim.token
    await store.complete("", key, claim.token, RESPONSE, ttl=TTL)


async def pg_costs(n: int, add: Callable[..., None]) -> list[Cost]:
    import asyncpg

    await prepare_sql(POSTGRESQL_URL)
    store = SQLStore(POSTGRESQL_URL)
    await store.startup()
    add("PostgreSQL", "SQLStore.claim, new key (working tree)", await timed(
        lambda: _claim(store), n
    ))  # fmt: skip
    add("PostgreSQL", "SQLStore.claim + complete (working tree)", await timed(
        lambda: _claim_complete(store), n
    ))  # fmt: skip
    replay_key = await _completed_key(store)
    add(
        "PostgreSQL",
        "SQLStore.claim of a completed key (working tree)",
        await timed(lambda: store.claim("", replay_key, FP, ttl=TTL, lease=LEASE), n),
        "",
    )
    await store.aclose()

    engine: AsyncEngine = create_async_engine(async_url(POSTGRESQL_URL))
    auto = SQLStore(engine.execution_options(isolation_level="AUTOCOMMIT"))
    add(
        "PostgreSQL",
        "SQLStore(AsyncEngine, AUTOCOMMIT).claim: the SQLAlchemy path",
        await timed(lambda: _claim(auto), n),
        "",
    )
    await engine.dispose()

    parsed = async_url(POSTGRESQL_URL)
    conn = await asyncpg.connect(
        host=parsed.host, port=parsed.port or 5432, user=parsed.username, database=parsed.database
    )
    add("PostgreSQL", "raw asyncpg: SELECT 1", await timed(lambda: conn.fetchval("SELECT 1"), n))
    dsn = parsed.set(drivername="postgresql").render_as_string(False)

    async def no_reset(_connection: Any) -> None:
        return None

    for label, options in (
        ("asyncpg pool.fetchval(SELECT 1), default reset on release", {}),
        ("asyncpg pool.fetchval(SELECT 1), create_pool(reset=no-op)", {"reset": no_reset}),
    ):
        pool: Any = await asyncpg.create_pool(dsn, min_size=1, max_size=2, **options)

        def pooled(pool: Any = pool) -> Awaitable[Any]:
            return pool.fetchval("SELECT 1")  # type: ignore[no-any-return]

        add(
            "PostgreSQL",
            label,
            await timed(pooled, n),
            "the default reset runs a reset query: one more round trip per use",
        )
        await pool.close()
    try:
        from idempotency_mw.stores.sql.drivers.statement_pool import StatementPool
    except ImportError:  # a version of the library from before its own pool
        pass
    else:
        statement_pool = StatementPool(lambda: asyncpg.connect(dsn), max_size=2)
        add(
            "PostgreSQL",
            "the store's StatementPool.fetch(SELECT 1)",
            await timed(lambda: statement_pool.fetch("SELECT 1", ()), n),
            "no reset, no proxy and no task per release",
        )
        await statement_pool.aclose()

    await conn.close()
    return []


# ---------------------------------------------------------------- per-request breakdown


class TimedStore:
    """Delegates to a store and records how long each ``claim``/``complete`` took (µs)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: dict[str, list[float]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        # Whatever else the Store protocol has (or grows) goes straight to the real store.
        return getattr(self.inner, name)

    async def claim(
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float, binding: str = ""
    ) -> Claim:
        started = now_us()
        try:
            result: Claim = await self.inner.claim(
                scope, key, fingerprint, ttl=ttl, lease=lease, binding=binding
            )
            return result
        finally:
            self.times["claim"].append(now_us() - started)

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        started = now_us()
        try:
            done: bool = await self.inner.complete(scope, key, token, response, ttl=ttl)
            return done
        finally:
            self.times["complete"].append(now_us() - started)

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        renewed: bool = await self.inner.renew(scope, key, token, lease=lease)
        return renewed

    async def release(self, scope: str, key: str, token: str) -> bool:
        released: bool = await self.inner.release(scope, key, token)
        return released

    async def startup(self) -> None:
        await self.inner.startup()

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class Breakdown:
    variant: str
    mode: str
    total: Summary
    claim: Summary
    complete: Summary | None
    bare: Summary


async def breakdown(variant: str, n: int, directory: Path) -> list[Breakdown]:
    from fastapi import FastAPI

    from benchmarks.inprocess import time_bare

    bare, _, _ = await time_bare(n, 100, directory)
    await prepare(variant, directory)
    built = build_app(variant, sqlite_dir=directory)
    app: FastAPI = built.app
    middleware = next(
        m for m in app.user_middleware if getattr(m, "cls", None) is IdempotencyMiddleware
    )
    timed_store = TimedStore(middleware.kwargs["store"])
    middleware.kwargs["store"] = timed_store
    out = []
    async with Lifespan(app):
        for mode in ("first", "replay"):
            key = f"b-{uuid.uuid4().hex}"
            if mode == "replay":
                await call(app, PATH, BODY, key=key)
            for i in range(100):
                await call(app, PATH, BODY, key=key if mode == "replay" else f"{key}-w{i}")
            timed_store.times.clear()
            totals = []
            for i in range(n):
                started = now_us()
                await call(app, PATH, BODY, key=key if mode == "replay" else f"{key}-{i}")
                totals.append(now_us() - started)
            complete = timed_store.times.get("complete")
            out.append(
                Breakdown(
                    variant,
                    mode,
                    Summary.of(totals),
                    Summary.of(timed_store.times["claim"]),
                    Summary.of(complete) if complete else None,
                    bare,
                )
            )
    return out


# ---------------------------------------------------------------- pyinstrument


def profile_variant(
    variant: str, n: int, directory: Path, out_dir: Path | None, mode: str = "first"
) -> list[str]:
    """pyinstrument over ``n`` first requests (or replays of one key); the top functions by own
    time, as table rows."""
    from pyinstrument import Profiler

    replayed = f"p-{uuid.uuid4().hex}"

    def key(i: int) -> str:
        return replayed if mode == "replay" else f"p-{uuid.uuid4().hex}-{i}"

    async def run() -> Any:
        await prepare(variant, directory)
        built = build_app(variant, sqlite_dir=directory)
        async with Lifespan(built.app):
            for i in range(100):
                await call(built.app, PATH, BODY, key=key(i))
            profiler = Profiler(interval=0.0002, async_mode="disabled")
            profiler.start()
            for i in range(n):
                await call(built.app, PATH, BODY, key=key(i))
            profiler.stop()
        return profiler

    profiler = asyncio.run(run())
    name = f"{variant}-{mode}"
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{name}.txt").write_text(
            profiler.output_text(unicode=False, color=False, show_all=False)
        )
        (out_dir / f"{name}.html").write_text(profiler.output_html())
    return summarise_pyinstrument(name, profiler.last_session.root_frame(), n)


def area_of(path: str | None, function: str) -> str:
    """A profile frame's library: the first component of its path, or a named wait."""
    if function in ("epoll.poll", "select.epoll.poll", "poll", "select", "EpollSelector.select"):
        return "waiting (epoll: I/O or the driver thread)"
    if not path or path.startswith("<"):
        return ""
    parts = path.replace("\\", "/").split("/")
    for marker in ("site-packages", "python3.11"):
        if marker in parts:
            parts = parts[parts.index(marker) + 1 :]
    head = parts[0] if parts else path
    return "stdlib asyncio" if head == "asyncio" else head.removesuffix(".py")


def summarise_pyinstrument(variant: str, root: Any, n: int) -> list[str]:
    """Own time by library and by function (built-ins charged to their caller's library)."""
    by_area: dict[str, float] = defaultdict(float)
    by_function: dict[str, float] = defaultdict(float)

    def walk(frame: Any, parent_area: str) -> None:
        if frame.is_synthetic:
            return
        area = area_of(frame.file_path_short, frame.function) or parent_area or "other"
        own = frame.total_self_time
        by_area[area] += own
        short = (frame.file_path_short or "").split("site-packages/")[-1]
        by_function[f"{frame.function} ({short})"] += own
        for child in frame.children:
            walk(child, area)

    walk(root, "")
    total = root.time or 1.0
    rows = [
        f"| {variant} | library: {area} | {seconds / total * 100:.1f}% |"
        for area, seconds in sorted(by_area.items(), key=lambda item: -item[1])[:8]
    ]
    rows += [
        f"| {variant} | {name} | {seconds / total * 100:.1f}% |"
        for name, seconds in sorted(by_function.items(), key=lambda item: -item[1])[:12]
    ]
    return rows


# ---------------------------------------------------------------- main


def report(
    costs: list[Cost],
    breakdowns: list[Breakdown],
    calls: list[tuple[str, str, str]],
    profile_rows: list[str],
) -> str:
    parts = [
        "### Micro-costs (each timed alone)\n",
        markdown_table(
            ["area", "operation", "wall p50 µs", "wall p99 µs", "CPU µs/op", "note"],
            [
                [c.section, c.what, fmt(c.wall.p50), fmt(c.wall.p99), fmt(c.cpu_us), c.note]
                for c in costs
            ],
        ),
        "\n### Driver calls per store operation (socket writes ~ round trips)\n",
        markdown_table(["store", "operation", "calls"], calls),
        "\n### A keyed request through the app, broken down (p50 µs)\n",
        markdown_table(
            [
                "variant",
                "mode",
                "total",
                "bare app",
                "store.claim",
                "store.complete",
                "rest (middleware + app - bare)",
            ],
            [
                [
                    b.variant,
                    b.mode,
                    fmt(b.total.p50),
                    fmt(b.bare.p50),
                    fmt(b.claim.p50),
                    fmt(b.complete.p50 if b.complete else 0),
                    fmt(
                        b.total.p50
                        - b.bare.p50
                        - b.claim.p50
                        - (b.complete.p50 if b.complete else 0)
                    ),
                ]
                for b in breakdowns
            ],
        ),
    ]
    if profile_rows:
        parts += [
            "\n### pyinstrument, first requests: own time by library and by function "
            "(main thread; shares of wall time under the profiler)\n",
            "| variant | library or function | share |\n| --- | --- | --- |",
            "\n".join(profile_rows),
        ]
    return "\n".join(parts) + "\n"


async def main_async(args: argparse.Namespace, directory: Path) -> tuple[Any, ...]:
    have_pg = server_reachable(POSTGRESQL_URL)
    have_redis = server_reachable(REDIS_URL)
    print("… micro-costs", file=sys.stderr, flush=True)
    costs = await micro_costs(args.requests, directory, have_pg, have_redis)
    print("… driver calls", file=sys.stderr, flush=True)
    calls = await driver_calls(directory, have_pg)
    breakdowns: list[Breakdown] = []
    for variant in ("ours-sqlite", "ours-postgresql", "ours-mariadb", "ours-redis"):
        if variant == "ours-postgresql" and not have_pg:
            continue
        if variant == "ours-redis" and not have_redis:
            continue
        if variant == "ours-mariadb" and not server_reachable(MARIADB_URL):
            continue
        print(f"… breakdown {variant}", file=sys.stderr, flush=True)
        breakdowns += await breakdown(variant, args.requests, directory)
    return costs, calls, breakdowns


def run_target(variant: str, n: int) -> None:
    """Only ``n`` first requests of ``variant`` (what py-spy samples from outside)."""

    async def run() -> None:
        with tempfile.TemporaryDirectory(prefix="idem-bench-target-") as name:
            await prepare(variant, Path(name))
            built = build_app(variant, sqlite_dir=Path(name))
            async with Lifespan(built.app):
                for i in range(50):
                    await call(built.app, PATH, BODY, key=f"w-{uuid.uuid4().hex}-{i}")
                await _target_loop(built.app, n)

    asyncio.run(run())


async def _target_loop(app: Any, n: int) -> None:
    # The py-spy summary counts only samples under this function (and the driver's thread).
    for i in range(n):
        await call(app, PATH, BODY, key=f"t-{uuid.uuid4().hex}-{i}")


def py_spy_variant(variant: str, n: int, out_dir: Path | None) -> list[str]:
    """py-spy (sampling from outside, all threads, idle included) over ``n`` first requests."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory(prefix="idem-bench-spy-") as name:
        raw = Path(name) / "stacks.txt"
        command = [
            spy, "record", "--rate", "1000", "--threads", "--idle", "--format", "raw",
            "--output", str(raw), "--", sys.executable, "-m", "benchmarks.profiling",
            "--target", variant, "-n", str(n),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if not raw.exists():
            return [f"| {variant} | py-spy failed: {done.stderr.strip()[-200:]} | |"]
        text_stacks = raw.read_text()
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{variant}.py-spy.txt").write_text(text_stacks)
    return summarise_collapsed(variant, text_stacks)


def summarise_collapsed(variant: str, stacks: str) -> list[str]:
    """The request loop's main-thread samples by library and function, and the driver thread's."""
    by_area: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    worker: Counter[str] = Counter()
    main_total = worker_idle = 0
    for line in stacks.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        leaf_function, _, leaf_location = frames[-1].partition(" (")
        leaf_path = leaf_location.rstrip(")").rsplit(":", 1)[0]
        short = f"{leaf_function} ({leaf_path.split('site-packages/')[-1]})"
        if any("_connection_worker_thread" in frame for frame in frames):
            if leaf_function == "_connection_worker_thread":
                worker_idle += count  # blocked in tx.get(): waiting for work
            else:
                worker[short] += count
            continue
        in_loop = any("_target_loop" in frame for frame in frames)
        idle = leaf_function in ("EpollSelector.select", "select") and any(
            "_run_once" in frame for frame in frames
        )
        if not (in_loop or idle):
            continue
        main_total += count
        area = area_of(leaf_path, leaf_function)
        if idle:
            area = "waiting (epoll: I/O or the driver thread)"
        for frame in reversed(frames[:-1]):
            if area:
                break
            area = area_of(frame.partition(" (")[2].rsplit(":", 1)[0], "")
        by_area[area or "other"] += count
        by_function[short] += count
    main = main_total or 1
    rows = [
        f"| {variant} | main thread, library: {area} | {count / main * 100:.1f}% |"
        for area, count in by_area.most_common(8)
    ]
    rows += [
        f"| {variant} | main thread: {name} | {count / main * 100:.1f}% |"
        for name, count in by_function.most_common(10)
    ]
    if worker or worker_idle:
        busy = sum(worker.values())
        rows.append(
            f"| {variant} | aiosqlite thread busy (vs main-thread samples) | "
            f"{busy / main * 100:.1f}% |"
        )
        rows += [
            f"| {variant} | aiosqlite thread: {name} | {count / main * 100:.1f}% |"
            for name, count in worker.most_common(5)
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--py-spy", action="store_true", help="also profile with py-spy")
    parser.add_argument("-n", "--requests", type=int, default=1000, help="timed ops per row")
    parser.add_argument("--profile-n", type=int, default=500, help="requests under pyinstrument")
    parser.add_argument("--profile-dir", default="", help="write pyinstrument reports here")
    parser.add_argument("--no-profile", action="store_true", help="skip pyinstrument")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown here")
    args = parser.parse_args(argv)
    if args.target:
        run_target(args.target, args.requests)
        return 0
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="idem-bench-prof-") as name:
        directory = Path(name)
        costs, calls, breakdowns = asyncio.run(main_async(args, directory))
        profile_rows: list[str] = []
        spy_rows: list[str] = []
        if not args.no_profile:
            out_dir = Path(args.profile_dir) if args.profile_dir else None
            for variant in ("ours-sqlite", "ours-sqlite-normal", "ours-postgresql", "ours-redis"):
                if unavailable(variant):
                    continue
                for mode in ("first", "replay"):
                    print(f"… pyinstrument {variant} {mode}", file=sys.stderr, flush=True)
                    profile_rows += profile_variant(
                        variant, args.profile_n, directory, out_dir, mode
                    )
                if args.py_spy and variant in ("ours-sqlite", "ours-postgresql"):
                    print(f"… py-spy {variant}", file=sys.stderr, flush=True)
                    spy_rows += py_spy_variant(variant, args.profile_n * 4, out_dir)
    text_out = report(costs, breakdowns, calls, profile_rows)
    if spy_rows:
        text_out += (
            "\n### py-spy, first requests: samples by thread, then the main thread's own "
            "samples by library and function (1 kHz, idle included)\n\n"
            "| variant | where | share |\n| --- | --- | --- |\n" + "\n".join(spy_rows) + "\n"
        )
    text_out += f"\nLoad average before / after: {load_before} / {loadavg()}.\n"
    print(text_out)
    if args.markdown:
        Path(args.markdown).write_text(text_out)
    write_json(
        args.json,
        {"costs": costs, "calls": calls, "breakdowns": breakdowns, "profile": profile_rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
