"""Settlement runs to its end once, whatever happens to the request meanwhile, and the lease
keeper lives exactly as long as its request."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from tests.support.apps import Gate, PausableStore, client_for

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "k"}


def service(**options: Any) -> tuple[FastAPI, PausableStore]:
    # Leases are proven on the worker's real clock, so the store keeps real time too.
    store = PausableStore(MemoryStore())
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    app.state.runs = 0
    app.state.ran = anyio.Event()
    app.state.gate = Gate()
    app.state.gate.opened.set()

    @app.post("/work")
    async def work(seconds: float = 0) -> dict[str, int]:
        app.state.runs += 1
        app.state.ran.set()
        app.state.gate.entered.set()
        await app.state.gate.opened.wait()
        await anyio.sleep(seconds)
        return {"run": app.state.runs}

    @app.post("/fails")
    async def fails() -> None:
        app.state.runs += 1
        app.state.ran.set()
        raise RuntimeError("the handler failed")

    return app, store


async def left_while_paused(
    client: httpx.AsyncClient,
    store: PausableStore,
    operation: str,
    path: str,
    *,
    leave_when: anyio.Event | None = None,
) -> None:
    """POST ``path`` with ``operation`` of the store paused; the client leaves once that
    operation waits at the pause (or ``leave_when`` is set), and the store comes back after."""
    store.pause(operation)
    leaving = anyio.CancelScope()

    async def send() -> None:
        with leaving:
            await client.post(path, headers=KEY)

    async with anyio.create_task_group() as group:
        group.start_soon(send)
        with anyio.fail_after(10):
            await (leave_when or store.blocked_at(operation)).wait()
        leaving.cancel()
        await anyio.sleep(0.2)
        store.resume()


async def resume_after(store: PausableStore, delay: float) -> None:
    await anyio.sleep(delay)
    store.resume()


async def test_a_completion_is_recorded_once_when_the_client_leaves_meanwhile() -> None:
    app, store = service()
    async with client_for(app) as client:
        await left_while_paused(client, store, "complete", "/work")
        again = await client.post("/work", headers=KEY)
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == {"run": 1}
    assert app.state.runs == 1
    assert store.reached["complete"] == 1


async def test_a_release_runs_to_its_end_when_the_client_leaves_meanwhile() -> None:
    app, store = service()
    async with client_for(app) as client:
        await left_while_paused(client, store, "release", "/fails")
        assert store.reached["release"] == 1
        # Released: the retry runs (it is not told the first is still in progress).
        again = await client.post("/fails", headers=KEY)
    assert again.status_code == 500
    assert app.state.runs == 2


async def test_a_request_cancelled_in_its_handler_releases_its_key() -> None:
    app, store = service()
    app.state.gate = Gate()
    async with client_for(app) as client:
        # The client leaves while the handler waits; the release suspends, cancelled.
        await left_while_paused(
            client, store, "release", "/work", leave_when=app.state.gate.entered
        )
        assert app.state.gate.entered.is_set()
        app.state.gate.opened.set()
        again = await client.post("/work", headers=KEY)
    assert again.status_code == 200
    assert again.json() == {"run": 2}
    assert store.reached["release"] == 1


async def test_the_lease_is_renewed_while_the_handler_runs_and_no_longer() -> None:
    app, store = service(lease=3)
    async with client_for(app) as client:
        started = time.monotonic()
        # Renewed every second from 1 s on; the next renewal (2 s) is not waited for.
        answer = await client.post("/work?seconds=1.2", headers=KEY)
        elapsed = time.monotonic() - started
        renewed = store.reached["renew"]
        await anyio.sleep(0.2)
    assert answer.status_code == 200
    assert renewed == 1
    assert elapsed < 1.8
    assert store.reached["renew"] == renewed


async def test_a_claim_held_after_a_shorter_one_ended_is_renewed_all_the_same() -> None:
    app, store = service(lease=3)
    async with client_for(app) as client:
        # The first claim's renewal would be due at 1 s: it ends before, the second (due a
        # little later) still runs then, and is renewed once.
        first = await client.post("/work", headers={"Idempotency-Key": "short"})
        second = await client.post("/work?seconds=1.2", headers=KEY)
    assert (first.status_code, second.status_code) == (200, 200)
    assert store.reached["renew"] == 1
