"""The duplicate-ticket demo: an agent creates tickets over a faulty network, twice.

``python -m example_app.demo`` starts the ticket service (uvicorn, a fresh SQLite file in a
temporary directory) behind a :class:`~example_app.proxy.FaultProxy` that drops requests, drops
responses and delays responses past the client's timeout. The agent then creates
``--operations`` tickets with a naive retry loop (a new ``Idempotency-Key`` on every attempt),
and again with :class:`~idempotency_mw.client.IdempotentClient` (one key per operation). The
tickets are counted in the service's database. The exit status is 0 only when the second run
made no duplicate and confirmed every operation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, closing, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TextIO, TypeVar

import httpx
import uvicorn
from starlette.types import ASGIApp

from example_app.app import create_app
from example_app.proxy import HOST, Fault, FaultProxy, FaultRates
from idempotency_mw.client import IdempotentClient, OperationState, OutcomeUnknown, RetryPolicy

FAULTS = (Fault.DROP_REQUEST, Fault.DROP_RESPONSE, Fault.DELAY)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo runs: how many tickets, how faulty the network, how patient the agent."""

    operations: int = 200
    rates: FaultRates = field(default_factory=lambda: FaultRates(0.1, 0.1, 0.1))
    seed: int = 1
    timeout: float = 1.0
    concurrency: int = 8

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy of both runs (the naive one only ignores its keys)."""
        return agent_policy(self.timeout, deadline=30.0)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run's figures; ``tickets`` and ``duplicates`` come from the service's database."""

    name: str
    operations: int
    attempts: int
    faults: Mapping[Fault, int]
    tickets: int
    duplicates: int
    confirmed: int


@dataclass(frozen=True, slots=True)
class DemoSummary:
    """Both runs' figures and the wall-clock time of the whole demo."""

    naive: RunSummary
    idempotent: RunSummary
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the idempotent run created every ticket exactly once and confirmed it."""
        run = self.idempotent
        return run.duplicates == 0 and run.tickets == run.confirmed == run.operations


class Progress:
    """Progress on ``stream`` (nothing without one): a bar redrawn in place on a terminal,
    plain lines at each quarter elsewhere (a log gets no carriage returns)."""

    WIDTH = 30
    STEPS = 4

    def __init__(self, label: str, total: int, stream: TextIO | None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.stream = stream
        self._terminal = stream is not None and stream.isatty()
        self._draw()

    def advance(self) -> None:
        """Count one more operation done."""
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if self.stream is None:
            return
        if self._terminal:
            filled = self.WIDTH * self.done // self.total
            bar = "#" * filled + "." * (self.WIDTH - filled)
            end = "\n" if self.done == self.total else ""
            self.stream.write(f"\r{self.label:<10} [{bar}] {self.done}/{self.total}{end}")
        elif self.done * self.STEPS // self.total != (self.done - 1) * self.STEPS // self.total:
            self.stream.write(f"{self.label:<10} {self.done}/{self.total}\n")
        else:
            return
        self.stream.flush()


#: An agent performs the operations through the proxy at ``url`` as ``caller``; it returns
#: how many of them it saw confirmed.
Agent = Callable[[DemoConfig, str, str, Progress], Awaitable[int]]


async def run_demo(config: DemoConfig, progress: TextIO | None = None) -> DemoSummary:
    """Run both agents against a fresh service; progress bars go to ``progress``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="idempotency-demo-") as tmp:
        database = Path(tmp) / "demo.db"
        agents: dict[str, Agent] = {
            "naive": naive_agent,
            "idempotent": partial(idempotent_agent, journal=Path(tmp) / "journal.sqlite3"),
        }
        measured: list[tuple[str, int, Mapping[Fault, int]]] = []
        async with serve(create_app(f"sqlite:///{database}")) as port:
            for name, agent in agents.items():
                async with FaultProxy(
                    port, rates=config.rates, delay=2 * config.timeout, seed=config.seed
                ) as proxy:
                    bar = Progress(name, config.operations, progress)
                    confirmed = await agent(config, proxy.url, _caller(name), bar)
                    measured.append((name, confirmed, proxy.counts.copy()))
        tickets = count_tickets(database)
    naive, idempotent = (
        _summarize(name, config.operations, confirmed, faults, tickets.get(_caller(name), (0, 0)))
        for name, confirmed, faults in measured
    )
    return DemoSummary(naive, idempotent, time.monotonic() - started)


def _summarize(
    name: str,
    operations: int,
    confirmed: int,
    faults: Mapping[Fault, int],
    tickets: tuple[int, int],
) -> RunSummary:
    total, distinct = tickets
    return RunSummary(
        name=name,
        operations=operations,
        attempts=sum(faults.values()),
        faults={fault: faults.get(fault, 0) for fault in FAULTS},
        tickets=total,
        duplicates=total - distinct,
        confirmed=confirmed,
    )


@asynccontextmanager
async def serve(app: ASGIApp) -> AsyncIterator[int]:
    """Run ``app`` under uvicorn on a free port of 127.0.0.1 (yielded) until the block ends."""
    config = uvicorn.Config(
        app,
        host=HOST,
        port=0,
        http="h11",
        ws="none",
        lifespan="on",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                await task
                raise RuntimeError("the ticket service stopped while starting")
            await asyncio.sleep(0.01)
        port: int = server.servers[0].sockets[0].getsockname()[1]
        yield port
    finally:
        server.should_exit = True
        await task


def count_tickets(database: Path) -> dict[str, tuple[int, int]]:
    """Per caller: tickets in the database, and distinct ``client_ref`` among them."""
    with closing(sqlite3.connect(database)) as db:
        rows = db.execute(
            "SELECT caller, COUNT(*), COUNT(DISTINCT client_ref) FROM example_tickets"
            " GROUP BY caller"
        ).fetchall()
    return {caller: (total, distinct) for caller, total, distinct in rows}


async def naive_agent(config: DemoConfig, url: str, caller: str, bar: Progress) -> int:
    """Retries every failed attempt as a new request with a new key: the usual bug."""
    policy = config.policy
    rng = random.Random(config.seed)
    confirmed = 0

    async def create(index: int) -> None:
        nonlocal confirmed
        for attempt in range(1, policy.max_attempts + 1):
            try:
                response = await http.post(
                    "/tickets",
                    json=_ticket(index),
                    headers={"X-Caller": caller, "Idempotency-Key": str(uuid.uuid4())},
                )
            except httpx.TransportError:
                pass
            else:
                if response.is_success:
                    confirmed += 1
                    return
            if attempt < policy.max_attempts:
                await asyncio.sleep(policy.backoff(attempt, rng))

    async with httpx.AsyncClient(base_url=url, timeout=config.timeout) as http:
        await _run_all(config, create, bar)
    return confirmed


async def idempotent_agent(
    config: DemoConfig, url: str, caller: str, bar: Progress, *, journal: Path
) -> int:
    """Sends each operation under one key with :class:`IdempotentClient`, then reconciles
    what is left unknown; counts the operations its ``journal`` ends up calling confirmed."""
    keys: list[str] = []

    async def create(index: int) -> None:
        operation = await client.operation("create-ticket", ref=_ref(index))
        keys.append(operation.key)
        # An unknown outcome stays in the journal for reconcile() below.
        with suppress(OutcomeUnknown):
            await client.send(
                operation, "POST", "/tickets", json=_ticket(index), headers={"X-Caller": caller}
            )

    async with (
        httpx.AsyncClient(base_url=url) as http,
        IdempotentClient(
            http=http,
            journal=journal,
            policy=config.policy,
            session_id="demo",
            rng=random.Random(config.seed),
        ) as client,
    ):
        await _run_all(config, create, bar)
        await client.reconcile()
        entries = [await asyncio.to_thread(client.journal.get, key) for key in keys]
    return sum(1 for entry in entries if entry and entry.state is OperationState.CONFIRMED)


async def _run_all(
    config: DemoConfig, create: Callable[[int], Awaitable[None]], bar: Progress
) -> None:
    """``create(i)`` for every operation, ``config.concurrency`` at a time."""

    async def one(index: int) -> None:
        await create(index)
        bar.advance()

    await each_at_most(config.concurrency, range(config.operations), one)


async def each_at_most(
    concurrency: int, items: Iterable[T], work: Callable[[T], Awaitable[None]]
) -> None:
    """``work(item)`` for every item, at most ``concurrency`` at a time."""
    pending = iter(items)

    async def worker() -> None:
        for item in pending:
            await work(item)

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())


def _caller(run: str) -> str:
    return f"demo-{run}"


def _ref(index: int) -> str:
    return f"ticket-{index:05d}"


def _ticket(index: int) -> dict[str, str]:
    return {"title": f"Printer on floor {index % 7} is on fire", "client_ref": _ref(index)}


def format_summary(summary: DemoSummary) -> str:
    """The figures as a table, with the verdict underneath."""
    header = ("run", "operations", "attempts", *FAULTS, "tickets", "duplicates", "confirmed")
    rows = [
        (
            run.name,
            run.operations,
            run.attempts,
            *(run.faults[fault] for fault in FAULTS),
            run.tickets,
            run.duplicates,
            run.confirmed,
        )
        for run in (summary.naive, summary.idempotent)
    ]
    lines = format_table(header, rows)
    verdict = (
        "OK: the idempotent run created every ticket once and confirmed every operation"
        if summary.ok
        else "FAILED: the idempotent run made duplicates or left operations unconfirmed"
    )
    return "\n".join([*lines, "", f"{verdict} ({summary.seconds:.1f}s)"])


def format_table(header: Sequence[object], rows: Sequence[Sequence[object]]) -> list[str]:
    """``rows`` under ``header``, as aligned lines: the first column left, the others right."""
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(
            str(cell).ljust(width) if i == 0 else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        )
        for row in (header, *rows)
    ]


def positive(kind: Callable[[str], int | float]) -> Callable[[str], int | float]:
    """An argparse type: ``kind`` of the text, which must be positive."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text}")
        return value

    return parse


def agent_policy(timeout: float, deadline: float) -> RetryPolicy:
    """The retry policy of the demos' agents (a naive one only ignores its keys)."""
    return RetryPolicy(
        max_attempts=6,
        backoff_base=0.1,
        backoff_cap=1.0,
        deadline=deadline,
        connect_timeout=timeout,
        read_timeout=timeout,
    )


def _parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m example_app.demo",
        description="Create tickets through a faulty network: naive retries, then "
        "IdempotentClient. Exits 0 when the latter made no duplicate and confirmed everything.",
    )

    parser.add_argument(
        "--operations",
        type=positive(int),
        default=defaults.operations,
        help=f"tickets to create in each run (default {defaults.operations})",
    )
    parser.add_argument(
        "--concurrency",
        type=positive(int),
        default=defaults.concurrency,
        help=f"operations in flight at once (default {defaults.concurrency})",
    )
    for fault, default in (
        ("drop-request", defaults.rates.drop_request),
        ("drop-response", defaults.rates.drop_response),
        ("delay", defaults.rates.delay),
    ):
        parser.add_argument(
            f"--{fault}",
            type=float,
            default=default,
            metavar="RATE",
            help=f"probability of a {fault} fault per exchange (default {default})",
        )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the faults and of the backoff jitter",
    )
    parser.add_argument(
        "--timeout",
        type=positive(float),
        default=defaults.timeout,
        help="client timeout in seconds; delayed responses are held twice as long"
        f" (default {defaults.timeout})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m example_app.demo``."""
    summary = asyncio.run(run_demo(parse_config(_parser(), argv), progress=sys.stderr))
    print(format_summary(summary))
    return 0 if summary.ok else 1


def parse_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> DemoConfig:
    """The demo's configuration, from the command line ``argv`` as ``parser`` reads it."""
    args = parser.parse_args(argv)
    try:
        rates = FaultRates(args.drop_request, args.drop_response, args.delay)
    except ValueError as exc:
        parser.error(str(exc))
    return DemoConfig(
        operations=args.operations,
        rates=rates,
        seed=args.seed,
        timeout=args.timeout,
        concurrency=args.concurrency,
    )


if __name__ == "__main__":
    sys.exit(main())
