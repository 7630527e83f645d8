"""Load on the example ticket service under 4 uvicorn workers, then a check of every ticket.

The service (``example_app``, tickets in PostgreSQL) runs under ``uvicorn --workers 4`` in a
child process, its idempotency records in the same database (``SQLStore``: the example fences
each ticket's commit with its record). This process drives it over 127.0.0.1 with an httpx
client: a fixed number of requests, a mix of

- ``first``: a new operation (new key, new ``client_ref``), expected 201;
- ``replay``: an earlier operation sent again (same key, same body), expected its 201 again;
- ``burst``: 20 copies of a new operation at once, expected one 201 and, for the others, a
  replay or 409 in-progress;
- ``mismatch``: an earlier key with a different body (its own ``client_ref``), expected 409.

Afterwards the tickets table is read: every operation a client saw succeed must have exactly
one ticket (its ``client_ref``), a mismatched body none, and there must be no other ticket. It
prints requests/s, p50/p99 latency and the count of each outcome, and exits non-zero when the
check fails.

    python -m benchmarks.load [--full] [--requests N] [--concurrency C]

Isolation: database ``idem_reliability`` (``--database-url``; not ``idempotency_bench``, whose
idempotency table the other benchmarks truncate while they run; the example tables and the
idempotency records in it are dropped and re-created). Only 127.0.0.1 is used. The machine's load
average is printed with the figures: other processes on it skew them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
DATABASE_URL = os.environ.get(
    "LOAD_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/idem_reliability"
)
BURST = 20
MIX = {"first": 0.55, "replay": 0.25, "burst": 0.10, "mismatch": 0.10}  # of operations
TABLES = ("example_emails", "example_tickets", "idempotency_records")


# ---------------------------------------------------------------- the service


def create_service() -> Any:
    """The example service as it ships: the uvicorn factory of the load test
    (``benchmarks.load:create_service``), with Nagle's algorithm off on its connections."""
    from benchmarks.common import set_nodelay_on_every_tcp_connection
    from example_app.app import create_app

    if os.environ.get("LOAD_NODELAY") == "1":
        set_nodelay_on_every_tcp_connection()
    return create_app(os.environ["LOAD_DATABASE_URL"])


def check_loopback(url: str) -> str:
    parts = urlsplit(url)
    if (parts.hostname or HOST) not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"the load test only talks to 127.0.0.1, not {parts.hostname}")
    name = parts.path.strip("/")
    if parts.scheme.startswith("postgresql") and name in ("", "test"):
        raise SystemExit("refusing the 'test' database: other engineers' tests wipe it")
    return url


async def prepare_database(url: str) -> None:
    """Create the database if needed; drop the example's tables; migrate; create them again."""
    from example_app.app import metadata as example_metadata
    from idempotency_mw.stores.sql import async_url
    from idempotency_mw.stores.sql.migrate import upgrade

    parsed = async_url(url)
    admin = create_async_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        found = await conn.scalar(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": parsed.database}
        )
        if not found:
            await conn.execute(text(f'CREATE DATABASE "{parsed.database}"'))
    await admin.dispose()
    engine = create_async_engine(parsed)
    async with engine.begin() as conn:
        for table in (*TABLES, "idempotency_mw_alembic_version"):
            await conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
    # Once here, so that the workers' start-ups find everything in place.
    await upgrade(url)
    async with engine.begin() as conn:
        await conn.run_sync(example_metadata.create_all)
    await engine.dispose()


class Service:
    """``uvicorn --workers N`` in a child process, on a free port of 127.0.0.1.

    Not ``--fd``: uvicorn wraps an inherited socket as AF_UNIX, so asyncio leaves TCP_NODELAY
    off on its connections, and Nagle's algorithm against the client's delayed ACKs holds
    every response for the delayed-ACK timeout.
    """

    def __init__(self, env: dict[str, str], workers: int) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port = probe.getsockname()[1]
        self.url = f"http://{HOST}:{port}"
        command = [sys.executable, "-m", "uvicorn", "--factory", "benchmarks.load:create_service"]
        command += ["--host", HOST, "--port", str(port), "--workers", str(workers)]
        command += ["--no-access-log", "--log-level", "warning"]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)}
        )

    async def ready(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the service exited with {self.process.returncode}")
                try:
                    if (await client.get("/tickets")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError("the service did not start")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


# ---------------------------------------------------------------- the load


@dataclass
class Operation:
    """One logical operation: a key and a body, sent one or more times."""

    key: str
    caller: str
    client_ref: str
    title: str

    def body(self) -> dict[str, str]:
        return {"title": self.title, "client_ref": self.client_ref}


@dataclass
class Sent:
    kind: str
    operation: Operation
    client_ref: str  # of the body sent (a mismatch sends another one)
    status: int
    outcome: str
    seconds: float
    body: bytes = b""


@dataclass
class Plan:
    """The requests to send, in batches: a batch is one request or one burst of 20."""

    batches: list[tuple[str, Operation, Operation | None]] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(BURST if kind == "burst" else 1 for kind, _, _ in self.batches)


def make_plan(requests: int, seed: int) -> Plan:
    rng = random.Random(seed)
    plan = Plan()
    done: list[Operation] = []
    callers = [f"agent-{n}" for n in range(8)]

    def new_operation() -> Operation:
        ref = uuid.UUID(int=rng.getrandbits(128)).hex
        return Operation(f"key-{ref}", rng.choice(callers), ref, f"ticket {ref[:8]}")

    while plan.requests < requests:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        if kind in ("replay", "mismatch") and not done:
            kind = "first"
        if kind == "burst" and plan.requests + BURST > requests:
            kind = "first"
        if kind in ("first", "burst"):
            operation = new_operation()
            done.append(operation)
            plan.batches.append((kind, operation, None))
        elif kind == "replay":
            plan.batches.append((kind, rng.choice(done), None))
        else:
            original = rng.choice(done)
            other = Operation(original.key, original.caller, f"mismatch-{uuid.uuid4().hex}", "x")
            plan.batches.append((kind, original, other))
    return plan


def outcome_of(response: httpx.Response) -> str:
    if response.status_code == 201:
        replayed = response.headers.get("idempotent-replayed") == "true"
        return "replayed 201" if replayed else "created 201"
    if response.headers.get("content-type") == "application/problem+json":
        kind = str(response.json().get("type", "")).rsplit(":", 1)[-1]
        return f"{response.status_code} {kind}"
    return f"{response.status_code} other"


async def send(
    client: httpx.AsyncClient, kind: str, operation: Operation, sent_as: Operation
) -> Sent:
    """One request, sent again with the same key if the connection fails (as a client should:
    its outcome is unknown); the latency covers every attempt."""
    headers = {"Idempotency-Key": operation.key, "X-Caller": operation.caller}
    started = time.perf_counter()
    failures: list[str] = []
    while True:
        try:
            response = await client.post("/tickets", json=sent_as.body(), headers=headers)
            break
        except httpx.TransportError as exc:
            failures.append(type(exc).__name__)
            if len(failures) == 3:
                seconds = time.perf_counter() - started
                return Sent(kind, operation, sent_as.client_ref, 0, failures[-1], seconds)
    seconds = time.perf_counter() - started
    outcome = outcome_of(response)
    if failures:
        outcome += f" (resent after {', '.join(failures)})"
    status, body = response.status_code, response.content
    return Sent(kind, operation, sent_as.client_ref, status, outcome, seconds, body)


async def drive(url: str, plan: Plan, concurrency: int) -> tuple[list[Sent], float]:
    """Send the plan with ``concurrency`` requests in flight (a burst takes 20 slots)."""
    # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them: a
    # request sent just as the server closes one fails (and would be sent again anyway).
    limits = httpx.Limits(
        max_connections=concurrency + BURST, max_keepalive_connections=None, keepalive_expiry=2
    )
    results: list[Sent] = []
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        # Warm every worker's connections up before the clock starts.
        await asyncio.gather(*(client.get("/tickets") for _ in range(concurrency)))

        async def batch(kind: str, operation: Operation, other: Operation | None) -> None:
            if kind == "burst":
                async with slots:
                    results.extend(
                        await asyncio.gather(
                            *(send(client, kind, operation, operation) for _ in range(BURST))
                        )
                    )
            else:
                async with slots:
                    results.append(await send(client, kind, operation, other or operation))

        started = time.perf_counter()
        # An operation's replays and mismatches are sent after its first request finished.
        pending: dict[str, asyncio.Task[None]] = {}
        tasks: list[asyncio.Task[None]] = []
        for kind, operation, other in plan.batches:
            before = pending.get(operation.key)

            async def run(
                kind: str = kind,
                operation: Operation = operation,
                other: Operation | None = other,
                before: asyncio.Task[None] | None = before,
            ) -> None:
                if before is not None:
                    await asyncio.shield(before)
                await batch(kind, operation, other)

            task = asyncio.create_task(run())
            tasks.append(task)
            if kind in ("first", "burst"):
                pending[operation.key] = task
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return results, elapsed


async def tickets_by_ref(url: str) -> Counter[str]:
    from idempotency_mw.stores.sql import async_url

    engine = create_async_engine(async_url(url))
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT client_ref FROM example_tickets"))
        found: Counter[str] = Counter(row.client_ref for row in rows)
    await engine.dispose()
    return found


def verify(results: Sequence[Sent], tickets: Counter[str]) -> list[str]:
    """Every operation a client saw succeed happened exactly once; nothing else happened."""
    problems: list[str] = []
    planned = {s.operation.client_ref for s in results}
    succeeded = {s.operation.client_ref for s in results if s.status == 201}
    for ref in sorted(succeeded):
        if tickets[ref] != 1:
            problems.append(f"operation {ref}, seen to succeed, has {tickets[ref]} tickets")
    for ref, count in sorted(tickets.items()):
        if ref not in planned:
            problems.append(f"{count} tickets for {ref}, a body sent with another's key")
        elif count > 1:
            problems.append(f"operation {ref} ran {count} times")
    # Every 201 of one operation is the same ticket, byte for byte.
    bodies: dict[str, set[bytes]] = {}
    for s in results:
        if s.status == 201:
            bodies.setdefault(s.operation.client_ref, set()).add(s.body)
    for ref, seen in sorted(bodies.items()):
        if len(seen) != 1:
            problems.append(f"operation {ref} was answered {len(seen)} different tickets")
    for s in results:
        if s.kind == "mismatch" and not s.outcome.startswith("409 mismatch"):
            problems.append(f"a mismatch got {s.outcome}")
        if s.status == 0 or s.status >= 500:
            problems.append(f"a {s.kind} request failed: {s.outcome}")
    return problems


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def report(
    store: str, results: Sequence[Sent], elapsed: float, problems: list[str]
) -> dict[str, Any]:
    latencies = [s.seconds * 1000 for s in results]
    outcomes = Counter(f"{s.kind}: {s.outcome}" for s in results)
    figures = {
        "store": store,
        "requests": len(results),
        "seconds": round(elapsed, 2),
        "requests_per_second": round(len(results) / elapsed, 1),
        "p50_ms": round(percentile(latencies, 0.50), 2),
        "p99_ms": round(percentile(latencies, 0.99), 2),
        "outcomes": dict(sorted(outcomes.items())),
        "check": "ok" if not problems else f"{len(problems)} problems",
    }
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    figures["loadavg"] = load
    print(f"\n== {store}: {len(results)} requests in {elapsed:.2f} s (load average {load})")
    print(f"   {figures['requests_per_second']} requests/s")
    print(f"   latency p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms")
    for kind in MIX:
        lat = [s.seconds * 1000 for s in results if s.kind == kind]
        if lat:
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            print(f"   {kind:9} {len(lat):6} requests, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    for outcome, count in sorted(outcomes.items()):
        print(f"   {count:6}  {outcome}")
    operations = len({s.operation.client_ref for s in results})
    print(f"   check: {operations} operations, {figures['check']}")
    for problem in problems[:20]:
        print(f"     - {problem}")
    return figures


async def run_store(store: str, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    await prepare_database(args.database_url)
    env = {"LOAD_DATABASE_URL": args.database_url}
    env["LOAD_NODELAY"] = "0" if args.keep_nagle else "1"
    plan = make_plan(args.requests, args.seed)
    service = Service(env, args.workers)
    try:
        await service.ready()
        results, elapsed = await drive(service.url, plan, args.concurrency)
    finally:
        service.stop()
    problems = verify(results, await tickets_by_ref(args.database_url))
    return report(store, results, elapsed, problems), problems


async def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="20,000 requests instead of 2,000")
    parser.add_argument("--requests", type=int, help="number of requests (overrides --full)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--workers", type=int, default=4, help="uvicorn worker processes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--keep-nagle",
        action="store_true",
        help="leave uvicorn's workers as they are: Nagle's delay on every response (see Service)",
    )
    args = parser.parse_args(argv)
    args.requests = args.requests or (20_000 if args.full else 2_000)
    check_loopback(args.database_url)
    print(
        f"{args.requests} requests, {args.concurrency} in flight, "
        f"{args.workers} uvicorn workers, mix {MIX} (bursts of {BURST})"
    )
    figures, problems = await run_store("sql", args)
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps([figures], indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
