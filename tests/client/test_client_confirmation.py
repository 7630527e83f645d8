"""Confirm before re-sending, and what an attempt that never left the caller means.

An operation whose first attempt is older than the client's retention, or whose server does
not understand keys, is looked up by a probe instead of re-sent blindly; without a probe it
waits for a person (``needs_confirmation``). Attempts that never left the caller are retried at
once and end in ``NotSent``, never ``OutcomeUnknown``. Against the real middleware with fake
time; on real sockets where the error or the headers must be the real thing.
"""

from __future__ import annotations

import base64
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from example_app.demo import serve
from idempotency_mw import ConfigurationError
from idempotency_mw.client import (
    DEFAULT_RETENTION,
    AsyncProbe,
    CommittedWithoutResponse,
    IdempotentClient,
    JournalEntry,
    NeedsConfirmation,
    NotSent,
    Operation,
    OperationState,
    OutcomeUnknown,
    ResponseNotReplayable,
    RetryPolicy,
    SyncIdempotentClient,
)
from tests.support.client_support import (
    NO_JITTER,
    FakeTime,
    Faulty,
    Server,
    close,
    make_client,
    problem,
    scripted,
)

TWO_DAYS = 2 * 86400.0
TICKET = {"title": "printer on fire", "ref": "order-17"}


def finder(calls: list[str]) -> AsyncProbe:
    """A probe that looks a ticket up by the operation's ref, recording each call."""

    async def find_ticket(http: httpx.AsyncClient, entry: JournalEntry) -> httpx.Response | None:
        calls.append(entry.key)
        found = await http.get("/tickets", params={"ref": entry.ref})
        return found if found.json() else None

    return find_ticket


def posts(transport: Faulty) -> list[httpx.Request]:
    return [request for request in transport.requests if request.method == "POST"]


async def left_unknown(
    server: Server, journal_path: Path, fake_time: FakeTime, fault: str = "lose"
) -> Operation:
    """A create-ticket operation whose only attempt was lost to ``fault`` (after the server
    acted, for ``lose``), journaled as first sent two days ago."""
    client = make_client(
        Faulty(server.app, [fault]), journal_path, fake_time, RetryPolicy(max_attempts=1)
    )
    try:
        op = await client.operation("create-ticket", ref="order-17")
        with pytest.raises(OutcomeUnknown):
            await client.send(op, "POST", "/tickets", json=TICKET)
        entry = client.journal.get(op.key)
        assert entry is not None
        client.journal.save(replace(entry, first_sent_at=time.time() - TWO_DAYS))
    finally:
        await close(client)
    return op


def test_the_default_retention_stays_under_the_servers_default_ttl() -> None:
    assert 0 < DEFAULT_RETENTION.total_seconds() < 24 * 3600


# --- Past the retention ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_past_retention_without_a_probe_nothing_is_resent_and_a_person_is_asked(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    op = await left_unknown(server, journal_path, fake_time)
    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        [settled] = await client.reconcile()
        [again] = await client.reconcile()
        with pytest.raises(NeedsConfirmation, match="older than the client's retention"):
            await client.send(op, "POST", "/tickets", json=TICKET)
        attention = await client.attention()
    finally:
        await close(client)
    assert transport.requests == []
    assert server.calls["tickets"] == 1
    assert (settled.key, settled.state) == (op.key, OperationState.NEEDS_CONFIRMATION)
    assert again.state is OperationState.NEEDS_CONFIRMATION
    assert [entry.key for entry in attention] == [op.key]


@pytest.mark.anyio
async def test_past_retention_a_probe_that_finds_the_effect_confirms_it(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    op = await left_unknown(server, journal_path, fake_time)
    transport, calls = Faulty(server.app), list[str]()
    client = make_client(
        transport, journal_path, fake_time, confirm={"create-ticket": finder(calls)}
    )
    try:
        [settled] = await client.reconcile()
        replayed = await client.send(op, "POST", "/tickets", json=TICKET)
        attention = await client.attention()
    finally:
        await close(client)
    assert calls == [op.key]
    assert posts(transport) == []
    assert server.calls["tickets"] == 1
    assert (settled.state, settled.status) == (OperationState.CONFIRMED, 200)
    assert settled.response is not None
    assert settled.response.json() == [{"id": 1, **TICKET}]
    assert replayed.json() == [{"id": 1, **TICKET}]  # from the journal: nothing more was sent
    assert len(transport.requests) == 1
    assert attention == []


@pytest.mark.anyio
async def test_past_retention_a_probe_that_finds_nothing_lets_it_be_sent_with_its_key(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    op = await left_unknown(server, journal_path, fake_time, fault="vanish")
    transport, calls = Faulty(server.app), list[str]()
    client = make_client(
        transport, journal_path, fake_time, confirm={"create-ticket": finder(calls)}
    )
    try:
        [settled] = await client.reconcile()
    finally:
        await close(client)
    assert calls == [op.key]
    assert [request.headers["idempotency-key"] for request in posts(transport)] == [op.key]
    assert server.calls["tickets"] == 1
    assert (settled.state, settled.status) == (OperationState.CONFIRMED, 201)
    assert settled.first_sent_at is not None
    assert settled.first_sent_at > time.time() - 60  # the new send starts the retention anew


@pytest.mark.anyio
async def test_a_probe_that_keeps_failing_leaves_the_operation_unknown(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    op = await left_unknown(server, journal_path, fake_time)
    tries: list[str] = []

    async def broken(http: httpx.AsyncClient, entry: JournalEntry) -> httpx.Response | None:
        tries.append(entry.key)
        raise httpx.ConnectError("the lookup service is down")

    transport = Faulty(server.app)
    policy = RetryPolicy(max_attempts=3, backoff_base=0.5)
    client = make_client(
        transport, journal_path, fake_time, policy, confirm={"create-ticket": broken}
    )
    try:
        [settled] = await client.reconcile()
    finally:
        await close(client)
    assert tries == [op.key] * 3
    assert transport.requests == []
    assert settled.state is OperationState.UNKNOWN
    assert server.calls["tickets"] == 1


# --- Servers that do not understand keys ---------------------------------------------------


@pytest.mark.anyio
async def test_keyless_a_lost_attempt_is_looked_up_not_sent_again(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport, calls = Faulty(server.app, ["lose"]), list[str]()
    client = make_client(
        transport, journal_path, fake_time, confirm={"create-ticket": finder(calls)}
    )
    try:
        op = await client.operation("create-ticket", ref="order-17")
        found = await client.send(op, "POST", "/tickets", keyless=True, json=TICKET)
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert found.json() == [{"id": 1, **TICKET}]
    assert calls == [op.key]
    assert len(posts(transport)) == 1
    assert server.calls["tickets"] == 1
    assert entry is not None
    assert (entry.state, entry.keyless) == (OperationState.CONFIRMED, True)


@pytest.mark.anyio
async def test_keyless_without_a_probe_a_lost_attempt_needs_confirmation(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport = Faulty(server.app, ["lose"])
    client = make_client(transport, journal_path, fake_time, keyless=True)
    try:
        op = await client.operation("create-ticket", ref="order-17")
        with pytest.raises(NeedsConfirmation, match="does not understand keys"):
            await client.send(op, "POST", "/tickets", json=TICKET)
        settled = await client.reconcile()
        attention = await client.attention()
    finally:
        await close(client)
    assert len(posts(transport)) == 1
    assert [(e.key, e.state) for e in settled] == [(op.key, OperationState.NEEDS_CONFIRMATION)]
    assert [entry.key for entry in attention] == [op.key]
    assert fake_time.sleeps == []


@pytest.mark.anyio
async def test_keyless_an_attempt_that_never_left_is_retried_without_asking(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport, calls = Faulty(server.app, ["drop"]), list[str]()
    client = make_client(
        transport, journal_path, fake_time, keyless=True, confirm={"create-ticket": finder(calls)}
    )
    try:
        response = await client.post("/tickets", json=TICKET, operation="create-ticket")
    finally:
        await close(client)
    assert response.status_code == 201
    assert calls == []
    assert len(posts(transport)) == 2
    assert fake_time.sleeps == [0.0]


def test_the_sync_client_takes_sync_probes(fake_time: FakeTime) -> None:
    created: list[bytes] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json=[{"id": len(created)}] if created else [])
        created.append(request.content)
        raise httpx.ReadTimeout("the response was lost", request=request)

    def find(http: httpx.Client, entry: JournalEntry) -> httpx.Response | None:
        found = http.get("/tickets", params={"ref": entry.ref})
        return found if found.json() else None

    with SyncIdempotentClient(
        http=httpx.Client(transport=httpx.MockTransport(handle), base_url="http://testserver"),
        journal=":memory:",
        policy=NO_JITTER,
        sleep=fake_time.sleep_sync,
        clock=fake_time.clock,
        keyless=True,
        confirm={"create-ticket": find},
    ) as client:
        response = client.post("/tickets", json=TICKET, operation="create-ticket", ref="o-1")
    assert response.json() == [{"id": 1}]
    assert len(created) == 1


# --- Attempts that never left the caller ----------------------------------------------------


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on (connections to it are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.anyio
async def test_refused_connections_end_in_not_sent_never_outcome_unknown(
    journal_path: Path, fake_time: FakeTime
) -> None:
    policy = RetryPolicy(max_attempts=4, backoff_base=1.0, backoff_cap=1.0)
    client = IdempotentClient(
        base_url=f"http://127.0.0.1:{free_port()}",
        journal=journal_path,
        policy=policy,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
        rng=random.Random(3),
    )
    async with client:
        op = await client.operation("create-ticket", ref="order-17")
        with pytest.raises(NotSent) as caught:
            await client.send(op, "POST", "/tickets", json=TICKET)
        entry = client.journal.get(op.key)
        reconciled = await client.reconcile()
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert not isinstance(caught.value, OutcomeUnknown)
    assert entry is not None
    assert (entry.state, entry.status) == (OperationState.FAILED, None)
    assert reconciled == []  # it did not happen: nothing for reconcile() to settle
    assert fake_time.sleeps[0] == 0.0  # the first retry goes at once
    assert len(fake_time.sleeps) == 3
    assert all(0.0 <= wait <= 1.0 for wait in fake_time.sleeps[1:])


@pytest.mark.anyio
async def test_an_operation_that_never_left_is_sent_when_sent_again(fake_time: FakeTime) -> None:
    transport, keys = scripted(httpx.ConnectError("refused"), httpx.ConnectError("refused"))
    client = make_client(transport, ":memory:", fake_time, RetryPolicy(max_attempts=2))
    try:
        op = await client.operation("create-ticket")
        with pytest.raises(NotSent):
            await client.send(op, "POST", "/tickets", json=TICKET)
        response = await client.send(op, "POST", "/tickets", json=TICKET)
    finally:
        await close(client)
    assert response.status_code == 201
    assert keys == [op.key] * 3


@pytest.mark.anyio
async def test_refusals_after_an_attempt_that_may_have_arrived_stay_unknown(
    fake_time: FakeTime,
) -> None:
    transport, keys = scripted(
        httpx.ReadTimeout("lost"), httpx.ConnectError("refused"), httpx.ConnectError("refused")
    )
    client = make_client(transport, ":memory:", fake_time, RetryPolicy(max_attempts=3))
    try:
        op = await client.operation("create-ticket")
        with pytest.raises(OutcomeUnknown):
            await client.send(op, "POST", "/tickets", json=TICKET)
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert entry is not None
    assert entry.state is OperationState.UNKNOWN
    assert len(keys) == 3


# --- Committed without a response ----------------------------------------------------------


@pytest.mark.anyio
async def test_committed_without_response_is_confirmed_and_raised_again_from_the_journal(
    fake_time: FakeTime,
) -> None:
    transport, keys = scripted(problem(409, "committed-without-response"))
    client = make_client(transport, ":memory:", fake_time)
    try:
        op = await client.operation("create-ticket")
        with pytest.raises(CommittedWithoutResponse) as first:
            await client.send(op, "POST", "/tickets", json=TICKET)
        with pytest.raises(CommittedWithoutResponse) as second:
            await client.send(op, "POST", "/tickets", json=TICKET)
        entry = client.journal.get(op.key)
        reconciled = await client.reconcile()
    finally:
        await close(client)
    assert isinstance(first.value, ResponseNotReplayable)
    assert first.value.response is not None
    assert first.value.response.status_code == 409
    assert second.value.key == op.key
    assert keys == [op.key]  # confirmed: never sent again
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert reconciled == []


# --- Headers and credentials of the httpx client it makes -----------------------------------


async def echo(request: Request) -> Response:
    return JSONResponse(dict(request.headers), 201)


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    async with serve(Starlette(routes=[Route("/echo", echo, methods=["POST"])])) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.anyio
async def test_headers_and_auth_reach_the_httpx_client_each_client_makes(
    echo_url: str, tmp_path: Path
) -> None:
    options: dict[str, Any] = {
        "headers": {"X-Caller": "alice"},
        "auth": httpx.BasicAuth("alice", "s3cret"),
    }
    expected = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    async with IdempotentClient(base_url=echo_url, journal=tmp_path / "a", **options) as client:
        op = await client.operation("echo")
        seen = (await client.send(op, "POST", "/echo", json={})).json()
        entry = client.journal.get(op.key)

    def send_sync() -> dict[str, str]:  # in a thread: the server runs on this event loop
        with SyncIdempotentClient(base_url=echo_url, journal=tmp_path / "s", **options) as sync:
            seen: dict[str, str] = sync.post("/echo", json={}, operation="echo").json()
        return seen

    seen_sync = await anyio.to_thread.run_sync(send_sync)
    for headers in (seen, seen_sync):
        assert (headers["x-caller"], headers["authorization"]) == ("alice", expected)
    assert entry is not None
    assert dict(entry.headers) == {"content-type": "application/json"}  # no credentials


def test_headers_and_auth_cannot_reach_a_given_httpx_client() -> None:
    with pytest.raises(ConfigurationError, match="httpx client you give"):
        SyncIdempotentClient(http=httpx.Client(), journal=":memory:", headers={"X-A": "1"})
