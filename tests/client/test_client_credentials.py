"""A key whose record belongs to other credentials (the server's 409 ``credential-mismatch``)
is a bug of the caller: the client raises IdempotencyCredentialMismatch, against the real
middleware; and the server's ``retry-after-ms`` wins over its ``Retry-After``."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import httpx
import pytest

from idempotency_mw import SQLStore
from idempotency_mw.client import (
    IdempotencyCredentialMismatch,
    IdempotentClient,
    OperationError,
    OperationState,
    retry_after,
)
from tests.support.client_support import (
    BASE_URL,
    NO_JITTER,
    FakeTime,
    Faulty,
    Server,
    make_client,
    problem,
    scripted,
)

pytestmark = pytest.mark.anyio


class Rotating(httpx.Auth):
    """Bearer tokens in turn, one per request, the last one from then on (a refreshed token)."""

    def __init__(self, *tokens: str) -> None:
        self.tokens = list(tokens)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.tokens.pop(0) if len(self.tokens) > 1 else self.tokens[0]
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


def authed_client(
    transport: httpx.AsyncBaseTransport, auth: httpx.Auth, journal: Path, fake_time: FakeTime
) -> IdempotentClient:
    return IdempotentClient(
        http=httpx.AsyncClient(transport=transport, base_url=BASE_URL, auth=auth),
        journal=journal,
        policy=NO_JITTER,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
    )


async def test_credentials_changed_under_a_key_raise_and_need_a_person(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport = Faulty(server.app, ["lose"])  # the first attempt runs, its answer is lost
    async with authed_client(transport, Rotating("old", "new"), journal_path, fake_time) as client:
        op = await client.operation("create-ticket")
        with pytest.raises(IdempotencyCredentialMismatch) as caught:
            await client.send(op, "POST", "/tickets", json={"title": "t"})
        entry = client.journal.get(op.key)
        attention = await client.attention()
        await client.http.aclose()
    assert isinstance(caught.value, OperationError)
    assert caught.value.key == op.key
    assert caught.value.response is not None
    assert caught.value.response.status_code == 409
    assert "credentials" in str(caught.value)
    # The first attempt, under the old token, took effect: not a plain failure.
    assert entry is not None
    assert entry.state is OperationState.NEEDS_INTERVENTION
    assert [e.key for e in attention] == [op.key]
    assert server.calls["tickets"] == 1
    assert len(transport.requests) == 2

    # Sent again with the first request's credentials, it is answered from the server's record.
    again = Faulty(server.app)
    async with authed_client(again, Rotating("old"), journal_path, fake_time) as client:
        response = await client.send(op, "POST", "/tickets", json={"title": "t"})
        settled = client.journal.get(op.key)
        await client.http.aclose()
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert settled is not None
    assert settled.state is OperationState.CONFIRMED
    assert server.calls["tickets"] == 1


async def test_a_key_another_caller_used_first_fails_without_retrying(
    sqlite_store: SQLStore, journal_path: Path, fake_time: FakeTime
) -> None:
    server = Server(sqlite_store)
    transport = Faulty(server.app)
    async with authed_client(transport, Rotating("mine"), journal_path, fake_time) as client:
        op = await client.operation("create-ticket")
        other = await client.http.post(
            "/tickets",
            json={"title": "t"},
            headers={"Idempotency-Key": op.key},
            auth=Rotating("theirs"),
        )
        with pytest.raises(IdempotencyCredentialMismatch):
            await client.send(op, "POST", "/tickets", json={"title": "t"})
        entry = client.journal.get(op.key)
        # Settled in the journal: raised again without sending.
        with pytest.raises(IdempotencyCredentialMismatch):
            await client.send(op, "POST", "/tickets", json={"title": "t"})
        await client.http.aclose()
    assert other.status_code == 201
    assert entry is not None
    assert entry.state is OperationState.FAILED  # this caller's request never ran
    assert entry.status == 409
    assert len(transport.requests) == 2  # theirs and one of ours: a final answer, not retried
    assert fake_time.sleeps == []
    assert server.calls["tickets"] == 1


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after": "2", "retry-after-ms": "250"}, 0.25),
        ({"retry-after-ms": "1500.5"}, 1.5005),
        ({"retry-after": "2", "retry-after-ms": "soon"}, 2.0),
        ({"retry-after": "2", "retry-after-ms": "-5"}, 2.0),
        ({"retry-after-ms": "nan"}, None),
    ],
)
def test_retry_after_ms_is_more_precise_than_retry_after(
    headers: dict[str, str], seconds: float | None
) -> None:
    assert retry_after(httpx.Response(409, headers=headers)) == seconds


async def test_the_client_waits_what_retry_after_ms_says(
    journal_path: Path, fake_time: FakeTime
) -> None:
    busy = problem(409, "in-progress", **{"retry-after": "1", "retry-after-ms": "250"})
    transport, keys = scripted(busy)
    client = make_client(transport, journal_path, fake_time)
    async with client.http, client:
        response = await client.post("/x", json={}, operation="create-ticket")
    assert response.status_code == 201
    assert fake_time.sleeps == [0.25]
    assert len(keys) == 2


async def test_a_restarted_client_resends_with_its_own_auth(
    sqlite_store: SQLStore, journal_path: Path, fake_time: FakeTime
) -> None:
    server = Server(sqlite_store)
    lost = Faulty(server.app, ["lose", "lose", "lose", "lose", "lose", "lose"])
    plain = httpx.AsyncClient(transport=lost, base_url=BASE_URL)
    async with IdempotentClient(
        http=plain, journal=journal_path, sleep=fake_time.sleep, clock=fake_time.clock
    ) as client:
        op = await client.operation("create-ticket")
        with pytest.raises(OperationError):
            await client.send(
                op, "POST", "/tickets", json={"title": "t"}, headers={"Authorization": "Bearer t"}
            )
        await client.http.aclose()
    # A new process whose httpx client signs every request: it supplies the credential.
    again = Faulty(server.app)
    async with authed_client(again, Rotating("t"), journal_path, fake_time) as client:
        [settled] = await client.reconcile()
        await client.http.aclose()
    assert settled.state is OperationState.CONFIRMED
    assert [r.headers["authorization"] for r in again.requests] == ["Bearer t"]
    assert server.calls["tickets"] == 1
