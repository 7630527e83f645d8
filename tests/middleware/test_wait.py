"""Wait-then-replay: a duplicate waits for the first request's outcome instead of a 409."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import anyio
import httpx
import pytest

from idempotency_mw import Claim, ClaimOutcome, Store
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for, make_app

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


class HeldReplies(MemoryStore):
    """A MemoryStore whose claims that find a key in progress, once ``hold()`` is called, answer
    only when the test lets them: as if the reply were still on its way."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.held = anyio.Event()
        self.let_go = anyio.Event()

    async def claim(self, *args: Any, **kwargs: Any) -> Claim:
        claim = await super().claim(*args, **kwargs)
        if self.holding and claim.outcome is ClaimOutcome.IN_PROGRESS:
            self.held.set()
            await self.let_go.wait()
        return claim


async def test_a_key_settled_while_the_duplicates_claim_travels_wakes_it_at_once() -> None:
    store = HeldReplies()
    app = make_app(store, wait=10)
    gate = app.state.gate
    answered: dict[str, tuple[httpx.Response, float]] = {}
    first_answered = anyio.Event()
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def post(name: str) -> None:
            answer = await client.post("/held", headers=KEY)
            answered[name] = answer, time.monotonic()
            if name == "first":
                first_answered.set()

        group.start_soon(post, "first")
        await gate.entered.wait()
        group.start_soon(post, "duplicate")
        await anyio.sleep(1.5)  # the duplicate now polls every 0.5 s
        store.holding = True
        await store.held.wait()
        # The first request settles the key after the duplicate's claim found it in progress,
        # before that claim's answer arrives.
        gate.opened.set()
        await first_answered.wait()
        await anyio.sleep(0.05)
        arrived = time.monotonic()
        store.let_go.set()
    duplicate, woken = answered["duplicate"]
    assert duplicate.headers["idempotent-replayed"] == "true"
    # It does not sleep out its next pause (0.5 s): the settlement was remembered.
    assert woken - arrived < 0.2
