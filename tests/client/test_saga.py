"""Sagas against the example service's order routes: forward, compensated in reverse, resumed
after a crash, and handed to a person when a step stays unknown or a compensation keeps failing.

The service runs in process (``httpx.ASGITransport``; sockets do not matter here) with its
lifespan, on a SQLite file whose tables the tests read. Faults are planned per step by the
transport; time is fake.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from fastapi import FastAPI

from example_app.app import create_app
from example_app.demo import serve
from example_app.saga_demo import LARGE_CENTS, SMALL_CENTS, Order, order_saga
from idempotency_mw import ConfigurationError
from idempotency_mw.client import (
    AsyncAction,
    AsyncStepClient,
    ClientEvent,
    CredentialsMissing,
    IdempotencyCredentialMismatch,
    IdempotencyKeyMismatch,
    IdempotentClient,
    OperationState,
    RetryPolicy,
    Saga,
    SagaState,
    StepState,
    SyncAction,
    SyncIdempotentClient,
    SyncSaga,
    SyncStepClient,
)
from idempotency_mw.operator.cli import main as cli
from tests.support.client_support import Crash, FakeTime, problem

POLICY = RetryPolicy(max_attempts=3, backoff_base=1.0, backoff_cap=2.0, deadline=10.0)
STEPS = ("reserve", "charge", "confirm-email")


def step_of(request: httpx.Request) -> str:
    """Which step or compensation a request to the order routes is."""
    path = request.url.path
    for suffix, kind in (("/release", "release"), ("/refund", "refund")):
        if path.endswith(suffix):
            return kind
    return {"/inventory/reservations": "reserve", "/payments/charges": "charge"}.get(path, "email")


@dataclass
class Network(httpx.AsyncBaseTransport):
    """The service over ASGI. Per step, planned faults, then ``down`` ones for good: ``lose``
    (the service acts, the response is lost), ``refuse`` (nothing is sent), ``crash`` (the
    service acts, then the agent dies). ``sent`` lists the steps of the requests made."""

    app: FastAPI
    plan: dict[str, list[str]] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        kind = step_of(request)
        planned = self.plan.get(kind, [])
        fault = planned.pop(0) if planned else self.down.get(kind, "ok")
        if fault == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        self.sent.append(kind)
        response = await httpx.ASGITransport(app=self.app).handle_async_request(request)
        await response.aread()
        if fault == "lose":
            raise httpx.ReadTimeout("the response was lost", request=request)
        if fault == "crash":
            raise Crash
        return response


@dataclass
class Service:
    app: FastAPI
    database: Path

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.database)) as db:
            return db.execute(query).fetchall()

    def state(self, ref: str) -> dict[str, list[Any]]:
        """What the service holds for order ``ref``: statuses, releases, refunds, emails."""
        where = f"WHERE order_ref = '{ref}'"
        return {
            "reservations": [
                r for (r,) in self.rows(f"SELECT status FROM example_reservations {where}")
            ],
            "charges": [r for (r,) in self.rows(f"SELECT status FROM example_charges {where}")],
            "releases": self.rows("SELECT reservation_id FROM example_releases"),
            "refunds": self.rows("SELECT charge_id FROM example_refunds"),
            "emails": [
                r for (r,) in self.rows(f"SELECT recipient FROM example_order_emails {where}")
            ],
        }


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    database = tmp_path / "orders.db"
    app = create_app(f"sqlite:///{database}")
    async with app.router.lifespan_context(app):
        yield Service(app, database)


def agent(network: Network, journal_path: Path, fake_time: FakeTime) -> IdempotentClient:
    """A new agent process: a client on the shared journal."""
    return IdempotentClient(
        http=httpx.AsyncClient(transport=network, base_url="http://orders"),
        journal=journal_path,
        policy=POLICY,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
    )


def order(n: int = 1, *, bounces: bool = False, large: bool = False) -> Order:
    domain = "bounce.example" if bounces else "mail.example"
    return Order(f"ORD-{n}", LARGE_CENTS if large else SMALL_CENTS, f"c{n}@{domain}")


async def run(client: IdempotentClient, placed: Order) -> Any:
    async with client.http, client:
        return await order_saga(client, placed).run()


def states(outcome: Any) -> list[StepState]:
    return [step.state for step in outcome.steps]


# --- Forward and back -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_saga_completes_and_running_it_again_sends_nothing(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    network = Network(service.app)
    outcome = await run(agent(network, journal_path, fake_time), order())
    again = await run(agent(network, journal_path, fake_time), order())
    assert outcome.state is SagaState.COMPLETED
    assert states(outcome) == [StepState.COMPLETED] * 3
    assert outcome.step("charge").response.json()["status"] == "captured"
    assert states(again) == states(outcome)
    assert again.step("charge").response.json() == outcome.step("charge").response.json()
    assert network.sent == ["reserve", "charge", "email"]
    assert service.state("ORD-1") == {
        "reservations": ["reserved"],
        "charges": ["captured"],
        "releases": [],
        "refunds": [],
        "emails": ["c1@mail.example"],
    }


@pytest.mark.anyio
async def test_a_failed_step_compensates_the_steps_before_it_in_reverse_order(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    network = Network(service.app)
    outcome = await run(agent(network, journal_path, fake_time), order(bounces=True))
    again = await run(agent(network, journal_path, fake_time), order(bounces=True))
    assert outcome.state is SagaState.COMPENSATED
    assert states(outcome) == [StepState.COMPENSATED, StepState.COMPENSATED, StepState.FAILED]
    assert outcome.step("confirm-email").response.status_code == 422  # the service's own 422
    assert outcome.step("charge").compensation.json()["status"] == "refunded"
    assert states(again) == states(outcome)
    assert network.sent == ["reserve", "charge", "email", "refund", "release"]
    state = service.state("ORD-1")
    assert (state["reservations"], state["charges"], state["emails"]) == (
        ["released"],
        ["refunded"],
        [],
    )
    assert (len(state["releases"]), len(state["refunds"])) == (1, 1)


@pytest.mark.anyio
async def test_a_compensation_the_service_refuses_is_handed_to_a_person(
    service: Service, journal_path: Path, fake_time: FakeTime, capsys: pytest.CaptureFixture[str]
) -> None:
    network = Network(service.app)
    client = agent(network, journal_path, fake_time)
    async with client.http, client:
        outcome = await order_saga(client, order(bounces=True, large=True)).run()
        attention = await client.attention()
    assert outcome.state is SagaState.NEEDS_INTERVENTION
    assert states(outcome) == [
        StepState.COMPLETED,  # not released: the refund comes first and did not happen
        StepState.COMPENSATION_FAILED,
        StepState.FAILED,
    ]
    assert network.sent == ["reserve", "charge", "email", "refund"]
    assert [(e.name, e.ref, e.state, e.status) for e in attention] == [
        ("order.charge.undo", "ORD-1", OperationState.NEEDS_INTERVENTION, 422)
    ]
    assert service.state("ORD-1")["charges"] == ["captured"]

    assert cli(["journal", "attention", "--journal", str(journal_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["state", "name", "ref"]
    assert out[1].split()[:4] == ["needs_intervention", "order.charge.undo", "ORD-1", "422"]
    assert len(out) == 2


# --- Crashes, unknown steps, failing compensations -------------------------------------------


@pytest.mark.anyio
async def test_a_crash_mid_saga_resumes_where_it_stopped(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    crashing = Network(service.app, plan={"charge": ["crash"]})
    with pytest.raises(Crash):
        await run(agent(crashing, journal_path, fake_time), order())
    network = Network(service.app)
    outcome = await run(agent(network, journal_path, fake_time), order())
    assert outcome.state is SagaState.COMPLETED
    assert network.sent == ["charge", "email"]  # the reservation is not made again
    assert outcome.step("charge").response.headers["idempotent-replayed"] == "true"
    state = service.state("ORD-1")
    assert (state["reservations"], state["charges"]) == (["reserved"], ["captured"])


@pytest.mark.anyio
async def test_a_step_left_unknown_is_never_compensated_unconfirmed(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    lossy = Network(service.app, down={"charge": "lose"})
    client = agent(lossy, journal_path, fake_time)
    async with client.http, client:
        outcome = await order_saga(client, order()).run()
        attention = await client.attention()
    assert outcome.state is SagaState.NEEDS_INTERVENTION
    assert states(outcome) == [StepState.COMPLETED, StepState.UNKNOWN, StepState.NOT_RUN]
    assert "release" not in lossy.sent
    assert lossy.sent.count("charge") > POLICY.max_attempts  # settled again until the deadline
    assert fake_time.now - 1000.0 >= 15.0
    assert [(e.name, e.state) for e in attention] == [
        ("order.charge", OperationState.NEEDS_INTERVENTION)
    ]
    assert service.state("ORD-1")["charges"] == ["captured"]

    healed = Network(service.app)
    resumed = await run(agent(healed, journal_path, fake_time), order())
    assert resumed.state is SagaState.COMPLETED
    assert healed.sent == ["charge", "email"]
    assert service.state("ORD-1")["charges"] == ["captured"]


@pytest.mark.anyio
async def test_a_compensation_that_keeps_failing_is_retried_to_the_deadline_then_handed_over(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    network = Network(service.app, down={"refund": "refuse"})
    client = agent(network, journal_path, fake_time)
    async with client.http, client:
        outcome = await order_saga(client, order(bounces=True)).run()
        attention = await client.attention()
    assert outcome.state is SagaState.NEEDS_INTERVENTION
    assert outcome.step("charge").state is StepState.COMPENSATION_FAILED
    assert fake_time.now - 1000.0 >= 15.0
    assert any(wait > 0 for wait in fake_time.sleeps)
    assert [(e.name, e.state) for e in attention] == [
        ("order.charge.undo", OperationState.NEEDS_INTERVENTION)
    ]
    assert service.state("ORD-1")["refunds"] == []

    healed = Network(service.app)
    resumed = await run(agent(healed, journal_path, fake_time), order(bounces=True))
    assert resumed.state is SagaState.COMPENSATED
    assert healed.sent == ["refund", "release"]
    assert service.state("ORD-1")["charges"] == ["refunded"]


def scripted_client(
    handle: Callable[[httpx.Request], httpx.Response], fake_time: FakeTime
) -> IdempotentClient:
    """A client on a scripted service, with an in-memory journal and fake time."""
    return IdempotentClient(
        http=httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://x"),
        journal=":memory:",
        sleep=fake_time.sleep,
        clock=fake_time.clock,
    )


def post(path: str) -> AsyncAction:
    """A step that posts to ``path``."""

    async def action(step: AsyncStepClient) -> httpx.Response:
        return await step.post(path)

    return action


@pytest.mark.anyio
async def test_a_step_committed_without_response_has_taken_effect(fake_time: FakeTime) -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/charge":
            return problem(409, "committed-without-response")
        return httpx.Response(201, json={"ok": True})

    client = scripted_client(handle, fake_time)
    async with client.http, client:
        saga = Saga(client, "order", ref="ORD-9").step("reserve", post("/reserve"))
        saga.step("charge", post("/charge"))
        outcome = await saga.run()
    assert outcome.state is SagaState.COMPLETED
    charged = outcome.step("charge").response
    assert charged is not None
    assert charged.status_code == 409


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("slug", "error"),
    [("mismatch", IdempotencyKeyMismatch), ("credential-mismatch", IdempotencyCredentialMismatch)],
)
async def test_a_caller_bug_in_a_step_is_raised_not_compensated(
    fake_time: FakeTime, slug: str, error: type[Exception]
) -> None:
    sent: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        if request.url.path == "/charge":
            return problem(409, slug)
        return httpx.Response(201, json={"ok": True})

    async def release(step: AsyncStepClient, response: httpx.Response) -> httpx.Response:
        return await step.post("/release")

    client = scripted_client(handle, fake_time)
    async with client.http, client:
        saga = Saga(client, "order", ref="ORD-9").step(
            "reserve", post("/reserve"), compensate=release
        )
        saga.step("charge", post("/charge"))
        with pytest.raises(error):
            await saga.run()
    assert sent == ["/reserve", "/charge"]  # a bug to fix, not a failure to compensate


@pytest.mark.anyio
async def test_a_step_resumed_without_its_credentials_is_raised_not_compensated(
    fake_time: FakeTime, journal_path: Path
) -> None:
    sent: list[tuple[str, str | None]] = []
    lost = ["/charge"]  # the charge runs; its answer is lost, then the agent dies

    async def handle(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.headers.get("authorization")))
        if request.url.path in lost:
            lost.remove(request.url.path)
            raise Crash
        return httpx.Response(201, json={"ok": True})

    async def charge(step: AsyncStepClient) -> httpx.Response:
        return await step.post("/charge", headers={"Authorization": "Bearer per-call"})

    async def release(step: AsyncStepClient, response: httpx.Response) -> httpx.Response:
        return await step.post("/release")

    def saga_on(client: IdempotentClient) -> Saga:
        saga = Saga(client, "order", ref="ORD-9")
        saga.step("reserve", post("/reserve"), compensate=release)
        return saga.step("charge", charge)

    def agent() -> IdempotentClient:
        transport = httpx.MockTransport(handle)
        http = httpx.AsyncClient(transport=transport, base_url="http://x")
        return IdempotentClient(
            http=http, journal=journal_path, sleep=fake_time.sleep, clock=fake_time.clock
        )

    with pytest.raises(Crash):
        await run_saga(agent(), saga_on)
    with pytest.raises(CredentialsMissing) as missing:
        await run_saga(agent(), saga_on)
    assert missing.value.headers == ("authorization",)
    # Sent once with its credential; never again without it, and nothing compensated.
    assert sent == [("/reserve", None), ("/charge", "Bearer per-call")]


async def run_saga(client: IdempotentClient, saga_on: Callable[[IdempotentClient], Saga]) -> Any:
    async with client.http, client:
        return await saga_on(client).run()


# --- The sync twin, and bad definitions ----------------------------------------------------


@pytest.mark.anyio
async def test_a_sync_saga_completes_and_compensates(tmp_path: Path, journal_path: Path) -> None:
    def reserve(step: SyncStepClient) -> httpx.Response:
        body = {"order": step.ref, "sku": "a", "quantity": 1}
        return step.post("/inventory/reservations", json=body)

    def release(step: SyncStepClient, reserved: httpx.Response) -> httpx.Response:
        return step.post(f"/inventory/reservations/{reserved.json()['id']}/release")

    def email(to: str) -> SyncAction:
        def send(step: SyncStepClient) -> httpx.Response:
            return step.post("/emails", json={"order": step.ref, "recipient": to})

        return send

    def place(url: str) -> list[SagaState]:
        with SyncIdempotentClient(base_url=url, journal=journal_path) as client:
            return [
                SyncSaga(client, "order", ref=ref)
                .step("reserve", reserve, compensate=release)
                .step("confirm-email", email(to))
                .run()
                .state
                for ref, to in (("S-1", "a@mail.example"), ("S-2", "b@bounce.example"))
            ]

    service = Service(create_app(f"sqlite:///{tmp_path / 'orders.db'}"), tmp_path / "orders.db")
    async with serve(service.app) as port:  # the sync client needs a real server: a thread
        ended = await anyio.to_thread.run_sync(place, f"http://127.0.0.1:{port}")
    assert ended == [SagaState.COMPLETED, SagaState.COMPENSATED]
    assert service.state("S-2")["reservations"] == ["released"]


async def nothing(step: AsyncStepClient) -> httpx.Response:
    return await step.post("/x")


@pytest.mark.anyio
async def test_saga_definitions_are_checked() -> None:
    async with IdempotentClient(journal=":memory:") as client:
        with pytest.raises(ConfigurationError):
            Saga(client, "order.v2", ref="r")  # dots separate saga, step and compensation
        saga = Saga(client, "order", ref="r")
        with pytest.raises(ConfigurationError):
            saga.step("re.serve", nothing)
        with pytest.raises(ConfigurationError):
            saga.step("s" * 60, nothing)  # its operation name would not fit in a key
        with pytest.raises(ConfigurationError, match="no steps"):
            await saga.run()
        saga.step("reserve", nothing)
        with pytest.raises(ConfigurationError, match="has a step"):
            saga.step("reserve", nothing)


@pytest.mark.anyio
async def test_a_step_handed_to_a_person_is_reported_and_so_is_its_resolution(
    service: Service, journal_path: Path, fake_time: FakeTime
) -> None:
    events: list[ClientEvent] = []

    def client(network: Network) -> IdempotentClient:
        return IdempotentClient(
            http=httpx.AsyncClient(transport=network, base_url="http://orders"),
            journal=journal_path,
            policy=POLICY,
            sleep=fake_time.sleep,
            clock=fake_time.clock,
            on_event=events.append,
        )

    stuck = await run(client(Network(service.app, down={"charge": "lose"})), order())
    assert stuck.state is SagaState.NEEDS_INTERVENTION
    handed = [e for e in events if e.state is OperationState.NEEDS_INTERVENTION]
    assert [(e.name, e.previous) for e in handed] == [("order.charge", OperationState.UNKNOWN)]
    assert handed[0].needs_attention

    events.clear()
    resumed = await run(client(Network(service.app)), order())
    assert resumed.state is SagaState.COMPLETED
    resolved = [e for e in events if e.resolved]
    assert [(e.name, e.previous, e.state) for e in resolved] == [
        ("order.charge", OperationState.NEEDS_INTERVENTION, OperationState.CONFIRMED)
    ]
