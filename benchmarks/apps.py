"""The apps under benchmark: one FastAPI ticket handler, bare or behind an idempotency layer.

Variants (``VARIANTS``):

- ``bare``: FastAPI, ``POST /tickets`` returning a small JSON (the baseline);
- ``ours-sqlite``, ``ours-sqlite-normal``, ``ours-postgresql``, ``ours-mariadb``, ``ours-redis``:
  the same app behind ``idempotency_mw.IdempotencyMiddleware`` on each store, default settings
  (``ours-sqlite``: a file in WAL with ``synchronous=FULL``, the store's default;
  ``ours-sqlite-normal`` opts in to ``synchronous=NORMAL``);
- ``ours-memory`` (not in ``VARIANTS``: one process only): on ``testing.MemoryStore``, to see the
  middleware's own cost with next to nothing spent in the store;
- ``fik-sqlite``, ``fik-redis``: ``fastapi-idempotency-key`` 0.1.x, wired as its README's
  "Global ASGI Middleware" section says;
- ``aih-redis``: ``asgi-idempotency-header`` 0.2.x, wired as its README's setup section says.

For uvicorn (``--factory benchmarks.apps:create_app``) the variant and options come from the
environment: ``BENCH_VARIANT``, ``BENCH_SQLITE_DIR``, ``BENCH_HANDLER_DELAY`` (seconds the
handler sleeps) and ``BENCH_COUNT_FILE`` (a file the handler appends a line to on every run, so
executions can be counted across worker processes).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from benchmarks.common import MARIADB_URL, POSTGRESQL_URL, REDIS_PREFIX, REDIS_URL, sqlite_url

VARIANTS = (
    "bare",
    "ours-sqlite",
    "ours-sqlite-normal",
    "ours-postgresql",
    "ours-mariadb",
    "ours-redis",
    "fik-sqlite",
    "fik-redis",
    "aih-redis",
)
OURS = tuple(v for v in VARIANTS if v.startswith("ours-"))
PEERS = ("fik-sqlite", "fik-redis", "aih-redis")
LABELS = {
    "bare": "bare FastAPI",
    "ours-sqlite": "idempotency-mw, SQLite",
    "ours-sqlite-normal": "idempotency-mw, SQLite (synchronous=NORMAL)",
    "ours-memory": "idempotency-mw, MemoryStore",
    "ours-postgresql": "idempotency-mw, PostgreSQL",
    "ours-mariadb": "idempotency-mw, MariaDB",
    "ours-redis": "idempotency-mw, Redis",
    "fik-sqlite": "fastapi-idempotency-key, SQLite",
    "fik-redis": "fastapi-idempotency-key, Redis",
    "aih-redis": "asgi-idempotency-header, Redis",
}
#: The store each variant needs: "sqlite", "postgresql", "mariadb", "redis" or None.
STORE_OF = {
    "bare": None,
    "ours-sqlite": "sqlite",
    "ours-sqlite-normal": "sqlite",
    "ours-memory": None,
    "ours-postgresql": "postgresql",
    "ours-mariadb": "mariadb",
    "ours-redis": "redis",
    "fik-sqlite": "sqlite",
    "fik-redis": "redis",
    "aih-redis": "redis",
}
PATH = "/tickets"
BODY = b'{"title": "printer on fire", "priority": 2}'


class TicketIn(BaseModel):
    title: str
    priority: int = 0


@dataclass
class Built:
    """An app and what was found while wiring it (README snippets that failed, and so on)."""

    app: FastAPI
    notes: list[str] = field(default_factory=list)


Closer = Callable[[], Awaitable[Any]]


def _base_app(
    delay: float, count_file: str | None, closers: list[Closer], **options: Any
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        for close in closers:
            await close()

    app = FastAPI(lifespan=lifespan, **options)
    app.state.executions = 0

    @app.post(PATH, status_code=201)
    async def create_ticket(ticket: TicketIn) -> dict[str, Any]:
        app.state.executions += 1
        run = app.state.executions
        if count_file:
            with open(count_file, "a") as counts:  # noqa: ASYNC230 - one short line
                counts.write(f"{os.getpid()}\n")
        if delay:
            await asyncio.sleep(delay)
        # A fresh id per execution: a replay must return the first run's, byte for byte.
        return {"id": uuid.uuid4().hex[:12], "run": run, "title": ticket.title}

    return app


def build_app(
    variant: str,
    *,
    sqlite_dir: Path,
    delay: float = 0.0,
    count_file: str | None = None,
    redis_prefix: str = REDIS_PREFIX,
    **middleware_options: Any,
) -> Built:
    """The app of ``variant``; its stores and tables must have been prepared (common.py).

    ``middleware_options`` go to our middleware (e.g. ``on_event``), for ``ours-*`` only.
    """
    closers: list[Closer] = []
    notes: list[str] = []
    if variant == "bare":
        return Built(_base_app(delay, count_file, closers))

    if variant.startswith("ours-"):
        from idempotency_mw import IdempotencyMiddleware, SQLStore
        from idempotency_mw.stores.base import Store

        store: Store
        match variant:
            case "ours-sqlite" | "ours-sqlite-normal":
                store = sqlite_store(sqlite_dir, normal=variant == "ours-sqlite-normal")
            case "ours-memory":
                from idempotency_mw.testing import MemoryStore

                store = MemoryStore()
            case "ours-postgresql":
                store = SQLStore(POSTGRESQL_URL)
            case "ours-mariadb":
                store = SQLStore(MARIADB_URL)
            case "ours-redis":
                from idempotency_mw.stores.redis import RedisStore

                store = RedisStore(REDIS_URL, prefix=f"{redis_prefix}ours:")
            case _:
                raise ValueError(variant)
        app = _base_app(delay, count_file, closers)
        # The middleware itself runs store.startup() and store.aclose() in the lifespan.
        app.add_middleware(IdempotencyMiddleware, store=store, **middleware_options)
        return Built(app, notes)

    if variant.startswith("fik-"):
        # README, "Global ASGI Middleware": app.add_middleware(IdempotencyMiddleware,
        # backend=..., header_name="Idempotency-Key", default_ttl=86400).
        from fastapi_idempotency_key import IdempotencyMiddleware as FikMiddleware
        from fastapi_idempotency_key import RedisBackend as FikRedis
        from fastapi_idempotency_key import SQLiteBackend

        backend: Any
        if variant == "fik-sqlite":
            backend = SQLiteBackend(database_path=str(sqlite_dir / "fik.db"))
        else:
            backend = FikRedis(redis_url=REDIS_URL, prefix=f"{redis_prefix}fik:")
        closers.append(backend.close)
        app = _base_app(delay, count_file, closers)
        app.add_middleware(
            FikMiddleware, backend=backend, header_name="Idempotency-Key", default_ttl=86400
        )
        return Built(app, notes)

    if variant == "aih-redis":
        import redis.asyncio
        from fastapi.middleware import Middleware
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends import RedisBackend as AihRedis

        client = redis.asyncio.Redis.from_url(REDIS_URL)
        aih_backend = AihRedis(
            redis=client,
            keys_key=f"{redis_prefix}aih:keys",
            response_key=f"{redis_prefix}aih:resp:",
        )
        closers.append(client.aclose)
        # README snippet 1: app.add_middleware(IdempotencyHeaderMiddleware(backend=backend)).
        try:
            # Typed only where the peer is installed ([bench]); untyped in [dev].
            IdempotencyHeaderMiddleware(backend=aih_backend)  # type: ignore[call-arg, unused-ignore]
        except TypeError as exc:
            notes.append(
                f"README snippet `app.add_middleware(IdempotencyHeaderMiddleware("
                f"backend=backend))` fails: TypeError: {exc}; used the README's second form, "
                f"`FastAPI(middleware=[Middleware(IdempotencyHeaderMiddleware, backend=...)])`"
            )
        app = _base_app(
            delay,
            count_file,
            closers,
            middleware=[
                Middleware(IdempotencyHeaderMiddleware, backend=aih_backend)  # type: ignore[arg-type, unused-ignore]
            ],
        )
        return Built(app, notes)

    raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")


SQLITE_FILES = {False: "ours.db", True: "ours-normal.db"}


def sqlite_store(sqlite_dir: Path, *, normal: bool) -> Any:
    """Our SQLite store with its default settings, or with ``synchronous=NORMAL``."""
    from idempotency_mw import SQLStore

    url = sqlite_url(sqlite_dir, SQLITE_FILES[normal])
    return SQLStore(url, sqlite_synchronous="NORMAL") if normal else SQLStore(url)


def create_app() -> FastAPI:
    """uvicorn factory: the variant named by ``BENCH_VARIANT`` (see the module docstring)."""
    from benchmarks.common import set_nodelay_on_every_tcp_connection

    set_nodelay_on_every_tcp_connection()
    variant = os.environ.get("BENCH_VARIANT", "bare")
    directory = os.environ.get("BENCH_SQLITE_DIR") or tempfile.gettempdir()
    built = build_app(
        variant,
        sqlite_dir=Path(directory),
        delay=float(os.environ.get("BENCH_HANDLER_DELAY", "0") or 0),
        count_file=os.environ.get("BENCH_COUNT_FILE") or None,
    )
    return built.app


def unavailable(variant: str) -> str | None:
    """Why ``variant`` cannot run here (its server is down), or ``None``."""
    from benchmarks.common import server_reachable

    store = STORE_OF[variant]
    url = {"postgresql": POSTGRESQL_URL, "mariadb": MARIADB_URL, "redis": REDIS_URL}.get(
        store or ""
    )
    if url is not None and not server_reachable(url):
        return f"no server at {url}"
    return None


async def prepare(variant: str, sqlite_dir: Path, redis_prefix: str = REDIS_PREFIX) -> None:
    """Empty storage for ``variant``: our table created and wiped, the peers' files removed."""
    from benchmarks.common import prepare_sql, wipe_redis

    match variant:
        case "ours-sqlite" | "ours-sqlite-normal":
            await prepare_sql(sqlite_url(sqlite_dir, SQLITE_FILES[variant == "ours-sqlite-normal"]))
        case "ours-postgresql":
            await prepare_sql(POSTGRESQL_URL)
        case "ours-mariadb":
            await prepare_sql(MARIADB_URL)
        case "fik-sqlite":
            for suffix in ("", "-wal", "-shm"):
                (sqlite_dir / f"fik.db{suffix}").unlink(missing_ok=True)
    if STORE_OF[variant] == "redis":
        await wipe_redis(REDIS_URL, redis_prefix)
