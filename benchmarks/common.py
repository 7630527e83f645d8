"""Shared pieces of the benchmarks: where the servers are, ASGI by hand, statistics, Markdown.

Isolation: every benchmark uses its own databases, never the ``test`` ones the test suite
wipes: ``idempotency_bench`` on PostgreSQL and MariaDB (created when missing), Redis db 15 with
the key prefix ``idem-bench:``. Every address is checked to be on the loopback interface.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import sqlite3
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import metadata

Message = dict[str, Any]
ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Any], Awaitable[None]]

BENCH_DIR = Path(__file__).resolve().parent
#: The checkout whose ``idempotency_mw`` the benchmarked servers import (``benchmarks.compare``
#: points it at each tree in turn).
TREE_DIR = Path(os.environ.get("BENCH_TREE") or BENCH_DIR.parent)
BENCH_DB = "idempotency_bench"
POSTGRESQL_URL = os.environ.get(
    "BENCH_POSTGRESQL_URL", f"postgresql://postgres@127.0.0.1:5432/{BENCH_DB}"
)
MARIADB_URL = os.environ.get("BENCH_MARIADB_URL", f"mysql://root@127.0.0.1:3306/{BENCH_DB}")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
REDIS_PREFIX = "idem-bench:"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def check_loopback(url: str) -> str:
    """``url`` itself, after making sure it points at this machine and not a test database."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host not in LOOPBACK and not host.startswith("127."):
        raise SystemExit(f"benchmarks only talk to the loopback interface, not {host!r}")
    if parts.scheme.startswith(("postgresql", "mysql", "mariadb")):
        database = parts.path.lstrip("/")
        if database in ("", "test"):
            raise SystemExit(f"refusing to benchmark on database {database!r}: use {BENCH_DB}")
    if parts.scheme.startswith("redis") and parts.path.strip("/") in ("", "0"):
        raise SystemExit("refusing to benchmark on Redis db 0: tests use it")
    return url


for _url in (POSTGRESQL_URL, MARIADB_URL, REDIS_URL):
    check_loopback(_url)


# ---------------------------------------------------------------- databases


async def ensure_database(url: str) -> None:
    """Create the database named in a PostgreSQL/MariaDB ``url`` if it does not exist."""
    parsed = async_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return
    name = parsed.database
    if not name or not name.isidentifier():
        raise SystemExit(f"not a plain database name: {name!r}")
    if backend == "postgresql":
        admin = create_async_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
        async with admin.connect() as conn:
            found = await conn.scalar(
                text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            )
            if not found:
                await conn.execute(text(f'CREATE DATABASE "{name}"'))
    else:
        admin = create_async_engine(parsed.set(database=""))
        async with admin.begin() as conn:
            found = await conn.scalar(
                text("SELECT 1 FROM information_schema.schemata WHERE schema_name = :name"),
                {"name": name},
            )
            if not found:
                await conn.execute(text(f"CREATE DATABASE `{name}`"))
    await admin.dispose()


async def prepare_sql(url: str, *, wipe: bool = True) -> None:
    """Our table in ``url``'s (bench) database, created if missing and emptied."""
    check_loopback(url)
    await ensure_database(url)
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        if wipe:
            if engine.dialect.name == "sqlite":
                await conn.execute(text("DELETE FROM idempotency_records"))
            else:
                await conn.execute(text("TRUNCATE TABLE idempotency_records"))
    await engine.dispose()


async def wipe_redis(url: str = REDIS_URL, prefix: str = REDIS_PREFIX) -> int:
    """Delete the benchmarks' own Redis keys (by prefix, never FLUSHDB); returns how many."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(check_loopback(url))
    deleted = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await client.delete(*batch)
                batch.clear()
        if batch:
            deleted += await client.delete(*batch)
    finally:
        await client.aclose()
    return deleted


def sqlite_url(directory: Path, name: str = "bench.db") -> str:
    return f"sqlite:///{directory / name}"


def server_reachable(url: str) -> bool:
    """Whether something accepts TCP connections where ``url`` points (loopback only)."""

    parsed = make_url(url) if not url.startswith("redis") else None
    if parsed is not None:
        host, port = parsed.host or "127.0.0.1", parsed.port
    else:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    default_ports = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306}
    if port is None and parsed is not None:
        port = default_ports.get(parsed.get_backend_name(), 0)
    try:
        socket.create_connection((host, port or 0), timeout=2).close()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- ASGI by hand


@dataclass(slots=True)
class Reply:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    #: now_us() when the last body chunk went out: what a client waits for. The app may go on
    #: after it (idempotency-mw records the response after sending it).
    responded_us: float = 0.0

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


def http_scope(
    path: str,
    *,
    method: str = "POST",
    headers: Iterable[tuple[bytes, bytes]] = (),
    body_length: int = 0,
) -> dict[str, Any]:
    """An HTTP scope as uvicorn builds it (without the per-connection extras)."""
    raw: list[tuple[bytes, bytes]] = [
        (b"host", b"127.0.0.1:8000"),
        (b"user-agent", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(body_length).encode()),
        *headers,
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": method,
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": raw,
        "state": {},
    }


async def call(
    app: ASGIApp,
    path: str,
    body: bytes,
    *,
    key: str | None = None,
    method: str = "POST",
) -> Reply:
    """One request straight into ``app``: no sockets, no HTTP parsing, no client library."""
    headers = [] if key is None else [(b"idempotency-key", key.encode())]
    scope = http_scope(path, method=method, headers=headers, body_length=len(body))
    reply = Reply()
    done = asyncio.Event()
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    chunks: list[bytes] = []

    async def send(message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            reply.status = message["status"]
            reply.headers = list(message.get("headers", ()))
        elif kind == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                reply.responded_us = now_us()
                done.set()

    await app(scope, receive, send)
    reply.body = b"".join(chunks)
    return reply


class Lifespan:
    """Runs an app's lifespan protocol by hand: ``async with Lifespan(app):``."""

    def __init__(self, app: ASGIApp, timeout: float = 30.0) -> None:
        self._app = app
        self._timeout = timeout
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        try:
            await self._app(scope, self._inbox.get, self._outbox.put)
        except BaseException as exc:
            await self._outbox.put({"type": "crashed", "message": f"{type(exc).__name__}: {exc}"})
            raise

    async def __aenter__(self) -> Lifespan:
        self._task = asyncio.create_task(self._run())
        await self._inbox.put({"type": "lifespan.startup"})
        message = await asyncio.wait_for(self._outbox.get(), self._timeout)
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"startup failed: {message.get('message', message)}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        if self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._outbox.get(), self._timeout)
            await asyncio.wait_for(self._task, self._timeout)
        except Exception:
            self._task.cancel()


# ---------------------------------------------------------------- statistics and output


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, nearest rank."""
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


@dataclass(slots=True)
class Summary:
    n: int
    p50: float
    p99: float
    mean: float
    minimum: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        ordered = sorted(values)
        return cls(
            n=len(ordered),
            p50=percentile(ordered, 0.50),
            p99=percentile(ordered, 0.99),
            mean=sum(ordered) / len(ordered) if ordered else float("nan"),
            minimum=ordered[0] if ordered else float("nan"),
        )


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:  # NaN
        return "-"
    return f"{value:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---" for _ in headers) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |")
    return "\n".join(lines)


def status_summary(statuses: Counter[int]) -> str:
    return ", ".join(f"{status}x{count}" for status, count in sorted(statuses.items()))


def write_json(path: str | None, payload: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=_json_default))


def _json_default(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[call-overload]
    return str(value)


def version_of(package: str) -> str:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, str]:
    """What the figures were measured on."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=BENCH_DIR.parent,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "idempotency_mw"],
            capture_output=True,
            text=True,
            cwd=BENCH_DIR.parent,
            check=False,
        ).stdout.strip()
        if git and dirty:
            git += f" + uncommitted changes in {len(dirty.splitlines())} library file(s)"
    except OSError:
        git = ""
    packages = [
        "idempotency-mw",
        "starlette",
        "fastapi",
        "sqlalchemy",
        "aiosqlite",
        "asyncpg",
        "asyncmy",
        "redis",
        "hiredis",
        "uvicorn",
        "uvloop",
        "httptools",
        "fastapi-idempotency-key",
        "asgi-idempotency-header",
    ]
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git or "(no commit)",
        **{package: version_of(package) for package in packages},
        **asyncio.run(server_versions()),
    }


async def server_versions() -> dict[str, str]:
    """The version of each database server the benchmarks use (and of the SQLite library)."""
    versions = {"SQLite library": sqlite3.sqlite_version}
    for name, url in (("PostgreSQL server", POSTGRESQL_URL), ("MariaDB server", MARIADB_URL)):
        engine = create_async_engine(async_url(url))
        try:
            await ensure_database(url)
            async with engine.connect() as conn:
                found = str(await conn.scalar(text("SELECT version()")))
            versions[name] = found.split(" on ")[0].split(",")[0]
        except Exception as exc:
            versions[name] = f"unreachable ({type(exc).__name__})"
        finally:
            await engine.dispose()
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        versions["Redis server"] = str((await client.info("server"))["redis_version"])
    except Exception as exc:
        versions["Redis server"] = f"unreachable ({type(exc).__name__})"
    finally:
        await client.aclose()
    return versions


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def env_flag(mapping: Mapping[str, str], name: str) -> bool:
    return mapping.get(name, "") not in ("", "0", "false")


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: other work on the machine skews every figure."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "?"
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def wait_for_quiet(max_wait: float, threshold: float) -> str:
    """Wait (at most ``max_wait`` s) until the 1-minute load average is under ``threshold``."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(5)
    return loadavg()


def set_nodelay_on_every_tcp_connection() -> None:
    """Work around uvicorn's ``--workers``: its connections keep Nagle's algorithm on.

    uvicorn binds the listening socket of its workers as ``socket.socket(AF_INET)``, whose
    ``proto`` is 0, and asyncio sets TCP_NODELAY only on sockets whose ``proto`` is
    IPPROTO_TCP. With Nagle on, the body of each response on a kept-alive connection waits
    for the ACK of its headers, which the client delays by its delayed-ACK timeout. Called in
    each worker before uvicorn starts serving.
    """
    import asyncio.base_events

    def set_nodelay(sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    asyncio.base_events._set_nodelay = set_nodelay  # type: ignore[attr-defined]
