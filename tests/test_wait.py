"""Wait-then-replay: a duplicate waits for the first request's outcome instead of a 409."""

from __future__ import annotations

import time
from functools import partial

import anyio
import httpx
import pytest

from idempotency_mw import Store
from tests.apps import client_for, make_app

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "k"}


async def test_a_duplicate_waits_and_gets_the_replay(store: Store) -> None:
    app = make_app(store, wait=5)
    gate = app.state.gate
    answers: list[httpx.Response] = []
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def post() -> None:
            answers.append(await client.post("/held", headers=KEY))

        group.start_soon(post)
        await gate.entered.wait()
        for _ in range(5):
            group.start_soon(post)
        await anyio.sleep(0.3)
        opened = time.monotonic()
        gate.opened.set()
    assert [answer.status_code for answer in answers] == [200] * 6
    assert sum("idempotent-replayed" in answer.headers for answer in answers) == 5
    assert app.state.calls["held"] == 1
    # Woken by the settlement in this worker, not by the next poll (up to 0.5 s apart).
    assert time.monotonic() - opened < 0.4


async def test_a_duplicate_gets_409_when_its_wait_runs_out(store: Store) -> None:
    app = make_app(store, routes={"/held": {"wait": 0.2}})
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(partial(client.post, "/held", headers=KEY))
        await app.state.gate.entered.wait()
        started = time.monotonic()
        duplicate = await client.post("/held", headers=KEY)
        waited = time.monotonic() - started
        app.state.gate.opened.set()
    assert duplicate.status_code == 409
    assert duplicate.json()["type"].endswith("in-progress")
    assert 0.2 <= waited < 1.0
