"""A store that hangs while a handler runs, under uvicorn with 2 worker processes.

The store is a PostgreSQL or Redis server of the test's own, paused with SIGSTOP while a
handler longer than its lease runs (``tests/support/faults.py``). ``POST /work`` of
``tests/support/reliability_app.py`` logs when each run started, had its side effect and ended, on
the machine's monotonic clock, so a test can tell whether two runs of one key lived at once.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import TaskGroup

from tests.reliability.test_reliability import (
    FACTORY,
    eventually,
    headers_for,
    key_hash,
    problem_type,
    replay_of,
    replayed,
)
from tests.support.faults import ServerProcess, StoreServer
from tests.support.reliability_app import Effects, Run, service_env

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

#: More than one, so a retry may reach a worker other than the one running the first request.
WORKERS = 2
#: "Retry later" answers a retry may get while the first run holds the key or the store hangs.
RETRY_LATER = {409: "in-progress", 503: "store-unavailable"}


@dataclass
class Service:
    """The service under uvicorn with 2 workers, a client of it, and the log of its runs."""

    process: ServerProcess
    client: httpx.AsyncClient
    effects: Effects

    async def start_first(self, group: TaskGroup, key: str, answers: list[httpx.Response]) -> None:
        """Send the first request of ``key`` (its answer goes to ``answers``); return once
        its handler runs."""
        group.start_soon(post_work, self.client, key, answers)
        await eventually(lambda: self.effects.count(key, "started") == 1)


@asynccontextmanager
async def service_on(
    store: StoreServer, tmp_path: Path, *, lease: float, delay: float, **options: str
) -> AsyncIterator[Service]:
    effects = Effects(tmp_path / "effects.db")
    env = service_env(store.url, effects, lease=lease, delay=delay, **options)
    with ServerProcess(FACTORY, env, workers=WORKERS) as process:
        await anyio.to_thread.run_sync(process.wait_ready)
        async with process.client() as client:
            yield Service(process, client, effects)


async def stall(store: StoreServer, seconds: float) -> None:
    """Pause the store for ``seconds``."""
    await anyio.to_thread.run_sync(store.pause)
    try:
        await anyio.sleep(seconds)
    finally:
        await anyio.to_thread.run_sync(store.resume)


async def post_work(client: httpx.AsyncClient, key: str, answers: list[httpx.Response]) -> None:
    answers.append(await client.post("/work", json={}, headers=headers_for(key)))


async def retry_every_second_until_replayed(
    client: httpx.AsyncClient, key: str, answers: list[httpx.Response], *, within: float
) -> None:
    """Send the request again every second, without waiting for answers, until one is a replay."""
    deadline = time.monotonic() + within
    replay_seen = anyio.Event()

    async def retry() -> None:
        await post_work(client, key, answers)
        if replayed(answers[-1]):
            replay_seen.set()

    async with anyio.create_task_group() as group:
        while not replay_seen.is_set():
            assert time.monotonic() < deadline, f"no replay in {within} s: {answers}"
            group.start_soon(retry)
            with anyio.move_on_after(1):
                await replay_seen.wait()


def assert_one_run_at_a_time(runs: list[Run]) -> None:
    """Every run has ended, and each started only after the one before it had ended."""
    for earlier, later in itertools.pairwise(runs):
        assert earlier.ended is not None, runs
        assert later.started >= earlier.ended, (
            f"a run started {earlier.ended - later.started:.2f} s before the one before it"
            f" ended: {runs}"
        )


def assert_retry_later(answer: httpx.Response) -> None:
    assert answer.status_code in RETRY_LATER, answer.text
    assert problem_type(answer) == RETRY_LATER[answer.status_code]
    assert answer.headers["retry-after"]


# ---------------------------------------------------------------- a stall longer than the lease


async def test_a_store_stalled_past_the_lease_never_lets_two_runs_of_a_key_live_at_once(
    own_store: StoreServer, tmp_path: Path
) -> None:
    lease = 2.0
    key = f"stall-{uuid.uuid4().hex}"
    first: list[httpx.Response] = []
    retries: list[httpx.Response] = []
    async with service_on(own_store, tmp_path, lease=lease, delay=2 * lease) as service:
        async with anyio.create_task_group() as group:
            await service.start_first(group, key, first)
            group.start_soon(
                lambda: retry_every_second_until_replayed(service.client, key, retries, within=25)
            )
            await anyio.sleep(0.5)
            # The handler outlives its lease while the store hangs for 1.4 leases.
            await stall(own_store, 1.4 * lease)
        # Every run has ended: none is left to have its effect later.
        await eventually(lambda: all(run.ended for run in service.effects.runs(key)))
        runs = service.effects.runs(key)

    had_effect = [run for run in runs if run.effect is not None]
    assert len(had_effect) == 1, f"{len(had_effect)} runs of one key had their effect: {runs}"
    assert_one_run_at_a_time(runs)
    # Its lease was last proven before the stall and lapsed during it, 1.5 s before the
    # handler's effect was due: the handler was cancelled, and its client told so.
    (answer,) = first
    assert answer.status_code == 503, answer.text
    assert problem_type(answer) == "lease-lost"
    assert answer.headers["retry-after"]
    # A retry ran the one effect; the retries after it were replayed its answer.
    (completed,) = [retry for retry in retries if retry.status_code == 200 and not replayed(retry)]
    for retry in retries:
        if retry.status_code != 200:
            assert_retry_later(retry)
        elif retry is not completed:
            assert replayed(retry)
            assert retry.content == completed.content


# ---------------------------------------------------------------- on_lease_lost="continue"


async def test_a_store_stalled_past_the_lease_with_continue_lets_the_handler_finish_unprotected(
    own_store: StoreServer, tmp_path: Path
) -> None:
    lease = 2.0
    key = f"continue-{uuid.uuid4().hex}"
    first: list[httpx.Response] = []
    async with service_on(
        own_store, tmp_path, lease=lease, delay=2 * lease, on_lease_lost="continue"
    ) as service:
        async with anyio.create_task_group() as group:
            await service.start_first(group, key, first)
            await anyio.sleep(0.5)
            await stall(own_store, 1.4 * lease)
        replay = await replay_of(service.client, "/work", key, json={})
        (run,) = service.effects.runs(key)
        log = service.process.output()

    (answer,) = first
    assert answer.status_code == 200, answer.text
    assert not replayed(answer)
    assert run.effect is not None
    assert replayed(replay)
    assert replay.content == answer.content
    # The worker said, with the key's hash, that the handler went on without a lease.
    said = [line for line in log.splitlines() if key_hash(key) in line]
    assert any("unprotected" in line.lower() for line in said), log


# ---------------------------------------------------------------- a stall shorter than a third


async def test_a_store_stalled_for_less_than_a_third_of_the_lease_costs_nothing(
    own_store: StoreServer, tmp_path: Path
) -> None:
    lease = 3.0
    key = f"short-stall-{uuid.uuid4().hex}"
    first: list[httpx.Response] = []
    retries: list[httpx.Response] = []
    async with service_on(own_store, tmp_path, lease=lease, delay=4.0) as service:
        async with anyio.create_task_group() as group:
            await service.start_first(group, key, first)
            group.start_soon(
                lambda: retry_every_second_until_replayed(service.client, key, retries, within=15)
            )
            # Around the first renewal, for less than a third of the lease.
            await anyio.sleep(0.8)
            await stall(own_store, 0.8)
        (run,) = service.effects.runs(key)

    (answer,) = first
    assert answer.status_code == 200, answer.text
    assert not replayed(answer)
    assert run.effect is not None
    # Retries were told to wait while it ran, and were replayed its answer once it was done.
    assert any(map(replayed, retries))
    for retry in retries:
        if replayed(retry):
            assert retry.content == answer.content
        else:
            assert_retry_later(retry)
