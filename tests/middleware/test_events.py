"""The on_event hook: what the middleware reports, and that a failing hook harms nothing."""

from __future__ import annotations

import logging

import pytest

from idempotency_mw import SQLStore, Store
from idempotency_mw.values.metrics import Event, EventKind
from tests.support.apps import client_for, make_app

pytestmark = pytest.mark.anyio


async def test_events_of_a_first_run_a_replay_and_a_mismatch(store: Store) -> None:
    events: list[Event] = []
    app = make_app(store, on_event=events.append)
    async with client_for(app) as client:
        await client.post("/tickets", json={"a": 1}, headers={"Idempotency-Key": "secret-key"})
        await client.post("/tickets", json={"a": 1}, headers={"Idempotency-Key": "secret-key"})
        await client.post("/tickets", json={"a": 2}, headers={"Idempotency-Key": "secret-key"})
        await client.put("/optional", headers={"Idempotency-Key": "r"})
    kinds = [event.kind for event in events if event.kind is not EventKind.STORE_CALL]
    assert kinds == [
        EventKind.FIRST_RUN,
        EventKind.CLAIM_STARTED,
        EventKind.CLAIM_ENDED,
        EventKind.REPLAY,
        EventKind.MISMATCH,
        EventKind.FIRST_RUN,
        EventKind.CLAIM_STARTED,
        EventKind.CLAIM_ENDED,
    ]
    calls = [event for event in events if event.kind is EventKind.STORE_CALL]
    assert [call.operation for call in calls] == [
        "claim",
        "complete",
        "claim",
        "claim",
        "claim",
        "complete",
    ]
    assert all(call.duration is not None and call.duration >= 0 for call in calls)
    assert all(call.started_at is not None and call.error is None for call in calls)
    assert {event.route for event in events} == {"/tickets", "/optional"}
    assert all(len(event.key_hash) == 12 and "secret" not in event.key_hash for event in events)


async def test_a_store_error_is_reported() -> None:
    events: list[Event] = []
    dead = SQLStore("postgresql://postgres@127.0.0.1:1/test")
    app = make_app(dead, on_event=events.append)
    async with client_for(app) as client:
        answer = await client.post("/tickets", json={}, headers={"Idempotency-Key": "k"})
    assert answer.status_code == 503
    errors = [event for event in events if event.kind is EventKind.STORE_ERROR]
    assert len(errors) == 1
    assert errors[0].operation == "claim"
    assert errors[0].error
    await dead.aclose()


async def test_a_failing_hook_is_logged_and_harms_nothing(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: Event) -> None:
        raise RuntimeError("hook bug")

    app = make_app(store, on_event=broken)
    with caplog.at_level(logging.ERROR, "idempotency_mw"):
        async with client_for(app) as client:
            first = await client.post("/tickets", json={}, headers={"Idempotency-Key": "k"})
            again = await client.post("/tickets", json={}, headers={"Idempotency-Key": "k"})
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert "event hook" in caplog.text
