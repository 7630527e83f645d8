"""The raw floors and the middleware's own costs, measured in one process.

1. Floors: a first request's store work without the middleware. Two autocommit statements on
   PostgreSQL through asyncpg (INSERT a row, UPDATE it); a claim and a completion on Redis as
   two commands (``SET NX PX``, ``SET XX PX``) through redis-py, and beside them the store's own
   claim and completion scripts through the same library; three SQLite statements through
   sqlite3 in autocommit (read, upsert, update), on a file in WAL with ``synchronous=FULL`` (the
   store's default) and with ``NORMAL``. Beside them, for reference, the store's own statements
   through the engine it makes from a URL (on SQLite, PostgreSQL and MariaDB), without the
   store's bookkeeping or the middleware: what its schema, its SQL and SQLAlchemy's engine cost
   over the floor's bare table.
2. The middleware's own CPU per request, outside store calls: CPU of the event loop's thread
   (where the middleware runs) per request behind the middleware, minus bare FastAPI's, minus
   that thread's CPU inside the store's calls (timed by a delegating store), beside bare
   FastAPI's whole request. A store's worker thread (SQLite's commits that wait for the disk,
   its WAL checkpoints) does the store's work; counted as process CPU, a checkpoint that runs
   on after a store call would land outside it, or on the variant measured next.
3. A fenced first request: the handler inserts a row in its own transaction, with and without
   ``fence()``, on SQLite and PostgreSQL; the statements and commits it sends to its database.
4. ``on_event=None`` against a hook that does nothing (MemoryStore, so the hook's share shows).

Variants alternate in rounds of ``--chunk`` requests so that drift hits them alike. A tree
laid out before the store rebuild (``benchmarks.compare --tree``) has no store statements to
time apart: those floors show "-".

    python -m benchmarks.overhead [-n 2000] [--chunk 200]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.apps import BODY, PATH, TicketIn, build_app, prepare, unavailable
from benchmarks.common import (
    MARIADB_URL,
    POSTGRESQL_URL,
    REDIS_PREFIX,
    REDIS_URL,
    ASGIApp,
    Lifespan,
    Summary,
    call,
    fmt,
    loadavg,
    markdown_table,
    now_us,
    prepare_sql,
    sqlite_url,
    write_json,
)

CPU_VARIANTS = ("ours-memory", "ours-sqlite", "ours-sqlite-normal", "ours-postgresql", "ours-redis")


# ---------------------------------------------------------------- floors


async def _timed_rounds(
    variants: dict[str, Callable[[int], Awaitable[None]]], n: int, chunk: int
) -> dict[str, Summary]:
    """Wall µs per call of each variant, ``chunk`` calls of each in turn until ``n`` each."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for operation in variants.values():  # warm up: connections, statement caches
        for i in range(min(chunk, 50)):
            await operation(-1 - i)
    gc.collect()
    done = 0
    while done < n:
        size = min(chunk, n - done)
        for name, operation in variants.items():
            for i in range(done, done + size):
                started = now_us()
                await operation(i)
                samples[name].append(now_us() - started)
        done += size
    return {name: Summary.of(values) for name, values in samples.items()}


async def floors(n: int, chunk: int, directory: Path) -> dict[str, Summary]:
    """Each store's raw floor for a first request's work (see the module docstring)."""
    variants: dict[str, Callable[[int], Awaitable[None]]] = {}
    tag = uuid.uuid4().hex[:8]
    async with AsyncExitStack() as stack:
        for synchronous in ("FULL", "NORMAL"):
            connection = sqlite3.connect(
                directory / f"floor-{synchronous}.db",
                isolation_level=None,
                check_same_thread=False,
            )
            stack.callback(connection.close)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={synchronous}")
            connection.execute("CREATE TABLE floor (key TEXT PRIMARY KEY, value BLOB)")
            variants[f"SQLite, 3 statements (WAL, {synchronous})"] = _sqlite_floor(connection, tag)
            store_sql = await _store_statements(
                stack,
                sqlite_url(directory, f"store-{synchronous}.db"),
                sqlite_synchronous=synchronous,
            )
            if store_sql is not None:
                variants[f"SQLite, the store's 3 statements (aiosqlite, WAL, {synchronous})"] = (
                    store_sql
                )
        if not unavailable("ours-postgresql"):
            import asyncpg

            pg = await asyncpg.connect(POSTGRESQL_URL)
            stack.push_async_callback(pg.close)
            await pg.execute(
                "CREATE TABLE IF NOT EXISTS bench_floor (key TEXT PRIMARY KEY, value BYTEA)"
            )
            await pg.execute("TRUNCATE bench_floor")
            variants["PostgreSQL, 2 statements (asyncpg)"] = _postgresql_floor(pg, tag)
            store_sql = await _store_statements(stack, POSTGRESQL_URL)
            if store_sql is not None:
                variants["PostgreSQL, the store's 2 statements (asyncpg)"] = store_sql
        if not unavailable("ours-redis"):
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(REDIS_URL)
            stack.push_async_callback(client.aclose)
            variants["Redis, 2 commands (redis-py)"] = _redis_floor(client.execute_command, tag)
            from idempotency_mw import RedisStore

            store = RedisStore(REDIS_URL, prefix=f"{REDIS_PREFIX}floor:")
            stack.push_async_callback(store.aclose)
            variants["Redis, the store's 2 scripts (redis-py)"] = _redis_store_scripts(store, tag)
        timed = await _timed_rounds(variants, n, chunk)
    if unavailable("ours-mariadb"):
        return timed
    # Apart: with MariaDB's pools open in the process, the Redis rounds ran slower.
    async with AsyncExitStack() as stack:
        variants = {}
        store_sql = await _store_statements(stack, MARIADB_URL)
        if store_sql is not None:
            variants["MariaDB, the store's 4 statements (asyncmy)"] = store_sql
        return timed | await _timed_rounds(variants, n, chunk)


async def _store_statements(
    stack: AsyncExitStack, url: str, **options: Any
) -> Callable[[int], Awaitable[None]] | None:
    """A first request's statements as the store sends them (its claim's, then its completion),
    through the engine the store makes for ``url`` with ``options`` (``sqlite_synchronous=``),
    without the store's bookkeeping or the middleware: what the schema, the SQL and the engine
    cost. ``None`` for a version of the library laid out otherwise."""
    try:
        from idempotency_mw.stores.sql.claims import CLAIMS
        from idempotency_mw.stores.sql.database import Database, engine_for
        from idempotency_mw.stores.sql.statements import SILENT
        from idempotency_mw.values.outcome import Asking
        from idempotency_mw.values.records import ClaimOutcome
    except ImportError:
        return None
    await prepare_sql(url)
    driver = Database(engine_for(url, **options), owned=True)
    stack.push_async_callback(driver.aclose)
    claim = CLAIMS[driver.dialect_name]
    tag = uuid.uuid4().hex[:8]

    async def operation(i: int) -> None:
        token = uuid.uuid4().hex
        params = {
            "p_scope": "",
            "p_key": f"{tag}-{i}",
            "p_fingerprint": "f" * 64,
            "p_binding": "",
            "p_token": token,
            "p_ttl_ms": 86_400_000,
            "p_lease_ms": 60_000,
            "p_first_sent_ms": None,
            "p_skew_ms": 30_000,
            "p_status": "completed",
            "p_response_status": 201,
            "p_response_headers": b"\x00\x00\x00\x0ccontent-type\x00\x00\x00\x10application/json",
            "p_result_payload": BODY,
        }
        asking = Asking("f" * 64, token=token, ttl=86_400)
        taken = await claim.attempt(driver, params, asking, math.inf, durable=True)
        assert taken is not None
        assert taken.outcome is ClaimOutcome.ACQUIRED
        assert await driver.change(SILENT.complete, params, deadline=math.inf) == 1

    return operation


def _sqlite_floor(connection: sqlite3.Connection, tag: str) -> Callable[[int], Awaitable[None]]:
    async def operation(i: int) -> None:
        key = f"{tag}-{i}"
        connection.execute("SELECT value FROM floor WHERE key = ?", (key,)).fetchall()
        connection.execute(
            "INSERT INTO floor (key, value) VALUES (?, NULL) ON CONFLICT (key) DO NOTHING", (key,)
        )
        connection.execute("UPDATE floor SET value = ? WHERE key = ?", (BODY, key))

    return operation


def _postgresql_floor(connection: Any, tag: str) -> Callable[[int], Awaitable[None]]:
    async def operation(i: int) -> None:
        key = f"{tag}-{i}"
        await connection.execute("INSERT INTO bench_floor (key) VALUES ($1)", key)
        await connection.execute("UPDATE bench_floor SET value = $2 WHERE key = $1", key, BODY)

    return operation


def _redis_floor(
    execute: Callable[..., Awaitable[Any]], tag: str
) -> Callable[[int], Awaitable[None]]:
    async def operation(i: int) -> None:
        key = f"{REDIS_PREFIX}floor:{tag}:{i}"
        await execute("SET", key, "claimed", "NX", "PX", 60000)
        await execute("SET", key, BODY, "XX", "PX", 60000)

    return operation


def _redis_store_scripts(store: Any, tag: str) -> Callable[[int], Awaitable[None]]:
    """A first request's claim and completion as RedisStore sends them, without the middleware:
    what the store adds over the floor's two commands."""
    from idempotency_mw import StoredResponse

    response = StoredResponse(201, ((b"content-type", b"application/json"),), BODY)

    async def operation(i: int) -> None:
        claim = await store.claim("", f"{tag}-{i}", "f" * 64, ttl=60, lease=60)
        assert claim.token is not None
        assert await store.complete("", f"{tag}-{i}", claim.token, response, ttl=60)

    return operation


# ---------------------------------------------------------------- the middleware's own CPU


class CpuTimedStore:
    """Delegates to a store and adds up the event loop thread's CPU inside its request-path
    calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cpu = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _timed(self, operation: Coroutine[Any, Any, Any]) -> Any:
        started = time.thread_time()
        try:
            return await operation
        finally:
            self.cpu += time.thread_time() - started
            self.calls += 1

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed(self.inner.claim(*args, **kwargs))

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed(self.inner.complete(*args, **kwargs))

    async def release(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed(self.inner.release(*args, **kwargs))

    async def renew(self, *args: Any, **kwargs: Any) -> Any:
        return await self._timed(self.inner.renew(*args, **kwargs))

    async def startup(self) -> None:
        await self.inner.startup()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _swap_store(app: Any, wrap: Callable[[Any], Any]) -> Any:
    """Replace the store given to our middleware (not built yet) with ``wrap(store)``."""
    middleware = next(m for m in app.user_middleware if "store" in m.kwargs)
    middleware.kwargs["store"] = wrapped = wrap(middleware.kwargs["store"])
    return wrapped


@dataclass
class CpuRow:
    variant: str
    mode: str
    cpu_us: float
    store_cpu_us: float
    bare_cpu_us: float
    store_calls: float

    @property
    def own_us(self) -> float:
        """The middleware's own CPU per request: outside the store, over bare FastAPI."""
        return self.cpu_us - self.store_cpu_us - self.bare_cpu_us


@dataclass
class _Loop:
    """A mode's request loop on one app: fresh keys, or one key replayed."""

    app: ASGIApp
    mode: str
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent: int = 0

    async def run(self, count: int) -> float:
        """The event loop thread's CPU µs for ``count`` requests."""
        keys = [
            self.key if self.mode == "replay" else f"{self.key}-{self.sent + i}"
            for i in range(count)
        ]
        self.sent += count
        started = time.thread_time()
        for key in keys:
            reply = await call(self.app, PATH, BODY, key=key)
            if reply.status != 201:
                raise RuntimeError(f"{self.mode} answered {reply.status}: {reply.body[:200]!r}")
        return (time.thread_time() - started) * 1e6


@asynccontextmanager
async def _started(
    variant: str, directory: Path, **options: Any
) -> AsyncIterator[tuple[Any, CpuTimedStore | None]]:
    """An app of ``variant``, prepared and started; its store wrapped to time its calls."""
    if variant != "bare":
        await prepare(variant, directory)
    built = build_app(variant, sqlite_dir=directory, **options)
    store = None if variant == "bare" else _swap_store(built.app, CpuTimedStore)
    async with Lifespan(built.app):
        yield built.app, store


async def middleware_cpu(n: int, chunk: int, directory: Path) -> tuple[list[CpuRow], list[str]]:
    """The event loop thread's CPU per request of each store's app, in and outside store
    calls, with bare's."""
    rows: list[CpuRow] = []
    skipped: list[str] = []
    async with AsyncExitStack() as stack:
        apps: dict[str, tuple[Any, CpuTimedStore | None]] = {}
        for variant in ("bare", *CPU_VARIANTS):
            reason = unavailable(variant) if variant != "ours-memory" else None
            try:
                if reason:
                    raise RuntimeError(reason)
                apps[variant] = await stack.enter_async_context(_started(variant, directory))
            except (ImportError, RuntimeError) as exc:
                skipped.append(f"{variant}: {type(exc).__name__}: {exc}")
        for mode in ("first", "replay"):
            loops = {variant: _Loop(app, mode) for variant, (app, _) in apps.items()}
            for loop in loops.values():  # warm up; the replayed key's first run
                await loop.run(min(chunk, 100))
            totals = dict.fromkeys(loops, 0.0)
            store_cpu = dict.fromkeys(loops, 0.0)
            store_calls = dict.fromkeys(loops, 0)
            gc.collect()
            for _ in range(max(1, n // chunk)):
                for variant, loop in loops.items():
                    store = apps[variant][1]
                    before = (store.cpu, store.calls) if store else (0.0, 0)
                    totals[variant] += await loop.run(chunk)
                    if store:
                        store_cpu[variant] += (store.cpu - before[0]) * 1e6
                        store_calls[variant] += store.calls - before[1]
            requests = max(1, n // chunk) * chunk
            for variant in loops:
                if variant == "bare":
                    continue
                rows.append(
                    CpuRow(
                        variant,
                        mode,
                        totals[variant] / requests,
                        store_cpu[variant] / requests,
                        totals["bare"] / requests,
                        store_calls[variant] / requests,
                    )
                )
    return rows, skipped


# ---------------------------------------------------------------- a fenced first request


@dataclass
class FenceRow:
    database: str
    plain: Summary
    fenced: Summary
    plain_statements: float
    fenced_statements: float
    plain_commits: float
    fenced_commits: float


@dataclass
class _Counts:
    """What an engine sent: statements, and commits."""

    statements: int = 0
    commits: int = 0

    def statement(self, *_: Any) -> None:
        self.statements += 1

    def commit(self, *_: Any) -> None:
        self.commits += 1


def _ticket_app(variant: str, directory: Path, engine: Any, fenced: bool) -> Any:
    """Our middleware on ``variant``'s store, before a handler that inserts a row in its own
    transaction on ``engine`` (the store's database), through ``fence()`` when ``fenced``."""
    from sqlalchemy import text

    from idempotency_mw import fence

    built = build_app(variant, sqlite_dir=directory)
    app = built.app
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != PATH]
    insert = text("INSERT INTO bench_tickets (id, title) VALUES (:id, :title)")

    @app.post(PATH, status_code=201)
    async def create_ticket(ticket: TicketIn) -> dict[str, Any]:
        ticket_id = uuid.uuid4().hex[:12]
        async with engine.begin() as connection:
            await connection.execute(insert, {"id": ticket_id, "title": ticket.title})
            if fenced:
                await fence(connection)
        return {"id": ticket_id, "title": ticket.title}

    return app


async def fenced_first(n: int, chunk: int, directory: Path) -> tuple[list[FenceRow], list[str]]:
    """First requests whose handler writes a row, plain and fenced, alternating."""
    from sqlalchemy import event, text
    from sqlalchemy.ext.asyncio import create_async_engine

    from idempotency_mw.stores.sql import async_url

    rows: list[FenceRow] = []
    skipped: list[str] = []
    for variant, url in (
        ("ours-sqlite", sqlite_url(directory, "ours.db")),
        ("ours-postgresql", POSTGRESQL_URL),
    ):
        if unavailable(variant):
            skipped.append(f"{variant}: {unavailable(variant)}")
            continue
        await prepare(variant, directory)
        await prepare_sql(url, wipe=False)
        engine = create_async_engine(async_url(url))
        async with engine.begin() as connection:
            await connection.execute(text("DROP TABLE IF EXISTS bench_tickets"))
            await connection.execute(
                text("CREATE TABLE bench_tickets (id VARCHAR(32) PRIMARY KEY, title TEXT)")
            )
        counts = _Counts()
        event.listen(engine.sync_engine, "before_cursor_execute", counts.statement)
        event.listen(engine.sync_engine, "commit", counts.commit)
        samples: dict[bool, list[float]] = {False: [], True: []}
        statements = dict.fromkeys((False, True), 0)
        commits = dict.fromkeys((False, True), 0)
        async with AsyncExitStack() as stack:
            apps = {}
            for fenced in (False, True):
                app = _ticket_app(variant, directory, engine, fenced)
                await stack.enter_async_context(Lifespan(app))
                apps[fenced] = app
            for app in apps.values():  # warm up
                for _ in range(50):
                    await call(app, PATH, BODY, key=uuid.uuid4().hex)
            gc.collect()
            for _ in range(max(1, n // chunk)):
                for fenced, app in apps.items():
                    before = (counts.statements, counts.commits)
                    for _ in range(chunk):
                        key = uuid.uuid4().hex
                        started = now_us()
                        reply = await call(app, PATH, BODY, key=key)
                        samples[fenced].append(now_us() - started)
                        if reply.status != 201:
                            raise RuntimeError(f"fenced={fenced}: {reply.status} {reply.body!r}")
                    statements[fenced] += counts.statements - before[0]
                    commits[fenced] += counts.commits - before[1]
        await engine.dispose()
        requests = len(samples[False])
        rows.append(
            FenceRow(
                variant,
                Summary.of(samples[False]),
                Summary.of(samples[True]),
                statements[False] / requests,
                statements[True] / requests,
                commits[False] / requests,
                commits[True] / requests,
            )
        )
    return rows, skipped


# ---------------------------------------------------------------- the event hook


async def event_hook(n: int, chunk: int, directory: Path) -> dict[str, dict[str, Summary]]:
    """Wall µs per request on MemoryStore with ``on_event=None`` and with a no-op hook."""

    def ignore(event: object) -> None:
        return None

    results: dict[str, dict[str, Summary]] = {}
    async with AsyncExitStack() as stack:
        apps = {
            "on_event=None": await stack.enter_async_context(_started("ours-memory", directory)),
            "no-op hook": await stack.enter_async_context(
                _started("ours-memory", directory, on_event=ignore)
            ),
        }
        for mode in ("first", "replay"):
            loops = {name: _Loop(app, mode) for name, (app, _) in apps.items()}

            def request(loop: _Loop) -> Callable[[int], Awaitable[None]]:
                async def one(_: int) -> None:
                    await loop.run(1)

                return one

            summaries = await _timed_rounds(
                {name: request(loop) for name, loop in loops.items()}, n, chunk
            )
            for name, summary in summaries.items():
                results.setdefault(name, {})[mode] = summary
    return results


# ---------------------------------------------------------------- report


def report(
    floor: dict[str, Summary],
    cpu: list[CpuRow],
    fence_rows: list[FenceRow],
    hook: dict[str, dict[str, Summary]],
    notes: list[str],
) -> str:
    parts = [
        "### Raw floors (wall µs per first request's store work, no middleware)\n",
        markdown_table(
            ["floor", "p50 µs", "p99 µs"],
            [[name, fmt(s.p50), fmt(s.p99)] for name, s in floor.items()],
        ),
        "\n### The middleware's own CPU per request, outside store calls (µs)\n",
        markdown_table(
            [
                "store",
                "mode",
                "CPU per request",
                "in store calls",
                "bare FastAPI's whole request",
                "middleware's own",
                "own / bare",
                "store calls",
            ],
            [
                [
                    r.variant,
                    r.mode,
                    fmt(r.cpu_us),
                    fmt(r.store_cpu_us),
                    fmt(r.bare_cpu_us),
                    fmt(r.own_us),
                    f"{r.own_us / r.bare_cpu_us:.2f}x",
                    f"{r.store_calls:.1f}",
                ]
                for r in cpu
            ],
        ),
        "\n### A fenced first request: the handler inserts a row in its own transaction\n",
        markdown_table(
            [
                "database",
                "plain p50 / p99 µs",
                "fenced p50 / p99 µs",
                "fence() adds p50 µs",
                "app statements per request (plain, fenced)",
                "app commits per request (plain, fenced)",
            ],
            [
                [
                    r.database,
                    f"{fmt(r.plain.p50)} / {fmt(r.plain.p99)}",
                    f"{fmt(r.fenced.p50)} / {fmt(r.fenced.p99)}",
                    fmt(r.fenced.p50 - r.plain.p50),
                    f"{r.plain_statements:.2f}, {r.fenced_statements:.2f}",
                    f"{r.plain_commits:.2f}, {r.fenced_commits:.2f}",
                ]
                for r in fence_rows
            ],
        )
        if fence_rows
        else "-",
        "\n### The event hook, MemoryStore (wall µs per request, p50 / p99)\n",
        markdown_table(
            ["on_event", "first", "replay"],
            [
                [
                    name,
                    f"{fmt(modes['first'].p50)} / {fmt(modes['first'].p99)}",
                    f"{fmt(modes['replay'].p50)} / {fmt(modes['replay'].p99)}",
                ]
                for name, modes in hook.items()
            ],
        ),
    ]
    if notes:
        parts += ["", "Not measured: " + "; ".join(notes) + "."]
    return "\n".join(parts)


async def main_async(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    print("… floors", file=sys.stderr, flush=True)
    floor = await floors(args.requests, args.chunk, directory)
    print("… middleware CPU", file=sys.stderr, flush=True)
    cpu, notes = await middleware_cpu(args.requests, args.chunk, directory)
    print("… fence", file=sys.stderr, flush=True)
    fence_rows, fence_notes = await fenced_first(args.requests // 2, args.chunk, directory)
    print("… event hook", file=sys.stderr, flush=True)
    hook = await event_hook(args.requests, args.chunk, directory)
    return {
        "floors": floor,
        "cpu": cpu,
        "fence": fence_rows,
        "hook": hook,
        "notes": notes + fence_notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=2000, help="per variant and mode")
    parser.add_argument("--chunk", type=int, default=200, help="requests per turn")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown tables here")
    args = parser.parse_args(argv)
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="idem-bench-overhead-") as name:
        results = asyncio.run(main_async(args, Path(name)))
    text = report(
        results["floors"], results["cpu"], results["fence"], results["hook"], results["notes"]
    )
    text += f"\n\nLoad average before / after: {load_before} / {loadavg()}.\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    write_json(
        args.json,
        {
            **results,
            "cpu": [{**row.__dict__, "own_us": row.own_us} for row in results["cpu"]],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
