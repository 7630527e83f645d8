"""A small service for the reliability tests: handlers that sleep, stream and log their runs.

Every handler writes its runs to a SQLite file (:class:`Effects`), which outlives a killed
worker and is shared by every worker process: a run is logged as ``started`` when the handler
begins and ``done`` when its side effect has happened, with the request's key, the process and
the time on the machine's monotonic clock; ``POST /work`` also logs when a run ``ended``
(cancelled or not), so that a test can tell whether two runs of one key lived at once.

Under uvicorn (``uvicorn --factory tests.support.reliability_app:create_app``, or the module
attribute ``tests.support.reliability_app:app``) it is configured by the environment:

- ``RELIABILITY_STORE``: the store's URL (SQLite, PostgreSQL, MariaDB or Redis);
- ``RELIABILITY_REDIS_PREFIX``: the Redis key prefix (default ``idem:``);
- ``RELIABILITY_REDIS_CLUSTER``: ``1`` when the Redis URL names a node of a cluster;
- ``RELIABILITY_EFFECTS``: the SQLite file handlers log their runs to;
- ``RELIABILITY_LEASE``: the lease in seconds (default 1);
- ``RELIABILITY_DELAY``: how long ``POST /work`` sleeps before its side effect (default 0);
- ``RELIABILITY_WAIT``: how long a duplicate waits for the first request's outcome (default 0);
- ``RELIABILITY_ON_LEASE_LOST``: the middleware's ``on_lease_lost`` (its default when unset);
- ``RELIABILITY_POLL_CAP``: the longest pause between two polls of a waiting duplicate, in
  seconds: a large one shows that what woke it was the store's notification, not a poll.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from starlette.requests import HTTPConnection

from idempotency_mw import (
    IdempotencyMiddleware,
    RedisStore,
    SQLStore,
    Store,
    fence,
    idempotent,
)
from idempotency_mw.engine import waiting

KEY_HEADER = "idempotency-key"


@dataclass(frozen=True)
class Run:
    """One run of ``POST /work``: its process, and when it started, had its effect and ended.

    Times are ``time.monotonic()``, one clock for every process of the machine.
    """

    pid: int
    started: float
    effect: float | None
    ended: float | None


class Effects:
    """The log of handler runs, in a SQLite file that several processes share."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with closing(self._connect()) as db, db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT,"
                " route TEXT NOT NULL, key TEXT NOT NULL, phase TEXT NOT NULL,"
                " pid INTEGER NOT NULL, run TEXT NOT NULL, at REAL NOT NULL)"
            )

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA busy_timeout=30000")
        return db

    def log(self, route: str, key: str, phase: str, run: str = "") -> int:
        """Log one step of a run (``run`` tells the steps of one run apart); the id of the row."""
        with closing(self._connect()) as db, db:
            cursor = db.execute(
                "INSERT INTO runs (route, key, phase, pid, run, at) VALUES (?, ?, ?, ?, ?, ?)",
                (route, key, phase, os.getpid(), run, time.monotonic()),
            )
            return int(cursor.lastrowid or 0)

    async def alog(self, route: str, key: str, phase: str, run: str = "") -> int:
        return await anyio.to_thread.run_sync(self.log, route, key, phase, run)

    def count(self, key: str | None = None, phase: str = "done") -> int:
        """Runs that reached ``phase``, of one key or of all."""
        query = "SELECT COUNT(*) FROM runs WHERE phase = ?"
        args: tuple[str, ...] = (phase,)
        if key is not None:
            query += " AND key = ?"
            args += (key,)
        with closing(self._connect()) as db:
            return int(db.execute(query, args).fetchone()[0])

    def per_key(self, phase: str = "done") -> dict[str, int]:
        """How many runs of each key reached ``phase``."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT key, COUNT(*) FROM runs WHERE phase = ? GROUP BY key", (phase,)
            ).fetchall()
        return {str(key): int(count) for key, count in rows}

    def runs(self, key: str) -> list[Run]:
        """The runs of ``POST /work`` with ``key``, in the order they started."""
        with closing(self._connect()) as db:
            rows = db.execute(
                "SELECT run, pid, phase, at FROM runs WHERE key = ? AND run != '' ORDER BY id",
                (key,),
            ).fetchall()
        steps: dict[str, dict[str, float]] = {}
        pids: dict[str, int] = {}
        for run, pid, phase, at in rows:
            steps.setdefault(run, {})[phase] = float(at)
            pids[run] = int(pid)
        return sorted(
            (
                Run(pids[run], at["started"], at.get("done"), at.get("ended"))
                for run, at in steps.items()
            ),
            key=lambda run: run.started,
        )


def service_env(
    store_url: str,
    effects: Effects,
    *,
    lease: float,
    delay: float,
    redis_prefix: str = "idem:",
    on_lease_lost: str | None = None,
) -> dict[str, str]:
    """The environment that configures the service under uvicorn (see the module's doc)."""
    env = {
        "RELIABILITY_STORE": store_url,
        "RELIABILITY_REDIS_PREFIX": redis_prefix,
        "RELIABILITY_EFFECTS": effects.path,
        "RELIABILITY_LEASE": str(lease),
        "RELIABILITY_DELAY": str(delay),
    }
    if on_lease_lost is not None:
        env["RELIABILITY_ON_LEASE_LOST"] = on_lease_lost
    return env


def caller_of(connection: HTTPConnection) -> str:
    return connection.headers.get("x-caller", "anonymous")


fenced_effects = Table(
    "fenced_effects",
    MetaData(),
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idem_key", String(100), nullable=False),
    Column("pid", Integer, nullable=False),
)


def _add_fenced_route(app: FastAPI, store: SQLStore, effects: Effects) -> None:
    """``POST /fenced``: sleeps, then writes its effect in a transaction that calls fence();
    ``POST /fenced-first``: the same the other way round. Both log ``started`` when they
    begin and ``done`` once the transaction committed (route ``fenced``)."""
    engine = create_async_engine(store.url)

    async def commit(key: str) -> None:
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(fenced_effects.insert().values(idem_key=key, pid=os.getpid()))
            await fence(session)
        await effects.alog("fenced", key, "done")

    @app.post("/fenced-first", status_code=201)
    @idempotent(required=True)
    async def fenced_first(request: Request) -> dict[str, int]:
        key = request.headers.get(KEY_HEADER, "")
        await effects.alog("fenced", key, "started")
        await commit(key)
        await anyio.sleep(app.state.delay)
        return {"pid": os.getpid()}

    @app.post("/fenced", status_code=201)
    @idempotent(required=True)
    async def fenced(request: Request) -> dict[str, int]:
        key = request.headers.get(KEY_HEADER, "")
        await effects.alog("fenced", key, "started")
        await anyio.sleep(app.state.delay)
        await commit(key)
        return {"pid": os.getpid()}


def store_from_url(url: str, redis_prefix: str = "idem:", *, cluster: bool = False) -> Store:
    if url.startswith("redis"):
        return RedisStore(url, prefix=redis_prefix, socket_timeout=2, cluster=cluster)
    return SQLStore(url, operation_timeout=2, settlement_notices=True)


def create_app(
    store: Store | None = None,
    *,
    effects: Effects | None = None,
    lease: float | None = None,
    delay: float | None = None,
    **options: Any,
) -> FastAPI:
    """The service; what is not given comes from the environment (see the module's doc)."""
    env = os.environ
    if store is None:
        store = store_from_url(
            env["RELIABILITY_STORE"],
            env.get("RELIABILITY_REDIS_PREFIX", "idem:"),
            cluster=env.get("RELIABILITY_REDIS_CLUSTER") == "1",
        )
    if effects is None:
        effects = Effects(env["RELIABILITY_EFFECTS"])
    lease = float(env.get("RELIABILITY_LEASE", "1")) if lease is None else lease
    options.setdefault("wait", float(env.get("RELIABILITY_WAIT", "0")))
    if "RELIABILITY_ON_LEASE_LOST" in env:
        options.setdefault("on_lease_lost", env["RELIABILITY_ON_LEASE_LOST"])
    if "RELIABILITY_POLL_CAP" in env:
        # With a settlement feed and without.
        waiting._LAST_POLL = waiting._LAST_POLL_FED = float(env["RELIABILITY_POLL_CAP"])
    app = FastAPI()
    options.setdefault("lookup_path", "/idempotency-keys")
    app.add_middleware(IdempotencyMiddleware, store=store, lease=lease, scope=caller_of, **options)
    app.state.effects = effects
    app.state.delay = float(env.get("RELIABILITY_DELAY", "0")) if delay is None else delay

    @app.get("/health")
    async def health() -> dict[str, int]:
        return {"pid": os.getpid()}

    # A POST that needs no key: it never waits for the store.
    @app.post("/ping")
    async def ping() -> dict[str, int]:
        return {"pid": os.getpid()}

    @app.post("/work")
    @idempotent(required=True)
    async def work(request: Request) -> dict[str, Any]:
        key = request.headers.get(KEY_HEADER, "")
        run_id = uuid.uuid4().hex
        await effects.alog("work", key, "started", run_id)
        try:
            await anyio.sleep(app.state.delay)
            run = await effects.alog("work", key, "done", run_id)
        finally:
            # A cancelled run logs its end too.
            with anyio.CancelScope(shield=True):
                await effects.alog("work", key, "ended", run_id)
        return {"run": run, "pid": os.getpid(), "body": (await request.body()).decode()}

    if isinstance(store, SQLStore):
        _add_fenced_route(app, store, effects)

    @app.post("/upload")
    @idempotent(required=True)
    async def upload(request: Request) -> dict[str, int]:
        key = request.headers.get(KEY_HEADER, "")
        body = await request.body()
        run = await effects.alog("upload", key, "done")
        return {"run": run, "size": len(body)}

    @app.post("/stream")
    @idempotent(required=True)
    async def stream(request: Request, chunks: int = 10, interval: float = 0.05) -> Any:
        key = request.headers.get(KEY_HEADER, "")
        await effects.alog("stream", key, "started")

        async def produce() -> AsyncIterator[bytes]:
            for index in range(chunks):
                yield f"chunk {index}\n".encode()
                await anyio.sleep(interval)
            await effects.alog("stream", key, "done")

        return StreamingResponse(produce(), media_type="text/plain")

    return app


def __getattr__(name: str) -> Any:
    # ``tests.support.reliability_app:app`` builds the app from the environment when first
    # asked for.
    if name == "app":
        return create_app()
    raise AttributeError(name)
