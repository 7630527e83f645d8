"""The client reports each journaled change of an operation's state to ``on_event``: what an
alert needs (needs confirmation, needs intervention, resolved), counted by ClientMetrics in a
real prometheus_client registry."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from idempotency_mw.client import (
    ClientEvent,
    ClientMetrics,
    JournalEntry,
    NeedsConfirmation,
    OperationState,
)
from tests.support.client_support import FakeTime, Faulty, Server, close, make_client

pytestmark = pytest.mark.anyio

S = OperationState
TICKET = {"title": "printer on fire", "ref": "order-17"}


def transitions(events: list[ClientEvent]) -> list[tuple[S, S]]:
    return [(event.previous, event.state) for event in events]


async def find_ticket(http: httpx.AsyncClient, entry: JournalEntry) -> httpx.Response | None:
    found = await http.get("/tickets", params={"ref": entry.ref})
    return found if found.json() else None


async def test_an_operation_that_needs_confirmation_and_is_resolved_is_reported(
    server: Server, journal_path: Path, fake_time: FakeTime
) -> None:
    registry = CollectorRegistry()
    metrics = ClientMetrics(registry)
    events: list[ClientEvent] = []

    def hook(event: ClientEvent) -> None:
        events.append(event)
        metrics(event)

    client = make_client(
        Faulty(server.app, ["lose"]), journal_path, fake_time, keyless=True, on_event=hook
    )
    try:
        op = await client.operation("create-ticket", ref="order-17")
        with pytest.raises(NeedsConfirmation):
            await client.send(op, "POST", "/tickets", json=TICKET)
        await client.reconcile()  # still no probe: nothing changes, nothing is reported
    finally:
        await close(client)
    assert transitions(events) == [
        (S.PENDING, S.SENT),
        (S.SENT, S.UNKNOWN),
        (S.UNKNOWN, S.NEEDS_CONFIRMATION),
    ]
    alert = events[-1]
    assert alert.needs_attention
    assert not alert.resolved
    assert alert.name == "create-ticket"
    assert op.key not in repr(alert)  # a digest, never the key
    assert len(alert.key_digest) == 12

    events.clear()
    probed = make_client(
        Faulty(server.app),
        journal_path,
        fake_time,
        keyless=True,
        confirm={"create-ticket": find_ticket},
        on_event=hook,
    )
    try:
        await probed.reconcile()
    finally:
        await close(probed)
    assert transitions(events) == [(S.NEEDS_CONFIRMATION, S.CONFIRMED)]
    assert events[0].resolved
    assert server.calls["tickets"] == 1

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"idempotency_client_{name}_total", labels)

    needing = {"state": "needs_confirmation", "previous": "unknown", "operation": "create-ticket"}
    assert sample("transitions", **needing) == 1.0
    assert sample("transitions", state="sent", previous="pending", operation="create-ticket") == 1
    assert sample("resolved", state="confirmed", operation="create-ticket") == 1.0
    assert sample("resolved", state="failed", operation="create-ticket") is None


async def test_a_hook_that_raises_never_fails_an_operation(
    server: Server, journal_path: Path, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: ClientEvent) -> None:
        raise RuntimeError("metrics backend down")

    client = make_client(Faulty(server.app, ["lose"]), journal_path, fake_time, on_event=broken)
    try:
        with caplog.at_level(logging.ERROR):
            response = await client.post("/tickets", json=TICKET, operation="create-ticket")
    finally:
        await close(client)
    assert response.status_code == 201
    assert server.calls["tickets"] == 1
    failures = [r for r in caplog.records if "event hook" in r.getMessage()]
    assert len(failures) == 1  # the first failure is logged, the later ones dropped
