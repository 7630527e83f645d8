"""Operations leased in shared journals, with real processes (``tests/support/lease_agent.py``).

Two agent processes ask for the same operation (same name and ref) on one PostgreSQL or Redis
journal: they get the same key, and the second waits while the first holds the lease. When the
holder settles the operation, the waiter answers with its outcome without sending; when the
holder is killed (SIGKILL), the waiter takes over once the lease lapses. The example service
runs under uvicorn; a "black hole" that accepts connections and never answers keeps a holder
sending for as long as the test wants.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
import redis
from sqlalchemy import create_engine, delete

from example_app.app import create_app
from example_app.demo import serve
from example_app.proxy import HOST, FaultProxy, FaultRates
from idempotency_mw.client import (
    IdempotentClient,
    Journal,
    OperationState,
    RedisJournal,
    SQLiteJournal,
    SQLJournal,
    journal_table,
    sync_url,
)
from tests.conftest import POSTGRESQL_URL, REDIS_URL, fresh_journal_table, require_server

LEASE = 1.0  # tests/support/lease_agent.py


@dataclass
class Shared:
    """A journal URL the agents share, and this test's own view of it."""

    url: str
    prefix: str
    journal: Journal

    def state(self, key: str) -> OperationState | None:
        entry = self.journal.get(key)
        return None if entry is None else entry.state


@pytest.fixture(params=["postgresql", "redis"])
def shared(request: pytest.FixtureRequest) -> Iterator[Shared]:
    prefix = f"t{uuid.uuid4().hex[:12]}-"
    if request.param == "redis":
        require_server(REDIS_URL)
        redis_prefix = f"test-{prefix}"
        yield Shared(REDIS_URL, redis_prefix, RedisJournal(REDIS_URL, prefix=redis_prefix))
        with redis.Redis.from_url(REDIS_URL) as client:
            keys = list(client.scan_iter(match=f"{redis_prefix}*"))
            if keys:
                client.delete(*keys)
        return
    require_server(POSTGRESQL_URL)
    fresh_journal_table(POSTGRESQL_URL)
    journal = SQLJournal(POSTGRESQL_URL)
    yield Shared(POSTGRESQL_URL, prefix, journal)
    journal.close()
    engine = create_engine(sync_url(POSTGRESQL_URL))
    with engine.begin() as conn:
        conn.execute(delete(journal_table).where(journal_table.c.name.startswith(prefix)))
    engine.dispose()


@dataclass
class Service:
    url: str
    database: Path

    def tickets(self, ref: str) -> int:
        with closing(sqlite3.connect(self.database)) as db:
            query = "SELECT COUNT(*) FROM example_tickets WHERE client_ref = ?"
            count: int = db.execute(query, (ref,)).fetchone()[0]
        return count


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    database = tmp_path / "service.db"
    async with serve(create_app(f"sqlite:///{database}")) as port:
        yield Service(f"http://{HOST}:{port}", database)


@pytest.fixture
async def black_hole() -> AsyncIterator[str]:
    """A URL whose server reads requests and never answers."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(swallow, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://{HOST}:{port}"
    server.close()


class Agent:
    """An agent process sending the operation ``name`` for ``ref`` to ``url``."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, shared: Shared, url: str, name: str, ref: str) -> Agent:
        command = [
            sys.executable,
            "-m",
            "tests.support.lease_agent",
            shared.url,
            shared.prefix,
            url,
        ]
        process = await asyncio.create_subprocess_exec(
            *command, name, ref, stdout=asyncio.subprocess.PIPE
        )
        return cls(process)

    async def line(self, within: float) -> dict[str, Any]:
        """The next line the agent prints, as JSON, if it prints one ``within`` seconds."""
        assert self.process.stdout is not None
        with anyio.fail_after(within):
            reported: dict[str, Any] = json.loads(await self.process.stdout.readline())
        return reported

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()


@pytest.fixture
async def agents() -> AsyncIterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        await agent.kill()


async def until(check: Callable[[], bool]) -> None:
    """Poll ``check`` (a journal read, in a thread) until it holds."""
    with anyio.fail_after(10):
        while not await anyio.to_thread.run_sync(check):  # noqa: ASYNC110 (polls a journal)
            await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_a_waiter_takes_over_once_the_killed_holders_lease_lapses(
    shared: Shared, service: Service, black_hole: str, agents: list[Agent]
) -> None:
    name, ref = f"{shared.prefix}create-ticket", "order-17"
    holder = await Agent.start(shared, black_hole, name, ref)
    agents.append(holder)
    key = (await holder.line(30))["key"]
    await until(lambda: shared.state(key) is OperationState.SENT)  # it holds the lease, sending

    waiter = await Agent.start(shared, service.url, name, ref)
    agents.append(waiter)
    assert (await waiter.line(30))["key"] == key
    with pytest.raises(TimeoutError):  # renewed while sending: the waiter keeps waiting
        await waiter.line(4 * LEASE)
    assert service.tickets(ref) == 0

    await holder.kill()  # SIGKILL: no release, the lease has to lapse
    killed = time.monotonic()
    outcome = await waiter.line(10)
    assert time.monotonic() - killed < 3 * LEASE
    assert outcome["status"] == 201
    assert outcome["body"]["client_ref"] == ref
    assert service.tickets(ref) == 1
    assert shared.state(key) is OperationState.CONFIRMED


@pytest.mark.anyio
async def test_a_waiter_answers_with_the_holders_outcome_without_sending(
    shared: Shared, service: Service, agents: list[Agent]
) -> None:
    port = int(service.url.rsplit(":", 1)[1])
    name, ref = f"{shared.prefix}create-ticket", "order-18"
    async with (
        FaultProxy(port, rates=FaultRates(delay=1.0), delay=2.0) as slow,
        FaultProxy(port, rates=FaultRates(), delay=0.0) as counted,
    ):
        holder = await Agent.start(shared, slow.url, name, ref)
        agents.append(holder)
        key = (await holder.line(30))["key"]
        await until(lambda: shared.state(key) is OperationState.SENT)
        waiter = await Agent.start(shared, counted.url, name, ref)
        agents.append(waiter)
        assert (await waiter.line(30))["key"] == key
        held, waited = await holder.line(30), await waiter.line(30)
    assert held["status"] == 201
    assert waited == held
    assert sum(counted.counts.values()) == 0  # the waiter never sent it
    assert service.tickets(ref) == 1


def hanging_client(path: Path, hang: anyio.Event) -> tuple[IdempotentClient, SQLiteJournal]:
    """A client with 0.3 s leases whose requests to ``/hang`` hang until ``hang`` is set."""

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/hang":
            await hang.wait()
        return httpx.Response(201)

    journal = SQLiteJournal(path / "journal.sqlite3")
    client = IdempotentClient(
        http=httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://x"),
        journal=journal,
        lease=timedelta(seconds=0.3),
    )
    return client, journal


@pytest.mark.anyio
async def test_a_send_that_ends_or_is_cancelled_lets_go_of_its_lease(tmp_path: Path) -> None:
    client, journal = hanging_client(tmp_path, anyio.Event())
    async with client.http, client:
        done = await client.operation("done")
        await client.send(done, "POST", "/done")
        hung = await client.operation("hung")
        with anyio.move_on_after(0.5):  # renewed meanwhile, then cancelled mid-request
            await client.send(hung, "POST", "/hang")
        await anyio.sleep(0.5)  # a renewal left running would hold the lease past this
        assert journal.acquire(done.key, "another", 30.0)
        assert journal.acquire(hung.key, "another", 30.0)
    journal.close()


@pytest.mark.anyio
async def test_the_async_client_renews_its_lease_in_a_task_not_a_thread_per_send(
    tmp_path: Path,
) -> None:
    hang = anyio.Event()
    threads_while_sending: list[set[str]] = []
    client, journal = hanging_client(tmp_path, hang)
    async with client.http, client, anyio.create_task_group() as tg:
        operation = await client.operation("held")
        tg.start_soon(client.send, operation, "POST", "/hang")
        await anyio.sleep(0.7)  # past two lease lengths: only renewals keep it
        threads_while_sending.append({thread.name for thread in threading.enumerate()})
        assert not await anyio.to_thread.run_sync(journal.acquire, operation.key, "other", 30.0)
        hang.set()
    assert "idempotency-lease" not in threads_while_sending[0]
    assert journal.acquire(operation.key, "other", 30.0)  # released once the send ended
    journal.close()
