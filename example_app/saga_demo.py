"""The order-saga demo: orders of three steps over a faulty network, and an agent that crashes.

``python -m example_app.saga_demo`` starts the example service (uvicorn, a fresh SQLite file in
a temporary directory) behind a :class:`~example_app.proxy.FaultProxy`. An agent process
places ``--orders`` orders, each a saga: reserve inventory → charge → send the confirmation
email, compensated in reverse (refund, then release) when the email bounces (a fraction
``--email-failures`` of the orders). The refund of a large order (``--large-orders``) needs a
person, so such a saga ends ``needs_intervention``. Once a fraction ``--crash-after`` of the
orders is done, the agent is killed (SIGKILL) and started again.

It runs twice: with :class:`~idempotency_mw.client.Saga` (a journal, one key per step, resumed
after the crash), and with a naive agent (a new key per attempt, a list of finished orders
instead of a journal). The invariants are checked in the service's own tables, and the exit
status is 0 only when the saga run kept every one of them. The service's charge goes on to a
card network under ``downstream_key("card-network")``: one network charge per charge request,
however often its handler ran (a duplicate there is an invariant of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import httpx

from example_app.app import create_app
from example_app.demo import Progress, agent_policy, each_at_most, format_table, positive, serve
from example_app.orders import UNDELIVERABLE_DOMAIN
from example_app.proxy import Fault, FaultProxy, FaultRates
from idempotency_mw.client import (
    AsyncStepClient,
    IdempotentClient,
    RetryPolicy,
    Saga,
    SagaState,
    SQLiteJournal,
    attention_rows,
)

VARIANTS = ("naive", "saga")
SMALL_CENTS, LARGE_CENTS = 1_999, 250_000


@dataclass(frozen=True, slots=True)
class SagaDemoConfig:
    """What the demo runs: how many orders, how many fail where, how faulty the network."""

    orders: int = 100
    email_failures: float = 0.15
    large_orders: float = 0.2
    rates: FaultRates = field(default_factory=lambda: FaultRates(0.05, 0.05, 0.05))
    seed: int = 1
    timeout: float = 0.5
    concurrency: int = 8
    crash_after: float = 0.4

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy of both agents (the naive one only ignores its keys)."""
        return agent_policy(self.timeout, deadline=20.0)


@dataclass(frozen=True, slots=True)
class Order:
    """One order the agents place."""

    ref: str
    amount_cents: int
    recipient: str


def plan_orders(config: SagaDemoConfig) -> list[Order]:
    """The orders of a run, drawn from the seed: which bounce, which are large."""
    rng = random.Random(config.seed)
    orders = []
    for index in range(config.orders):
        bounces = rng.random() < config.email_failures
        large = rng.random() < config.large_orders
        domain = UNDELIVERABLE_DOMAIN if bounces else "mail.example"
        orders.append(
            Order(
                ref=f"ORD-{index:04d}",
                amount_cents=LARGE_CENTS if large else SMALL_CENTS,
                recipient=f"customer{index}@{domain}",
            )
        )
    return orders


# --- The agents (each run in a process of its own) --------------------------------------------

#: An agent places every order not finished yet and reports each outcome as a JSON line.
Report = Callable[[str, str], None]


def order_saga(client: IdempotentClient, order: Order) -> Saga:
    """The saga of one order: reserve → charge → confirmation email."""

    async def reserve(step: AsyncStepClient) -> httpx.Response:
        body = {"order": order.ref, "sku": "book-42", "quantity": 1}
        return await step.post("/inventory/reservations", json=body)

    async def release(step: AsyncStepClient, reserved: httpx.Response) -> httpx.Response:
        return await step.post(f"/inventory/reservations/{reserved.json()['id']}/release")

    async def charge(step: AsyncStepClient) -> httpx.Response:
        body = {"order": order.ref, "amount_cents": order.amount_cents}
        return await step.post("/payments/charges", json=body)

    async def refund(step: AsyncStepClient, charged: httpx.Response) -> httpx.Response:
        return await step.post(f"/payments/charges/{charged.json()['id']}/refund")

    async def confirm(step: AsyncStepClient) -> httpx.Response:
        return await step.post("/emails", json={"order": order.ref, "recipient": order.recipient})

    saga = Saga(client, "order", ref=order.ref, deadline=timedelta(seconds=15))
    saga.step("reserve", reserve, compensate=release)
    saga.step("charge", charge, compensate=refund)
    saga.step("confirm-email", confirm)
    return saga


async def saga_agent(
    config: SagaDemoConfig, url: str, caller: str, state: Path, report: Report
) -> None:
    """Runs every order's saga; after a crash, the journal ``state`` resumes each."""
    async with (
        httpx.AsyncClient(base_url=url, headers={"X-Caller": caller}) as http,
        IdempotentClient(
            http=http,
            journal=state,
            policy=config.policy,
            lease=timedelta(seconds=2),
        ) as client,
    ):

        async def place(order: Order) -> None:
            outcome = await order_saga(client, order).run()
            report(order.ref, outcome.state.value)

        await each_at_most(config.concurrency, plan_orders(config), place)


async def naive_agent(
    config: SagaDemoConfig, url: str, caller: str, state: Path, report: Report
) -> None:
    """Retries with a new key per attempt, compensates as best it can, and keeps a list of
    finished orders in ``state`` to skip after a crash: the usual script."""
    policy = config.policy
    rng = random.Random(config.seed)
    finished = await asyncio.to_thread(_finished, state)

    async def call(path: str, body: Mapping[str, Any] | None = None) -> httpx.Response | None:
        for attempt in range(1, policy.max_attempts + 1):
            try:
                response = await http.post(
                    path, json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
                )
            except httpx.TransportError:
                pass
            else:
                if response.status_code < 500:
                    return response
            await asyncio.sleep(policy.backoff(attempt, rng))
        return None

    async def place(order: Order) -> None:
        if order.ref not in finished:
            outcome = await attempt(order)
            with state.open("a") as done:
                done.write(order.ref + "\n")
            report(order.ref, outcome)

    async def attempt(order: Order) -> str:
        reserved = await call(
            "/inventory/reservations", {"order": order.ref, "sku": "book-42", "quantity": 1}
        )
        if reserved is None or reserved.is_error:
            return "compensated"
        undo = [f"/inventory/reservations/{reserved.json()['id']}/release"]
        charged = await call(
            "/payments/charges", {"order": order.ref, "amount_cents": order.amount_cents}
        )
        if charged is not None and charged.is_success:
            undo.insert(0, f"/payments/charges/{charged.json()['id']}/refund")
            email = await call("/emails", {"order": order.ref, "recipient": order.recipient})
            if email is not None and email.is_success:
                return "completed"
        for path in undo:
            undone = await call(path)
            if undone is None or undone.is_error:
                return "needs_intervention"
        return "compensated"

    async with httpx.AsyncClient(
        base_url=url, headers={"X-Caller": caller}, timeout=config.timeout
    ) as http:
        await each_at_most(config.concurrency, plan_orders(config), place)


def _finished(state: Path) -> set[str]:
    return set(state.read_text().split()) if state.exists() else set()


AGENTS = {"saga": saga_agent, "naive": naive_agent}


def agent_main(argv: Sequence[str]) -> int:
    """``python -m example_app.saga_demo agent VARIANT URL CALLER STATE CONFIG``."""
    variant, url, caller, state, raw = argv
    settings = json.loads(raw)
    config = SagaDemoConfig(**{**settings, "rates": FaultRates(**settings["rates"])})
    logging.getLogger("idempotency_mw").setLevel(logging.ERROR)

    def report(ref: str, outcome: str) -> None:
        print(json.dumps({"order": ref, "outcome": outcome}), flush=True)

    asyncio.run(AGENTS[variant](config, url, caller, Path(state), report))
    return 0


# --- The demo ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One variant's run: outcomes per order, after how many orders the agent was killed and
    how many operations its journal held unsettled then (the saga run only), the faults the
    proxy injected, and the invariant violations found in the service's tables."""

    name: str
    outcomes: Mapping[str, str]
    crashed_after: int | None
    in_flight: int | None
    faults: Mapping[Fault, int]
    violations: Mapping[str, int | None]

    def count(self, outcome: str) -> int:
        """How many orders ended with ``outcome``."""
        return sum(1 for value in self.outcomes.values() if value == outcome)

    @property
    def ok(self) -> bool:
        """Whether no invariant was violated."""
        return not any(self.violations.values())


@dataclass(frozen=True, slots=True)
class SagaDemoSummary:
    """Both runs and the wall-clock time of the whole demo."""

    config: SagaDemoConfig
    runs: tuple[RunSummary, ...]
    seconds: float

    @property
    def saga(self) -> RunSummary:
        """The run with sagas and a journal."""
        return next(run for run in self.runs if run.name == "saga")

    @property
    def ok(self) -> bool:
        """Whether the saga run was killed mid-run and still kept every invariant."""
        return self.saga.ok and self.saga.crashed_after is not None


async def run_saga_demo(config: SagaDemoConfig, progress: TextIO | None = None) -> SagaDemoSummary:
    """Run both variants against one fresh service; progress goes to ``progress``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="idempotency-saga-demo-") as tmp:
        database = Path(tmp) / "orders.db"
        runs = []
        async with serve(create_app(f"sqlite:///{database}")) as port:
            for name in VARIANTS:
                async with FaultProxy(
                    port, rates=config.rates, delay=2 * config.timeout, seed=config.seed
                ) as proxy:
                    state = Path(tmp) / f"{name}.state"
                    outcomes, crashed, in_flight = await _run_agent(
                        name, config, proxy.url, state, progress
                    )
                    faults = {fault: proxy.counts.get(fault, 0) for fault in Fault}
                listed = _listed(state) if name == "saga" else None
                violations = check_invariants(database, _caller(name), outcomes, listed, config)
                runs.append(RunSummary(name, outcomes, crashed, in_flight, faults, violations))
    return SagaDemoSummary(config, tuple(runs), time.monotonic() - started)


async def _run_agent(
    name: str, config: SagaDemoConfig, url: str, state: Path, stream: TextIO | None
) -> tuple[dict[str, str], int | None, int | None]:
    """Run the agent ``name``, kill it once ``crash_after`` of the orders are done, run it
    again; every order's last reported outcome, how many were done at the crash, and how
    many operations the saga journal held unsettled then."""
    settings = json.dumps({**asdict(config), "rates": asdict(config.rates)})
    command = [sys.executable, "-m", "example_app.saga_demo", "agent", name, url]
    command += [_caller(name), str(state), settings]
    outcomes: dict[str, str] = {}
    bar = Progress(name, config.orders, stream)
    crash_at = max(1, int(config.orders * config.crash_after))
    crashed: int | None = None
    in_flight: int | None = None
    for life in (1, 2):
        agent = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
        assert agent.stdout is not None
        async for line in agent.stdout:
            reported = json.loads(line)
            if reported["order"] not in outcomes:
                bar.advance()
            outcomes[reported["order"]] = reported["outcome"]
            if life == 1 and len(outcomes) >= crash_at:
                agent.kill()
                crashed = len(outcomes)
                break
        status = await agent.wait()
        if status not in (0, -9):
            raise RuntimeError(f"the {name} agent failed with status {status}")
        if crashed is None:  # it finished before the crash point: nothing to restart
            break
        if name == "saga" and life == 1:
            in_flight = await asyncio.to_thread(_unsettled, state)
    return outcomes, crashed, in_flight


def _unsettled(state: Path) -> int:
    with SQLiteJournal(state) as journal:
        return sum(1 for entry in journal.unsettled() if entry.method is not None)


def _listed(state: Path) -> set[str]:
    """The orders whose operations the saga agent's journal lists for a person."""
    with SQLiteJournal(state) as journal:
        return {row.ref for row in attention_rows(journal)}


def check_invariants(
    database: Path,
    caller: str,
    outcomes: Mapping[str, str],
    listed: set[str] | None,
    config: SagaDemoConfig,
) -> dict[str, int | None]:
    """Per invariant, how many orders of ``caller`` violate it in the service's tables
    (``None``: not applicable to this run)."""
    with closing(sqlite3.connect(database)) as db:

        def per_order(query: str) -> Counter[str]:
            return Counter(ref for (ref,) in db.execute(query, (caller,)))

        reservations = per_order("SELECT order_ref FROM example_reservations WHERE caller = ?")
        charges = per_order("SELECT order_ref FROM example_charges WHERE caller = ?")
        network = per_order("SELECT order_ref FROM example_card_network WHERE caller = ?")
        emails = per_order("SELECT order_ref FROM example_order_emails WHERE caller = ?")
        reserved = per_order(
            "SELECT order_ref FROM example_reservations WHERE caller = ? AND status = 'reserved'"
        )
        captured = per_order(
            "SELECT order_ref FROM example_charges WHERE caller = ? AND status = 'captured'"
        )
        releases = per_order(
            "SELECT r.order_ref FROM example_releases x"
            " JOIN example_reservations r ON r.id = x.reservation_id WHERE r.caller = ?"
            " GROUP BY x.reservation_id HAVING COUNT(*) > 1"
        )
        refunds = per_order(
            "SELECT c.order_ref FROM example_refunds x"
            " JOIN example_charges c ON c.id = x.charge_id WHERE c.caller = ?"
            " GROUP BY x.charge_id HAVING COUNT(*) > 1"
        )

    def ended(outcome: str) -> list[str]:
        return [ref for ref, value in outcomes.items() if value == outcome]

    refs = [order.ref for order in plan_orders(config)]
    return {
        "order without an outcome": sum(1 for ref in refs if ref not in outcomes),
        "duplicate reservation": sum(1 for n in reservations.values() if n > 1),
        "duplicate charge": sum(1 for n in charges.values() if n > 1),
        "duplicate card-network charge": sum(1 for n in network.values() if n > 1),
        "duplicate email": sum(1 for n in emails.values() if n > 1),
        "duplicate release": len(releases),
        "duplicate refund": len(refunds),
        "charge without reservation": sum(1 for ref in captured if not reserved[ref]),
        "orphan after compensation": sum(
            1 for ref in ended("compensated") if reserved[ref] or captured[ref]
        ),
        "completed order not whole": sum(
            1
            for ref in ended("completed")
            if (reserved[ref], captured[ref], emails[ref]) != (1, 1, 1)
        ),
        "intervention not listed": None
        if listed is None
        else sum(1 for ref in ended("needs_intervention") if ref not in listed),
    }


def format_summary(summary: SagaDemoSummary) -> str:
    """Both runs' outcomes and invariant checks side by side, with the verdict underneath."""
    runs = summary.runs
    header = (
        "run",
        "orders",
        "completed",
        "compensated",
        "needs intervention",
        "killed after",
        "left in flight",
    )
    rows = [
        (
            run.name,
            len(run.outcomes),
            run.count(SagaState.COMPLETED),
            run.count(SagaState.COMPENSATED),
            run.count(SagaState.NEEDS_INTERVENTION),
            "-" if run.crashed_after is None else f"{run.crashed_after} orders",
            "-" if run.in_flight is None else f"{run.in_flight} operations",
        )
        for run in runs
    ]
    checks = [
        (
            check,
            *("n/a" if run.violations[check] is None else run.violations[check] for run in runs),
        )
        for check in runs[0].violations
    ]
    faults = [(f"proxy: {fault}", *(run.faults[fault] for run in runs)) for fault in Fault]
    verdict = (
        "OK: the saga run survived a crash and kept every invariant"
        if summary.ok
        else "FAILED: the saga run broke an invariant (or was never killed mid-run)"
    )
    return "\n".join(
        [
            *format_table(header, rows),
            "",
            *format_table(("invariant (orders violating)", *(run.name for run in runs)), checks),
            "",
            *format_table(("exchanges", *(run.name for run in runs)), faults),
            "",
            f"{verdict} ({summary.seconds:.1f}s)",
        ]
    )


def _caller(run: str) -> str:
    return f"saga-demo-{run}"


def _parser() -> argparse.ArgumentParser:
    defaults = SagaDemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m example_app.saga_demo",
        description="Place orders as sagas through a faulty network, with a crash of the agent "
        "mid-run: naive retries, then Saga. Exits 0 when the saga run kept every invariant.",
    )

    def fraction(text: str) -> float:
        value = float(text)
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"must be between 0 and 1: {text}")
        return value

    options: list[tuple[str, Callable[[str], Any], object, str]] = [
        ("orders", positive(int), defaults.orders, "orders placed in each run"),
        ("email-failures", fraction, defaults.email_failures, "fraction of bouncing emails"),
        ("large-orders", fraction, defaults.large_orders, "fraction whose refund needs a person"),
        ("crash-after", fraction, defaults.crash_after, "fraction of orders done at the crash"),
        ("drop-request", fraction, defaults.rates.drop_request, "request drops per exchange"),
        ("drop-response", fraction, defaults.rates.drop_response, "response drops per exchange"),
        ("delay", fraction, defaults.rates.delay, "responses held past the timeout"),
        ("timeout", positive(float), defaults.timeout, "client timeout in seconds"),
        ("concurrency", positive(int), defaults.concurrency, "orders in flight at once"),
        ("seed", int, defaults.seed, "seed of the orders, the faults and the jitter"),
    ]
    for name, kind, default, help_text in options:
        parser.add_argument(
            f"--{name}", type=kind, default=default, help=f"{help_text} ({default})"
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m example_app.saga_demo``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["agent"]:
        return agent_main(arguments[1:])
    parser = _parser()
    args = parser.parse_args(arguments)
    try:
        rates = FaultRates(args.drop_request, args.drop_response, args.delay)
    except ValueError as exc:
        parser.error(str(exc))
    config = SagaDemoConfig(
        orders=args.orders,
        email_failures=args.email_failures,
        large_orders=args.large_orders,
        rates=rates,
        seed=args.seed,
        timeout=args.timeout,
        concurrency=args.concurrency,
        crash_after=args.crash_after,
    )
    summary = asyncio.run(run_saga_demo(config, progress=sys.stderr))
    print(format_summary(summary))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
