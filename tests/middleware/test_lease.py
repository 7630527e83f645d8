"""The lease is proven on the worker's own clock: a stalled store stops the request in time."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from tests.support.apps import PausableStore, client_for

pytestmark = pytest.mark.anyio


def stalled_service(**options: Any) -> tuple[FastAPI, PausableStore]:
    # Leases are proven on the worker's real clock, so the store keeps real time too.
    store = PausableStore(MemoryStore())
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    effects: Counter[str] = Counter()
    app.state.effects = effects

    @app.post("/work")
    async def work(seconds: float) -> dict[str, str]:
        effects["started"] += 1
        await anyio.sleep(seconds)
        effects["done"] += 1
        return {"done": "yes"}

    return app, store


async def pause_after(store: PausableStore, delay: float, length: float) -> None:
    await anyio.sleep(delay)
    store.pause()
    await anyio.sleep(length)
    store.resume()


async def test_a_lease_not_proven_in_time_stops_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, store = stalled_service(lease=0.6, retry_after=2)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(pause_after, store, 0.1, 1.5)
        started = time.monotonic()
        answer = await client.post("/work?seconds=2", headers={"Idempotency-Key": "k"})
        elapsed = time.monotonic() - started
    assert answer.status_code == 503
    assert answer.json()["type"].endswith("lease-lost")
    assert answer.headers["retry-after"] == "2"
    assert app.state.effects == Counter(started=1)
    # Stopped when the proof ran out (0.6 s after the claim), not when the store came back.
    assert elapsed < 1.2
    assert "did not confirm the lease in time" in caplog.text


async def test_continue_lets_the_request_finish_unprotected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, store = stalled_service(lease=0.6, on_lease_lost="continue")
    with caplog.at_level(logging.ERROR, "idempotency_mw"):
        async with client_for(app) as client, anyio.create_task_group() as group:
            group.start_soon(pause_after, store, 0.1, 1.0)
            answer = await client.post("/work?seconds=1.5", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 200
    assert app.state.effects == Counter(started=1, done=1)
    assert "goes on unprotected" in caplog.text


async def test_a_pause_shorter_than_a_third_of_the_lease_costs_nothing() -> None:
    app, store = stalled_service(lease=1.5)
    async with client_for(app) as client, anyio.create_task_group() as group:
        # Renewals are due every 0.5 s: a 0.45 s pause covers one of them.
        group.start_soon(pause_after, store, 0.45, 0.45)
        answer = await client.post("/work?seconds=2.2", headers={"Idempotency-Key": "k"})
        again = await client.post("/work?seconds=2.2", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.effects == Counter(started=1, done=1)


async def test_a_claim_slower_than_the_lease_renews_before_the_handler_starts() -> None:
    app, store = stalled_service(lease=0.6)
    async with client_for(app) as client, anyio.create_task_group() as group:
        # The claim's reply comes after the whole lease: a renewal proves the key is still
        # this request's before the handler starts, so it runs to the end.
        store.pause("claim")
        group.start_soon(resume_after, store, 0.8)
        answer = await client.post("/work?seconds=0.4", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 200
    assert app.state.effects == Counter(started=1, done=1)


async def resume_after(store: PausableStore, delay: float) -> None:
    await anyio.sleep(delay)
    store.resume()


async def test_a_renewal_in_flight_when_the_handler_ends_does_not_hold_its_response(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, store = stalled_service(lease=1.2)
    async with client_for(app) as client, anyio.create_task_group() as group:
        # The first renewal (0.4 s after the claim) waits on the store; the handler ends at
        # 0.7 s, and its response does not wait for the renewal: the keeper ends with it.
        store.pause("renew")
        group.start_soon(resume_after, store, 1.0)
        started = time.monotonic()
        answer = await client.post("/work?seconds=0.7", headers={"Idempotency-Key": "k"})
        elapsed = time.monotonic() - started
    assert answer.status_code == 200
    assert elapsed < 1.0
    assert store.reached["renew"] == 0
    assert "lost the lease" not in caplog.text


async def test_a_timeout_of_the_handlers_own_is_not_taken_for_a_lost_lease() -> None:
    app, _ = stalled_service()

    @app.post("/times-out")
    async def times_out() -> None:
        app.state.effects["timed out"] += 1
        raise TimeoutError("the handler's own")

    # The app's exception reaches the server as it was raised, and the key is released.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://testserver"
    ) as client:
        for _ in range(2):
            with pytest.raises(TimeoutError, match="the handler's own"):
                await client.post("/times-out", headers={"Idempotency-Key": "k"})
    assert app.state.effects == Counter({"timed out": 2})
