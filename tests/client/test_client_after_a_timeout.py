"""The client after a timeout, against the real middleware on SQLite, PostgreSQL and Redis:
it looks its key up before it sends again, sends its first-sent time on every attempt, and
journals until when the server keeps its key."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from idempotency_mw import SQLStore
from idempotency_mw.client import (
    ClientEvent,
    JournalEntry,
    NeedsConfirmation,
    OperationError,
    OperationState,
    ResponseNotReplayable,
)
from idempotency_mw.client.values import KEY_EXPIRES_HEADER, LOOKED_UP_HEADER
from idempotency_mw.wire.http import http_date, parse_http_date
from tests.conftest import built_store
from tests.support.client_support import (
    FakeTime,
    Faulty,
    Server,
    close,
    make_client,
    problem,
    scripted,
)

pytestmark = pytest.mark.anyio

LOOKUP = "/idempotency-keys"
#: The server's retention: shorter than the client's (23 hours).
RETENTION = 600
TICKET = {"title": "printer on fire", "ref": "t-1"}


@pytest.fixture(params=["sqlite-url", "postgresql-url", "redis-url"])
async def server(request: pytest.FixtureRequest) -> AsyncIterator[Server]:
    async with built_store(request.param, request) as made:
        # Server is typed for the SQL store it was written for; any store serves.
        yield Server(cast(SQLStore, made), lookup_path=LOOKUP, ttl=RETENTION)


def methods(transport: Faulty) -> list[str]:
    return [request.method for request in transport.requests]


async def sent_once(
    server: Server, fault: str, journal_path: Path, fake_time: FakeTime, path: str
) -> tuple[Faulty, httpx.Response | OperationError, JournalEntry | None]:
    """One operation POSTed to ``path`` by a client that looks keys up, its first attempt
    met by ``fault``: the transport, the answer (or the error) and the journaled entry."""
    transport = Faulty(server.app, [fault])
    client = make_client(transport, journal_path, fake_time, lookup_path=LOOKUP)
    try:
        op = await client.operation("create-ticket")
        try:
            answer: httpx.Response | OperationError = await client.send(
                op, "POST", path, json=TICKET
            )
        except OperationError as exc:
            answer = exc
        return transport, answer, client.journal.get(op.key)
    finally:
        await close(client)


async def test_a_timed_out_attempt_that_took_effect_is_looked_up_never_resent(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport, answer, entry = await sent_once(server, "lose", journal_path, fake_time, "/tickets")
    assert isinstance(answer, httpx.Response)
    assert methods(transport) == ["POST", "GET"]
    assert server.calls["tickets"] == 1
    assert answer.status_code == 201
    assert answer.headers["idempotent-replayed"] == "true"
    assert answer.json() == {"id": 1, **TICKET}
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert entry.response is not None
    assert entry.response.json() == answer.json()


async def test_a_lost_attempt_the_server_never_saw_is_sent_again(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport, answer, _ = await sent_once(server, "vanish", journal_path, fake_time, "/tickets")
    assert isinstance(answer, httpx.Response)
    assert methods(transport) == ["POST", "GET", "POST"]
    assert answer.status_code == 201
    assert "idempotent-replayed" not in answer.headers
    assert server.calls["tickets"] == 1
    # Every attempt says when the operation was first sent, the same each time.
    first_sent = {r.headers["repeatability-first-sent"] for r in transport.requests[::2]}
    assert len(first_sent) == 1
    assert abs(cast(float, parse_http_date(first_sent.pop())) - time.time()) < 60


async def test_a_lookup_that_finds_an_effect_without_an_answer_settles_it(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport, answer, entry = await sent_once(server, "lose", journal_path, fake_time, "/big")
    assert isinstance(answer, ResponseNotReplayable)
    assert "took effect" in str(answer)
    assert methods(transport) == ["POST", "GET"]
    assert server.calls["big"] == 1
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert (LOOKED_UP_HEADER, "completed") in entry.response_headers


async def test_a_retry_the_server_cannot_tell_from_a_new_request_is_not_run(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    """Journaled as sent an hour ago (within the client's retention, not the server's), its key
    unknown to the server: the server refuses it (412), and the client asks a person instead of
    sending it again."""
    client = make_client(Faulty(server.app), journal_path, fake_time)
    try:
        op = await client.operation("create-ticket")
        entry = client.protocol.prepare(op, "POST", "/tickets", {"json": TICKET}, False)
        client.journal.save(
            replace(entry, state=OperationState.UNKNOWN, first_sent_at=time.time() - 3600)
        )
        [settled] = await client.reconcile()
        with pytest.raises(NeedsConfirmation, match="no longer keeps its key"):
            await client.send(op, "POST", "/tickets", json=TICKET)
    finally:
        await close(client)
    assert server.calls["tickets"] == 0
    assert settled.state is OperationState.NEEDS_CONFIRMATION


async def test_retries_that_would_outlast_the_servers_retention_are_reported(
    journal_path: Path, fake_time: FakeTime
) -> None:
    kept_until = time.time() + 2
    transport, _ = scripted(
        problem(
            409, "in-progress", **{"retry-after": "1", KEY_EXPIRES_HEADER: http_date(kept_until)}
        )
    )
    events: list[ClientEvent] = []
    journaled: list[JournalEntry | None] = []

    def on_event(event: ClientEvent) -> None:
        events.append(event)
        if event.outlasts_retention:
            journaled.append(client.journal.get(op.key))

    client = make_client(transport, journal_path, fake_time, on_event=on_event)
    try:
        op = await client.operation("create-ticket")
        await client.send(op, "POST", "/tickets", json=TICKET)
    finally:
        await close(client)
    [warning] = [event for event in events if event.outlasts_retention]
    assert warning.kept_until == float(int(kept_until))
    assert warning.state is warning.previous is OperationState.UNKNOWN
    [entry] = journaled
    assert entry is not None
    assert entry.key_expires_at == float(int(kept_until))


def test_client_options_are_checked(journal_path: Path, fake_time: FakeTime) -> None:
    from idempotency_mw import ConfigurationError

    transport, _ = scripted()
    for options in ({"lookup_path": "idempotency-keys"}, {"first_sent_header": "a b"}):
        with pytest.raises(ConfigurationError):
            make_client(transport, journal_path, fake_time, **cast(dict[str, Any], options))
