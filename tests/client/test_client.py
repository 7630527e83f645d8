"""The caller's half: IdempotentClient against the real middleware, SyncIdempotentClient on fakes.

Faults are injected by transports wrapped around the app: a request dropped before the server
saw it, a response lost after the server acted, a response lost while the handler still runs,
a caller that crashes mid-request. Time is fake: the clients get an injected clock and sleep.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from idempotency_mw import ConfigurationError, IdempotencyError, SQLStore
from idempotency_mw.client import (
    IdempotencyKeyMismatch,
    IdempotentClient,
    JournalEntry,
    OperationError,
    OperationState,
    OutcomeUnknown,
    ResponseNotReplayable,
    RetryPolicy,
    SQLiteJournal,
    SQLJournal,
    SyncIdempotentClient,
    Verdict,
    classify,
    retry_after,
)
from idempotency_mw.values.exceptions import StoreError
from idempotency_mw.values.records import Claim
from tests.support.client_support import (
    BASE_URL,
    NO_JITTER,
    SERVER_RETRY_AFTER,
    Crash,
    FakeTime,
    Faulty,
    Server,
    close,
    make_client,
    problem,
    scripted,
)

# --- Key reuse and the journal against the real middleware -----------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["lose", "drop"])
async def test_lost_attempt_is_retried_with_the_same_key(
    server: Server, journal_path: Path, fake_time: FakeTime, fault: str
) -> None:
    transport = Faulty(server.app, [fault])
    client = make_client(transport, journal_path, fake_time)
    try:
        op = await client.operation("create-ticket")
        response = await client.send(op, "POST", "/tickets", json={"title": "printer on fire"})
    finally:
        await close(client)
    assert response.status_code == 201
    assert response.json() == {"id": 1, "title": "printer on fire"}
    # After "lose" the server had acted: the retry got its recorded response.
    assert response.headers.get("idempotent-replayed") == ("true" if fault == "lose" else None)
    assert server.calls["tickets"] == 1
    assert transport.keys == [op.key, op.key]
    with SQLiteJournal(journal_path) as journal:
        entry = journal.get(op.key)
    assert entry is not None
    assert (entry.state, entry.status) == (OperationState.CONFIRMED, 201)


@pytest.mark.anyio
async def test_in_progress_is_retried_after_the_servers_retry_after(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport = Faulty(server.app, ["detach"])
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if seconds > 0:  # the wait the server asked for: let the first run finish meanwhile
            server.opened.set()
            await transport.detached_done.wait()

    client = IdempotentClient(
        http=httpx.AsyncClient(transport=transport, base_url=BASE_URL),
        journal=journal_path,
        policy=NO_JITTER,
        sleep=sleep,
        clock=fake_time.clock,
    )
    try:
        async with anyio.create_task_group() as task_group:
            transport.task_group = task_group
            transport.handler_entered = server.entered
            response = await client.post("/held", json={}, operation="hold")
    finally:
        await close(client)
    # timeout → retry at once (no jitter) → 409 in progress, Retry-After 7 → replay
    assert sleeps == [0.0, float(SERVER_RETRY_AFTER)]
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert server.calls["held"] == 1
    assert len(set(transport.keys)) == 1


class FlakyStore(SQLStore):
    """A SQLStore whose first claim fails, as an unreachable database would."""

    failures = 1

    async def claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        binding: str = "",
        durable: bool = True,
        first_sent: float | None = None,
    ) -> Claim:
        if self.failures:
            self.failures -= 1
            raise StoreError("database unreachable")
        return await super().claim(
            scope,
            key,
            fingerprint,
            ttl=ttl,
            lease=lease,
            binding=binding,
            durable=durable,
            first_sent=first_sent,
        )


@pytest.mark.anyio
async def test_store_unavailable_503_is_retried_after_retry_after(
    sqlite_store: SQLStore, journal_path: Path, fake_time: FakeTime, tmp_path: Path
) -> None:
    server = Server(FlakyStore(f"sqlite:///{tmp_path / 'idem.db'}"))
    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        response = await client.post("/tickets", json={"title": "t"}, operation="create-ticket")
    finally:
        await close(client)
    assert response.status_code == 201
    assert fake_time.sleeps == [float(SERVER_RETRY_AFTER)]
    assert server.calls["tickets"] == 1
    assert len(transport.requests) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("mismatch_status", [409, 422])
async def test_same_key_different_request_raises_mismatch(
    sqlite_store: SQLStore, journal_path: Path, fake_time: FakeTime, mismatch_status: int
) -> None:
    server = Server(sqlite_store, mismatch_status=mismatch_status)
    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        op = await client.operation("create-ticket")
        # Another caller used the key first, with another request.
        first = await client.http.post(
            "/tickets", json={"title": "a"}, headers={"Idempotency-Key": op.key}
        )
        with pytest.raises(IdempotencyKeyMismatch) as caught:
            await client.send(op, "POST", "/tickets", json={"title": "b"})
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert first.status_code == 201
    assert caught.value.key == op.key
    assert caught.value.response is not None
    assert caught.value.response.status_code == mismatch_status
    assert entry is not None
    assert entry.state is OperationState.FAILED
    assert server.calls["tickets"] == 1
    assert fake_time.sleeps == []


@pytest.mark.anyio
async def test_a_settled_operation_is_answered_from_the_journal_not_sent_again(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        op = await client.operation("create-ticket", ref="order-17")
        first = await client.send(op, "POST", "/tickets", json={"title": "a"})
        again = await client.send(op, "POST", "/tickets", json={"title": "a"})
        with pytest.raises(IdempotencyKeyMismatch, match="journal holds a different request"):
            await client.send(op, "POST", "/tickets", json={"title": "b"})
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert (again.status_code, again.json()) == (first.status_code, first.json())
    assert again.headers["content-type"] == "application/json"
    assert len(transport.requests) == 1
    assert server.calls["tickets"] == 1
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED


@pytest.mark.anyio
async def test_unreplayable_response_raises_and_is_confirmed(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    client = make_client(Faulty(server.app, ["lose"]), journal_path, fake_time)
    try:
        op = await client.operation("export")
        with pytest.raises(ResponseNotReplayable) as caught:
            await client.send(op, "POST", "/big", content=b"go")
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert caught.value.key == op.key
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert server.calls["big"] == 1


@pytest.mark.anyio
async def test_other_4xx_is_returned_not_retried_and_failed(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        op = await client.operation("invalid")
        response = await client.send(op, "POST", "/invalid", json={})
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert response.status_code == 400
    assert len(transport.requests) == 1
    assert entry is not None
    assert (entry.state, entry.status) == (OperationState.FAILED, 400)


class RecordingJournal(SQLiteJournal):
    """A SQLiteJournal that remembers every state it was asked to record."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.states: list[OperationState] = []

    def add(self, entry: JournalEntry) -> JournalEntry:
        self.states.append(entry.state)
        return super().add(entry)

    def save(self, entry: JournalEntry) -> None:
        self.states.append(entry.state)
        super().save(entry)


@pytest.mark.anyio
async def test_journal_records_every_state_transition(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    with RecordingJournal(journal_path) as journal:
        client = make_client(Faulty(server.app, ["lose"]), journal, fake_time)
        try:
            op = await client.operation("create-ticket", ref="order-17")
            assert journal.get(op.key) == JournalEntry(
                op.key, "create-ticket", "order-17", OperationState.PENDING
            )
            await client.send(op, "POST", "/tickets", json={"title": "t"}, headers={"X-Trace": "1"})
        finally:
            await close(client)
        entry = journal.get(op.key)
    assert journal.states == ["pending", "sent", "unknown", "confirmed"]
    assert entry is not None
    assert entry.method == "POST"
    assert entry.url == f"{BASE_URL}/tickets"
    assert dict(entry.headers) == {"x-trace": "1", "content-type": "application/json"}
    assert json.loads(entry.body) == {"title": "t"}


# --- Restarts and reconcile() ---------------------------------------------------------------


@pytest.mark.anyio
async def test_restart_resumes_the_key_and_reconcile_settles_an_unknown_operation(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    lossy = Faulty(server.app, default="lose")
    before = make_client(lossy, journal_path, fake_time, RetryPolicy(max_attempts=2))
    try:
        op = await before.operation("create-ticket", ref="ticket-for-order-17")
        with pytest.raises(OutcomeUnknown) as caught:
            await before.send(op, "POST", "/tickets", json={"title": "t"})
    finally:
        await close(before)
    assert caught.value.key == op.key
    assert caught.value.attempts == 2
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)

    healthy = Faulty(server.app)
    after = make_client(healthy, journal_path, fake_time)  # a new process, the same journal
    try:
        resumed = await after.operation("create-ticket", ref="ticket-for-order-17")
        other = await after.operation("create-ticket", ref="ticket-for-order-18")
        assert after.journal.get(op.key) is not None
        unknown = after.journal.get(op.key)
        settled = await after.reconcile()
        again = await after.reconcile()
    finally:
        await close(after)
    assert resumed == op
    assert other.key != op.key
    assert unknown is not None
    assert unknown.state is OperationState.UNKNOWN
    assert [(e.key, e.state, e.status) for e in settled] == [
        (op.key, OperationState.CONFIRMED, 201)
    ]
    assert again == []  # settled, and "other" has no request to send
    assert server.calls["tickets"] == 1
    assert set(lossy.keys + healthy.keys) == {op.key}


@pytest.mark.anyio
async def test_reconcile_settles_an_operation_whose_caller_crashed_mid_request(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    crashing = make_client(Faulty(server.app, ["crash"]), journal_path, fake_time)
    try:
        op = await crashing.operation("create-ticket")
        with pytest.raises(Crash):
            await crashing.send(op, "POST", "/tickets", json={"title": "t"})
        crashed = crashing.journal.get(op.key)
    finally:
        await close(crashing)
    assert crashed is not None
    assert crashed.state is OperationState.SENT

    transport = Faulty(server.app)
    client = make_client(transport, journal_path, fake_time)
    try:
        [settled] = await client.reconcile()
    finally:
        await close(client)
    assert (settled.key, settled.state) == (op.key, OperationState.CONFIRMED)
    assert transport.keys == [op.key]
    assert server.calls["tickets"] == 1


# --- Deadline, attempts, timeouts -------------------------------------------------------------


@pytest.mark.anyio
async def test_deadline_gives_outcome_unknown_with_timeouts_capped(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    # Each attempt "takes" 2 s and times out; 5 s of deadline leave room for 3 attempts.
    transport = Faulty(server.app, default="lose", time=fake_time, tick=2.0)
    policy = RetryPolicy(max_attempts=100, backoff_base=0.0, deadline=5.0, read_timeout=30.0)
    client = make_client(transport, journal_path, fake_time, policy)
    try:
        op = await client.operation("create-ticket")
        with pytest.raises(OutcomeUnknown) as caught:
            await client.send(op, "POST", "/tickets", json={"title": "t"})
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert caught.value.key == op.key
    assert caught.value.attempts == 3
    assert [r.extensions["timeout"]["read"] for r in transport.requests] == [5.0, 3.0, 1.0]
    assert entry is not None
    assert entry.state is OperationState.UNKNOWN  # never "failed" on a timeout
    assert server.calls["tickets"] == 1


@pytest.mark.anyio
async def test_retry_after_beyond_the_deadline_gives_up_without_waiting(
    fake_time: FakeTime,
) -> None:
    transport, keys = scripted(httpx.Response(503, headers={"Retry-After": "120"}))
    client = make_client(transport, ":memory:", fake_time, RetryPolicy(deadline=60.0))
    try:
        with pytest.raises(OutcomeUnknown) as caught:
            await client.post("/tickets", json={}, operation="create-ticket")
    finally:
        await close(client)
    assert fake_time.sleeps == []
    assert len(keys) == 1
    assert caught.value.response is not None
    assert caught.value.response.status_code == 503


@pytest.mark.anyio
async def test_max_attempts_gives_outcome_unknown(fake_time: FakeTime) -> None:
    transport, keys = scripted(*[httpx.Response(500)] * 5)
    policy = RetryPolicy(max_attempts=3, backoff_base=1.0, backoff_cap=1.5)
    client = make_client(transport, ":memory:", fake_time, policy, rng=random.Random(7))
    try:
        with pytest.raises(OutcomeUnknown, match=r"after 3 attempt\(s\), last: HTTP 500"):
            await client.post("/tickets", json={}, operation="create-ticket")
    finally:
        await close(client)
    assert len(keys) == 3
    assert len(set(keys)) == 1
    assert len(fake_time.sleeps) == 2
    assert 0 <= fake_time.sleeps[0] <= 1.0
    assert 0 <= fake_time.sleeps[1] <= 1.5


def test_backoff_is_full_jitter_capped() -> None:
    policy = RetryPolicy(backoff_base=0.5, backoff_cap=4.0)
    rng = random.Random(1)
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 4.0), (500, 4.0)]:
        waits = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= wait <= ceiling for wait in waits)
        assert max(waits) > ceiling * 0.8  # spread over the whole range, not a fixed step
    assert all(policy.backoff(5, rng, limit=0.1) <= 0.1 for _ in range(50))


def test_attempt_timeouts_are_separate_and_capped_by_the_remaining_time() -> None:
    policy = RetryPolicy(connect_timeout=2.0, read_timeout=9.0)
    assert policy.timeout(60.0) == httpx.Timeout(connect=2.0, read=9.0, write=9.0, pool=2.0)
    assert policy.timeout(1.5) == httpx.Timeout(connect=1.5, read=1.5, write=1.5, pool=1.5)


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"deadline": 0},
        {"connect_timeout": -1},
        {"backoff_base": -1},
        {"read_timeout": float("nan")},
    ],
)
def test_invalid_policy_is_a_configuration_error(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**options)


# --- Classification ---------------------------------------------------------------------------


def app_problem(status: int, kind: str) -> httpx.Response:
    return httpx.Response(
        status, headers={"content-type": "application/problem+json"}, json={"type": kind}
    )


REQUEST = httpx.Request("POST", "http://testserver/x")

CLASSIFICATION: list[tuple[httpx.Response | Exception, Verdict]] = [
    (httpx.Response(200), Verdict.SUCCEEDED),
    (httpx.Response(201), Verdict.SUCCEEDED),
    (httpx.Response(204), Verdict.SUCCEEDED),
    (httpx.Response(302), Verdict.SUCCEEDED),
    (httpx.Response(400), Verdict.REJECTED),
    (httpx.Response(404), Verdict.REJECTED),
    (httpx.Response(409, json={"error": "duplicate title"}), Verdict.REJECTED),
    (httpx.Response(422, json={"detail": "invalid"}), Verdict.REJECTED),
    (problem(400, "missing-key"), Verdict.REJECTED),
    (problem(413, "request-too-large"), Verdict.REJECTED),
    (httpx.Response(408), Verdict.RETRY),
    (httpx.Response(425), Verdict.RETRY),
    (httpx.Response(429, headers={"retry-after": "2"}), Verdict.RETRY),
    (problem(409, "in-progress", **{"retry-after": "1"}), Verdict.RETRY),
    (httpx.Response(500), Verdict.RETRY),
    (httpx.Response(502), Verdict.RETRY),
    (problem(503, "store-unavailable", **{"retry-after": "1"}), Verdict.RETRY),
    (httpx.Response(504), Verdict.RETRY),
    (problem(409, "mismatch"), Verdict.MISMATCH),
    (problem(422, "mismatch"), Verdict.MISMATCH),
    (problem(409, "not-replayable"), Verdict.NOT_REPLAYABLE),
    (problem(409, "committed-without-response"), Verdict.NOT_REPLAYABLE),
    (httpx.Response(501), Verdict.REJECTED),
    (httpx.Response(505), Verdict.REJECTED),
    # An application's own problems are plain 4xx, whatever their type ends with.
    (app_problem(422, "https://shop.example/problems/currency-mismatch"), Verdict.REJECTED),
    (app_problem(409, "https://shop.example/problems/in-progress"), Verdict.REJECTED),
    (app_problem(409, "urn:idempotency-mw:problem:mismatch-of-sorts"), Verdict.REJECTED),
    (httpx.ConnectTimeout("t", request=REQUEST), Verdict.NOT_SENT),
    (httpx.ReadTimeout("t", request=REQUEST), Verdict.RETRY),
    (httpx.WriteTimeout("t", request=REQUEST), Verdict.RETRY),
    (httpx.PoolTimeout("t", request=REQUEST), Verdict.NOT_SENT),
    (httpx.ConnectError("refused", request=REQUEST), Verdict.NOT_SENT),
    (httpx.ReadError("reset by peer", request=REQUEST), Verdict.RETRY),
    (httpx.RemoteProtocolError("server disconnected", request=REQUEST), Verdict.RETRY),
    (httpx.UnsupportedProtocol("ftp://", request=REQUEST), Verdict.UNSENDABLE),
    (httpx.LocalProtocolError("bad header", request=REQUEST), Verdict.UNSENDABLE),
    (ValueError("a bug"), Verdict.RAISE),
]


def describe(outcome: httpx.Response | Exception) -> str:
    if isinstance(outcome, Exception):
        return type(outcome).__name__
    slug = outcome.headers.get("content-type", "").endswith("problem+json")
    return f"{outcome.status_code}{'-' + outcome.json()['type'] if slug else ''}"


@pytest.mark.parametrize(
    ("outcome", "verdict"), CLASSIFICATION, ids=[describe(o) for o, _ in CLASSIFICATION]
)
def test_classification_table(outcome: httpx.Response | Exception, verdict: Verdict) -> None:
    assert classify(outcome) is verdict


#: What a client does with each verdict: retry, return the response (final) or raise.
EXPECTED: dict[Verdict, tuple[str, OperationState] | type[BaseException]] = {
    Verdict.SUCCEEDED: ("final", OperationState.CONFIRMED),
    Verdict.REJECTED: ("final", OperationState.FAILED),
    Verdict.RETRY: ("retry", OperationState.CONFIRMED),
    Verdict.NOT_SENT: ("retry", OperationState.CONFIRMED),
    Verdict.MISMATCH: IdempotencyKeyMismatch,
    Verdict.NOT_REPLAYABLE: ResponseNotReplayable,
    Verdict.UNSENDABLE: httpx.TransportError,
    Verdict.RAISE: ValueError,
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("outcome", "verdict"), CLASSIFICATION, ids=[describe(o) for o, _ in CLASSIFICATION]
)
async def test_client_acts_on_the_classification(
    outcome: httpx.Response | Exception, verdict: Verdict, fake_time: FakeTime
) -> None:
    transport, keys = scripted(outcome)
    client = make_client(transport, ":memory:", fake_time)
    try:
        op = await client.operation("op")
        expected = EXPECTED[verdict]
        if isinstance(expected, tuple):
            response = await client.send(op, "POST", "/x", json={})
            kind, state = expected
            assert len(keys) == (2 if kind == "retry" else 1)
            if kind == "final":
                assert isinstance(outcome, httpx.Response)
                assert response.status_code == outcome.status_code
        else:
            with pytest.raises(expected):
                await client.send(op, "POST", "/x", json={})
            assert len(keys) == 1
            state = {
                Verdict.MISMATCH: OperationState.FAILED,
                Verdict.NOT_REPLAYABLE: OperationState.CONFIRMED,
                Verdict.UNSENDABLE: OperationState.FAILED,
                Verdict.RAISE: OperationState.SENT,  # unclassified error: left for reconcile()
            }[verdict]
        entry = client.journal.get(op.key)
    finally:
        await close(client)
    assert entry is not None
    assert entry.state is state
    assert set(keys) == {op.key}
    # Retry-After is used as given; other retries wait a jittered 0 (no jitter here).
    hint = retry_after(outcome) if isinstance(outcome, httpx.Response) else None
    retried = verdict in (Verdict.RETRY, Verdict.NOT_SENT)
    assert fake_time.sleeps == ([hint or 0.0] if retried else [])


@pytest.mark.parametrize(
    ("value", "seconds"), [("3", 3.0), (" 0 ", 0.0), ("1.5", None), ("-1", None), ("", None)]
)
def test_retry_after_takes_delay_seconds_only(value: str, seconds: float | None) -> None:
    response = httpx.Response(503, headers={"retry-after": value} if value else {})
    assert retry_after(response) == seconds
    dated = httpx.Response(503, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert retry_after(dated) is None


# --- Keys -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_keys_are_readable_unique_and_resumed_by_ref(fake_time: FakeTime) -> None:
    transport, _ = scripted()
    client = make_client(transport, ":memory:", fake_time, key_prefix="agent", session_id="7f3a")
    try:
        ops = [await client.operation("create-ticket") for _ in range(50)]
        first = await client.operation("close-ticket", ref="order-17")
        same = await client.operation("close-ticket", ref="order-17")
        other_name = await client.operation("reopen-ticket", ref="order-17")
    finally:
        await close(client)
    assert re.fullmatch(r"agent-7f3a:create-ticket:000001:[0-9a-f]{16}", ops[0].key)
    assert ops[1].key.startswith("agent-7f3a:create-ticket:000002:")
    assert len({op.key for op in ops}) == 50
    assert same == first
    assert other_name.key != first.key


@pytest.mark.anyio
async def test_header_name_is_configurable(fake_time: FakeTime) -> None:
    seen: list[httpx.Headers] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(201)

    client = make_client(
        httpx.MockTransport(handle), ":memory:", fake_time, header_name="X-Request-Key"
    )
    try:
        op = await client.operation("create-ticket")
        await client.send(op, "POST", "/tickets", content=b"{}", headers={"X-Request-Key": "x"})
    finally:
        await close(client)
    assert seen[0].get_list("x-request-key") == [op.key]
    assert "idempotency-key" not in seen[0]


@pytest.mark.parametrize(
    "options",
    [
        {"key_prefix": "a:b"},
        {"session_id": "has space"},
        {"session_id": ""},
        {"header_name": ""},
        {"header_name": "Idempotency:Key"},
    ],
)
def test_invalid_key_parts_are_configuration_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        SyncIdempotentClient(journal=":memory:", **options)


def test_operation_names_must_fit_in_a_key() -> None:
    with SyncIdempotentClient(journal=":memory:") as client, pytest.raises(ConfigurationError):
        client.operation("create:ticket")


def test_errors_are_idempotency_errors() -> None:
    for error in (IdempotencyKeyMismatch, ResponseNotReplayable, OutcomeUnknown):
        assert issubclass(error, OperationError)
        assert issubclass(error, IdempotencyError)


# --- The sync client --------------------------------------------------------------------------


class FakeIdempotentServer:
    """A handler that runs each key once and replays it after, as the middleware does.

    The first ``lose`` responses are lost to read timeouts after the handler ran.
    """

    def __init__(self, lose: int = 0) -> None:
        self.runs = 0
        self.lose = lose
        self.keys: list[str] = []
        self.records: dict[str, tuple[bytes, httpx.Response]] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["idempotency-key"]
        self.keys.append(key)
        if key in self.records:
            body, recorded = self.records[key]
            if body != request.content:
                return problem(409, "mismatch")
            response = httpx.Response(
                recorded.status_code,
                content=recorded.content,
                headers={**recorded.headers, "idempotent-replayed": "true"},
            )
        else:
            self.runs += 1
            response = httpx.Response(201, json={"run": self.runs})
            self.records[key] = (request.content, response)
        if self.lose:
            self.lose -= 1
            raise httpx.ReadTimeout("read timed out", request=request)
        return response


def sync_client(
    handler: Callable[[httpx.Request], httpx.Response],
    journal: Any,
    fake_time: FakeTime,
    policy: RetryPolicy = NO_JITTER,
) -> SyncIdempotentClient:
    return SyncIdempotentClient(
        http=httpx.Client(transport=httpx.MockTransport(handler), base_url=BASE_URL),
        journal=journal,
        policy=policy,
        sleep=fake_time.sleep_sync,
        clock=fake_time.clock,
    )


def test_sync_client_retries_a_timeout_with_the_same_key(fake_time: FakeTime) -> None:
    server = FakeIdempotentServer(lose=2)
    with sync_client(server, ":memory:", fake_time) as client:
        op = client.operation("create-ticket")
        response = client.send(op, "POST", "/tickets", json={"title": "t"})
        entry = client.journal.get(op.key)
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert server.runs == 1
    assert server.keys == [op.key] * 3
    assert fake_time.sleeps == [0.0, 0.0]
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED


def test_sync_client_raises_mismatch(fake_time: FakeTime) -> None:
    server = FakeIdempotentServer()
    with sync_client(server, ":memory:", fake_time) as client:
        op = client.operation("create-ticket")
        client.send(op, "POST", "/tickets", json={"title": "a"})
        with pytest.raises(IdempotencyKeyMismatch):
            client.send(op, "POST", "/tickets", json={"title": "b"})
    assert server.runs == 1


def test_sync_client_deadline_then_restart_and_reconcile(
    fake_time: FakeTime, journal_path: Path
) -> None:
    server = FakeIdempotentServer(lose=100)

    def slow(request: httpx.Request) -> httpx.Response:
        fake_time.now += 4.0  # each attempt takes 4 s, then its response is lost
        return server(request)

    policy = RetryPolicy(max_attempts=100, backoff_base=0.0, deadline=30.0)
    with sync_client(slow, journal_path, fake_time, policy) as client:
        with pytest.raises(OutcomeUnknown) as caught:
            client.post("/tickets", json={"title": "t"}, operation="create-ticket", ref="o-1")
        key = caught.value.key
        entry = client.journal.get(key)
    assert caught.value.attempts == 8  # started at 0, 4, ..., 28 s
    assert entry is not None
    assert entry.state is OperationState.UNKNOWN

    server.lose = 0
    with sync_client(server, journal_path, fake_time) as client:
        assert client.operation("create-ticket", ref="o-1").key == key
        [settled] = client.reconcile()
        assert client.reconcile() == []
    assert (settled.key, settled.state, settled.status) == (key, OperationState.CONFIRMED, 201)
    assert server.runs == 1
    assert set(server.keys) == {key}


def test_the_client_extra_pulls_httpx_anyio_and_the_journals_sql() -> None:
    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> list[str]:
        return [re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras[extra]]

    assert names("client") == ["idempotency-mw", "httpx", "anyio"]
    assert extras["client"][0] == "idempotency-mw[sql]"
    assert names("client-postgresql") == ["idempotency-mw", "psycopg"]
    assert names("client-mysql") == ["idempotency-mw", "pymysql"]


def test_the_client_extra_is_enough_for_the_default_client(tmp_path: Path) -> None:
    # What [client] installs (SQLAlchemy, httpx, anyio) and nothing else: redis-py is blocked.
    program = (
        "import sys\n"
        "sys.modules['redis'] = None\n"
        "from idempotency_mw.client import IdempotentClient, SyncIdempotentClient\n"
        f"SyncIdempotentClient(base_url='http://x', journal={str(tmp_path / 'j.db')!r}).close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_a_journal_given_as_a_url_is_that_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    with SyncIdempotentClient(base_url="http://x", journal=url) as client:
        operation = client.operation("create-ticket", ref="order-17")
    journal = SQLJournal(url)
    try:
        assert journal.get(operation.key) is not None
    finally:
        journal.close()
