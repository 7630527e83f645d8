"""An operation left unknown until the server forgot its key: reconcile() never makes a second
ticket, with a probe (it finds the ticket) or without one (a person is asked).

Real HTTP: the example service under uvicorn with a ticket TTL of two seconds, and the
fault-injecting proxy losing every response of the first client.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import anyio
import httpx
import pytest

from example_app.app import create_app
from example_app.demo import serve
from example_app.proxy import FaultProxy, FaultRates
from idempotency_mw.client import (
    AsyncProbe,
    IdempotentClient,
    JournalEntry,
    OperationState,
    OutcomeUnknown,
    RetryPolicy,
)

CALLER = {"X-Caller": "agent-7"}
TICKET = {"title": "printer on fire", "client_ref": "order-17"}
RETENTION = timedelta(seconds=0.5)
#: The ticket's TTL, short so that the server forgets the key within the test. Its lease (which
#: must be shorter) once was 0.5 s: on a loaded machine the claim or a renewal took longer, the
#: request was refused 503 lease-lost with nothing run, and no ticket ever came.
TICKET_TTL = timedelta(seconds=2)
LEASE = timedelta(seconds=1.5)


async def find_ticket(http: httpx.AsyncClient, entry: JournalEntry) -> httpx.Response | None:
    """The ticket whose client_ref is the operation's ref, if the service has one."""
    listed = await http.get("/tickets")
    found = [ticket for ticket in listed.json() if ticket["client_ref"] == entry.ref]
    return httpx.Response(200, json=found[0], request=listed.request) if found else None


def tickets(database: Path, ref: str) -> int:
    with closing(sqlite3.connect(database)) as db:
        query = "SELECT COUNT(*) FROM example_tickets WHERE client_ref = ?"
        count: int = db.execute(query, (ref,)).fetchone()[0]
    return count


def in_progress_records(database: Path) -> int:
    with closing(sqlite3.connect(database)) as db:
        query = "SELECT COUNT(*) FROM idempotency_records WHERE status = 'in_progress'"
        count: int = db.execute(query).fetchone()[0]
    return count


@pytest.mark.anyio
@pytest.mark.parametrize("probe", [None, find_ticket], ids=["no-probe", "probe"])
async def test_reconcile_after_the_server_forgot_the_key_never_makes_a_second_ticket(
    tmp_path: Path, probe: AsyncProbe | None
) -> None:
    database, journal = tmp_path / "service.db", tmp_path / "journal.sqlite3"
    app = create_app(f"sqlite:///{database}", ticket_ttl=TICKET_TTL, lease=LEASE)
    async with (
        serve(app) as port,
        FaultProxy(port, rates=FaultRates(drop_response=1.0), delay=0.0) as proxy,
    ):
        async with IdempotentClient(
            base_url=proxy.url,
            headers=CALLER,
            journal=journal,
            policy=RetryPolicy(max_attempts=1),
            retention=RETENTION,
        ) as before:
            op = await before.operation("create-ticket", ref="order-17")
            with pytest.raises(OutcomeUnknown):
                await before.send(op, "POST", "/tickets", json=TICKET)
        # The proxy dropped the response without waiting for it: the service may still be
        # creating the ticket and recording its answer (on a loaded machine, a while). The
        # record's TTL runs from then.
        with anyio.fail_after(10):
            while not tickets(database, "order-17") or in_progress_records(database):  # noqa: ASYNC110 (polls the database)
                await anyio.sleep(0.02)
        assert tickets(database, "order-17") == 1
        # Past the record's TTL and the client's retention.
        await anyio.sleep((max(TICKET_TTL, RETENTION) + timedelta(seconds=0.2)).total_seconds())

        proxy.rates = FaultRates()  # the network heals; the agent restarts
        async with IdempotentClient(
            base_url=proxy.url,
            headers=CALLER,
            journal=journal,
            retention=RETENTION,
            confirm={} if probe is None else {"create-ticket": probe},
        ) as after:
            [settled] = await after.reconcile()
            attention = await after.attention()
        assert tickets(database, "order-17") == 1

        # What a blind re-send would have done: the server forgot the key and runs it again.
        async with httpx.AsyncClient(base_url=proxy.url, headers=CALLER) as http:
            blind = await http.post("/tickets", json=TICKET, headers={"Idempotency-Key": op.key})
        assert (blind.status_code, blind.headers.get("idempotent-replayed")) == (201, None)
        assert tickets(database, "order-17") == 2
    if probe is None:
        assert settled.state is OperationState.NEEDS_CONFIRMATION
        assert [entry.key for entry in attention] == [op.key]
    else:
        assert settled.state is OperationState.CONFIRMED
        assert settled.response is not None
        assert settled.response.json()["client_ref"] == "order-17"
        assert attention == []
