"""The duplicate-ticket demo over MCP: an agent calls the ``create_ticket`` tool over a faulty
network and is killed mid-run, twice over.

``python -m example_app.mcp_demo`` serves :mod:`example_app.mcp_server` (uvicorn, streamable
HTTP with JSON answers, a fresh SQLite file in a temporary directory) behind a
:class:`~example_app.proxy.FaultProxy` that drops requests, drops answers after the tool ran
and delays answers past the agent's timeout. An agent process makes ``--operations`` calls,
is killed (SIGKILL) once half of them are done and started again: first naively (a new call
per attempt, and after the restart the calls it never saw answered made again), then with
:class:`~idempotency_mw.client.mcp.IdempotentToolCaller`, whose journal resumes each call
under its key. The tickets are counted in the database; the exit status is 0 only when the
second run created every ticket exactly once and confirmed every call.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import closing, suppress
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from mcp.client.client import Client

from example_app.demo import (
    DemoConfig,
    DemoSummary,
    Progress,
    _parser,
    _summarize,
    each_at_most,
    format_summary,
    parse_config,
    serve,
)
from example_app.mcp_server import create_app
from example_app.proxy import Fault, FaultProxy, FaultRates
from idempotency_mw.client import OperationState, OutcomeUnknown
from idempotency_mw.client.mcp import IdempotentToolCaller

RUNS = ("naive", "idempotent")
#: The agent is killed once this fraction of its calls is done.
CRASH_AFTER = 0.5
#: A call opens a session of its own: three exchanges through the proxy, each of which may
#: fail. A third of the rate per exchange faults about as many calls as the HTTP demo's.
DEFAULTS = DemoConfig(rates=FaultRates(0.04, 0.04, 0.04), concurrency=24)


async def run_demo(config: DemoConfig, progress: TextIO | None = None) -> DemoSummary:
    """Run both agents against a fresh server; progress bars go to ``progress``."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="idempotency-mcp-demo-") as tmp:
        database = Path(tmp) / "demo.db"
        measured: list[tuple[str, int, Mapping[Fault, int]]] = []
        async with serve(create_app(f"sqlite:///{database}")) as port:
            for name in RUNS:
                async with FaultProxy(
                    port, rates=config.rates, delay=2 * config.timeout, seed=config.seed
                ) as proxy:
                    bar = Progress(name, config.operations, progress)
                    state = Path(tmp) / name
                    confirmed = await run_agent(name, config, f"{proxy.url}/mcp", state, bar)
                    measured.append((name, confirmed, proxy.counts.copy()))
        tickets = count_tickets(database)
    naive, idempotent = (
        _summarize(name, config.operations, confirmed, faults, tickets[name])
        for name, confirmed, faults in measured
    )
    return DemoSummary(naive, idempotent, time.monotonic() - started)


def count_tickets(database: Path) -> dict[str, tuple[int, int]]:
    """Per run: tickets in the database, and distinct ``client_ref`` among them."""
    runs: dict[str, Counter[str]] = {name: Counter() for name in RUNS}
    with closing(sqlite3.connect(database)) as db:
        for (ref,) in db.execute("SELECT client_ref FROM example_tickets"):
            runs[ref.partition(":")[0]][ref] += 1
    return {name: (sum(refs.values()), len(refs)) for name, refs in runs.items()}


async def run_agent(name: str, config: DemoConfig, url: str, state: Path, bar: Progress) -> int:
    """Run the agent ``name`` in a process of its own, kill it once half its calls are done,
    run it again; how many calls it saw confirmed."""
    settings = json.dumps({**asdict(config), "rates": asdict(config.rates)})
    command = [sys.executable, "-m", "example_app.mcp_demo", "agent", name, url, str(state)]
    done: set[int] = set()
    confirmed: set[int] = set()
    journal_confirmed = 0
    crash_at = max(1, int(config.operations * CRASH_AFTER))
    for life in (1, 2):
        agent = await asyncio.create_subprocess_exec(
            *command, settings, stdout=asyncio.subprocess.PIPE
        )
        assert agent.stdout is not None
        async for line in agent.stdout:
            reported = json.loads(line)
            if "journal_confirmed" in reported:
                journal_confirmed = reported["journal_confirmed"]
                continue
            if reported["index"] not in done:
                done.add(reported["index"])
                bar.advance()
            if reported["confirmed"]:
                confirmed.add(reported["index"])
            if life == 1 and len(done) >= crash_at:
                agent.kill()
                break
        status = await agent.wait()
        if status not in (0, -9):
            raise RuntimeError(f"the {name} agent failed with status {status}")
        if status == 0:
            break
    return journal_confirmed if name == "idempotent" else len(confirmed)


def report(index: int, confirmed: bool) -> None:
    print(json.dumps({"index": index, "confirmed": confirmed}), flush=True)


def ticket(run: str, index: int) -> dict[str, str]:
    return {"title": f"Printer on floor {index % 7} is on fire", "client_ref": f"{run}:{index:05d}"}


def noted(state: Path) -> list[str]:
    return state.read_text().split() if state.exists() else []


async def naive_agent(config: DemoConfig, url: str, state: Path) -> None:
    """A new call per attempt; after a restart, the calls not yet seen answered (noted in
    the file ``state``) are made again."""
    policy = config.policy
    rng = random.Random(config.seed)
    answered = set(await asyncio.to_thread(noted, state))

    async def create(index: int) -> None:
        if str(index) in answered:
            return
        for attempt in range(1, policy.max_attempts + 1):
            try:
                async with Client(url, read_timeout_seconds=config.timeout) as session:
                    result = await session.call_tool(
                        "create_ticket",
                        ticket("naive", index),
                        read_timeout_seconds=config.timeout,
                    )
            except Exception:
                pass
            else:
                if not result.is_error:
                    with state.open("a") as noted:
                        noted.write(f"{index}\n")
                    report(index, True)
                    return
            if attempt < policy.max_attempts:
                await asyncio.sleep(policy.backoff(attempt, rng))
        report(index, False)

    await each_at_most(config.concurrency, range(config.operations), create)


async def idempotent_agent(config: DemoConfig, url: str, state: Path) -> None:
    """One journaled key per call (its ref); after a restart the journal answers the calls
    that settled and resumes the others under their keys. Ends by reconciling what is left
    unknown and reporting how many calls the journal calls confirmed."""
    keys: dict[int, str] = {}
    async with IdempotentToolCaller(
        connect=lambda: Client(url, read_timeout_seconds=config.timeout),
        journal=state.with_suffix(".journal.sqlite3"),
        policy=config.policy,
        rng=random.Random(config.seed),
        lease=timedelta(seconds=2),
    ) as caller:

        async def create(index: int) -> None:
            operation = await caller.operation("create_ticket", ref=f"ticket-{index:05d}")
            keys[index] = operation.key
            result = None
            with suppress(OutcomeUnknown):  # left in the journal for reconcile() below
                result = await caller.send(operation, ticket("idempotent", index))
            report(index, result is not None and not result.is_error)

        await each_at_most(config.concurrency, range(config.operations), create)
        await caller.client.reconcile()
        journal = caller.client.journal
        entries = [await asyncio.to_thread(journal.get, key) for key in keys.values()]
    settled = sum(1 for entry in entries if entry and entry.state is OperationState.CONFIRMED)
    print(json.dumps({"journal_confirmed": settled}), flush=True)


def agent_main(arguments: Sequence[str]) -> int:
    """``agent NAME URL STATE SETTINGS``: one life of an agent process."""
    name, url, state, settings = arguments
    values: dict[str, Any] = json.loads(settings)
    config = DemoConfig(**{**values, "rates": FaultRates(**values["rates"])})
    agent = naive_agent if name == "naive" else idempotent_agent
    asyncio.run(agent(config, url, Path(state)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m example_app.mcp_demo``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["agent"]:
        return agent_main(arguments[1:])
    parser = _parser()
    parser.set_defaults(
        concurrency=DEFAULTS.concurrency,
        drop_request=DEFAULTS.rates.drop_request,
        drop_response=DEFAULTS.rates.drop_response,
        delay=DEFAULTS.rates.delay,
    )
    parser.prog = "python -m example_app.mcp_demo"
    parser.description = (
        "Call an MCP tool through a faulty network, the agent killed once mid-run: naive "
        "retries, then IdempotentToolCaller. Exits 0 when the latter created every ticket once."
    )
    config = parse_config(parser, arguments)
    summary = asyncio.run(run_demo(config, progress=sys.stderr))
    print(format_summary(summary))
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
