"""Faults against real servers: killed workers, store outages, disconnects, failed completions.

The service is ``tests/support/reliability_app.py``: its handlers log every run to a SQLite file
(``started`` when they begin, ``done`` once their side effect happened), so each test can count
how often an operation really ran. Workers that must die run under uvicorn in child processes
and are killed with SIGKILL; the others run under uvicorn in the test's event loop. Outages are
made by a TCP proxy in front of the real PostgreSQL, MariaDB or Redis (``tests/support/faults.py``),
which the test cuts and restores; the servers themselves are never touched.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import RedisStore, SQLStore, Store, StoredResponse, StoreError
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import records
from idempotency_mw.values import metrics
from tests.conftest import (
    MARIADB_URL,
    POSTGRESQL_URL,
    REDIS_URL,
    fresh_sql_store,
    redis_prefix,
    require_server,
)
from tests.support.faults import Cut, ServerProcess, TcpProxy, serve, upstream_port
from tests.support.reliability_app import Effects, create_app, service_env, store_from_url

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

FACTORY = "tests.support.reliability_app:create_app"
PROBLEM = "application/problem+json"
CALLER = "agent-7"


# ---------------------------------------------------------------- helpers


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == PROBLEM, response.text
    body: dict[str, Any] = response.json()
    assert body["status"] == response.status_code
    assert body["title"]
    assert body["detail"]
    return str(body["type"]).rsplit(":", 1)[-1]


def headers_for(key: str, caller: str = CALLER) -> dict[str, str]:
    return {"Idempotency-Key": key, "X-Caller": caller}


def key_hash(key: str, caller: str = CALLER) -> str:
    """The 12-character hash the middleware logs instead of the key."""
    return metrics.key_hash(caller, key)


async def collecting_garbage(
    scenario: Awaitable[None], caplog: pytest.LogCaptureFixture | None = None
) -> None:
    """Run ``scenario``; collect garbage before reporting its failure.

    A connection a failure leaked is then finalized (and warned about) within this test, not
    in whichever test the garbage collector happens to run next. The failure is reported as
    text, and logged tracebacks are dropped (their text stays), so that nothing keeps the
    leaked objects alive.
    """
    failure: str | None = None
    try:
        await scenario
    except Exception as exc:
        failure = "".join(traceback.format_exception(exc))
    for record in caplog.records if caplog else ():
        record.exc_info = None
    gc.collect()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await anyio.sleep(0.02)


def replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get("idempotent-replayed") == "true")


async def retry_until_settled(
    client: httpx.AsyncClient, url: str, key: str, *, within: float, **request: Any
) -> tuple[httpx.Response, list[httpx.Response]]:
    """Send the request again while it is answered "retry later", as a client would.

    "Retry later" is 409 in-progress (and 503 store-unavailable). Returns the first other
    answer and the answers before it; fails after ``within`` seconds: a key that answers
    in-progress for longer than that is stuck.
    """
    waits: list[httpx.Response] = []
    deadline = time.monotonic() + within
    while True:
        response = await client.post(url, headers=headers_for(key), **request)
        later = {409: "in-progress", 503: "store-unavailable"}.get(response.status_code)
        if later is None or problem_type(response) != later:
            return response, waits
        assert response.headers["retry-after"]
        waits.append(response)
        assert time.monotonic() < deadline, f"key still in progress after {within} s"
        await anyio.sleep(0.1)


async def replay_of(
    client: httpx.AsyncClient, url: str, key: str, **request: Any
) -> httpx.Response:
    """The answer to a repeat of a request that has been answered.

    Tolerates a moment of 409 in-progress, should the record be written only after the
    answer reached the client (the middleware writes it before the last chunk is sent).
    """
    response, _ = await retry_until_settled(client, url, key, within=5, **request)
    return response


@dataclass
class Backend:
    """A store's URL for the servers, and the test's own handle on the same records."""

    name: str
    url: str
    store: Store
    redis_prefix: str = "idem:"

    def fresh_store(self) -> Store:
        """Another store on the same records, with connections of its own."""
        return store_from_url(self.url, self.redis_prefix)

    async def token_of(self, scope: str, key: str) -> str | None:
        """The token of the record of ``(scope, key)``, read behind the middleware's back."""
        if isinstance(self.store, RedisStore):
            token = await self.store.client.hget(self.store.redis_key(scope, key), "token")
            return token.decode() if isinstance(token, bytes) else token
        engine = create_async_engine(async_url(self.url))
        try:
            async with engine.connect() as conn:
                found = await conn.scalar(
                    select(records.c.token).where(records.c.scope == scope, records.c.key == key)
                )
        finally:
            await engine.dispose()
        return str(found) if found else None


async def make_backend(name: str, tmp_path: Path) -> Backend:
    if name == "redis":
        require_server(REDIS_URL)
        prefix = redis_prefix("reliability")
        return Backend(name, REDIS_URL, RedisStore(REDIS_URL, prefix=prefix), prefix)
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'idempotency.db'}",
        "postgresql": POSTGRESQL_URL,
        "mariadb": MARIADB_URL,
    }[name]
    if name != "sqlite":
        require_server(url)
    return Backend(name, url, await fresh_sql_store(url))


async def drop_backend(backend: Backend) -> None:
    if isinstance(backend.store, RedisStore):
        client = backend.store.client
        keys = [k async for k in client.scan_iter(match=f"{backend.redis_prefix}*")]
        if keys:
            await client.delete(*keys)
    await backend.store.aclose()


@pytest.fixture(params=["sqlite", "postgresql", "mariadb", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    made = await make_backend(request.param, tmp_path)
    yield made
    await drop_backend(made)


def server_env(backend: Backend, effects: Effects, lease: float, delay: float) -> dict[str, str]:
    return service_env(
        backend.url, effects, lease=lease, delay=delay, redis_prefix=backend.redis_prefix
    )


# ---------------------------------------------------------------- crashed worker


async def test_killed_worker_holds_the_key_until_its_lease_lapses_then_one_retry_runs(
    backend: Backend, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    lease = 1.0
    key = f"crash-{uuid.uuid4().hex}"
    body = {"ticket": "printer on fire"}
    # The doomed worker is a child process whose handler sleeps far longer than the test. The
    # survivor is another uvicorn server, in this process, with a store (and pool) of its own.
    survivor = create_app(backend.fresh_store(), effects=effects, lease=lease)
    with ServerProcess(FACTORY, server_env(backend, effects, lease, delay=120)) as doomed:
        async with (
            serve(survivor) as survivor_url,
            httpx.AsyncClient(timeout=30) as client,
        ):
            await anyio.to_thread.run_sync(doomed.wait_ready)
            work = survivor_url + "/work"
            lost: list[BaseException] = []

            async def first_attempt() -> None:
                try:
                    await client.post(doomed.url + "/work", json=body, headers=headers_for(key))
                except httpx.TransportError as exc:
                    lost.append(exc)

            async with anyio.create_task_group() as group:
                group.start_soon(first_attempt)
                await eventually(lambda: effects.count(key, "started") == 1)
                old_token = await backend.token_of(CALLER, key)
                assert old_token
                # Alive, the doomed worker renews its lease: past one lease, still in progress.
                await anyio.sleep(lease * 1.2)
                during = await client.post(work, json=body, headers=headers_for(key))
                assert during.status_code == 409
                assert problem_type(during) == "in-progress"
                doomed.kill()
                killed_at = time.monotonic()
            assert len(lost) == 1  # the client saw the connection die: outcome unknown

            taken_over, waits = await retry_until_settled(
                client, work, key, within=lease + 5, json=body
            )
            lapsed_after = time.monotonic() - killed_at
            replay = await replay_of(client, work, key, json=body)

            # The dead worker, were it to come back, could not overwrite the new record.
            stale = StoredResponse(200, (), b'{"stale": true}')
            assert old_token is not None  # (checked in the task group, which may swallow errors)
            assert old_token != await backend.token_of(CALLER, key)
            assert not await backend.store.complete(CALLER, key, old_token, stale, ttl=60)
            assert not await backend.store.renew(CALLER, key, old_token, lease=60)
            assert not await backend.store.release(CALLER, key, old_token)
            after = await replay_of(client, work, key, json=body)

    # The last renewal was at most a third of a lease before the kill.
    assert waits, "the key was free at once: the dead worker's lease was not honoured"
    assert all(w.status_code == 409 for w in waits)
    assert lapsed_after > lease / 2
    assert taken_over.status_code == 200, taken_over.text
    assert not replayed(taken_over)
    assert taken_over.json()["pid"] == os.getpid()
    assert replayed(replay)
    assert replay.content == taken_over.content
    assert replayed(after)
    assert after.content == taken_over.content
    # Two starts (the dead worker's and the survivor's), one side effect.
    assert effects.count(key, "started") == 2
    assert effects.count(key, "done") == 1


# ---------------------------------------------------------------- lease renewal


async def test_handler_three_leases_long_is_the_only_run_while_retries_get_409(
    backend: Backend, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    # A lease of a second, as elsewhere: on a busy machine a 0.6 s lease went unrenewed once.
    lease = 1.0
    key = f"long-{uuid.uuid4().hex}"
    body = {"report": "quarterly"}
    # Two servers, each with a store of its own: one runs the request, both get retries.
    runner = create_app(backend.fresh_store(), effects=effects, lease=lease, delay=3 * lease)
    other = create_app(backend.fresh_store(), effects=effects, lease=lease, delay=0)
    answers: list[httpx.Response] = []
    first: list[httpx.Response] = []
    async with (
        serve(runner) as runner_url,
        serve(other) as other_url,
        httpx.AsyncClient(timeout=30) as client,
    ):

        async def run_first() -> None:
            first.append(
                await client.post(runner_url + "/work", json=body, headers=headers_for(key))
            )

        async def retry(url: str) -> None:
            answer = await client.post(url + "/work", json=body, headers=headers_for(key))
            answers.append(answer)

        async with anyio.create_task_group() as group:
            group.start_soon(run_first)
            await eventually(lambda: effects.count(key, "started") == 1)
            started = time.monotonic()
            while not first:
                for url in (runner_url, other_url, other_url):
                    group.start_soon(retry, url)
                await anyio.sleep(0.1)
        replay = await replay_of(client, other_url + "/work", key, json=body)

    # The handler outlived three leases, and retries came all the while from before the
    # second would have lapsed unrenewed (the run's own clock, not when this test saw it
    # start: on a busy machine that can be most of a lease later).
    (run,) = effects.runs(key)
    assert run.effect is not None
    assert run.effect - run.started >= 3 * lease
    assert started < run.started + 2 * lease
    assert first[0].status_code == 200
    assert len(answers) > 30
    finished = [a for a in answers if a.status_code != 409]
    # A retry sent just before the first finished may be answered with its replay.
    assert all(replayed(a) and a.content == first[0].content for a in finished)
    assert all(problem_type(a) == "in-progress" for a in answers if a.status_code == 409)
    assert replayed(replay)
    assert replay.content == first[0].content
    assert effects.count(key, "started") == 1
    assert effects.count(key, "done") == 1


# ---------------------------------------------------------------- store outage


OUTAGES = [
    pytest.param("postgresql", Cut.REFUSE, id="postgresql-refused"),
    pytest.param("postgresql", Cut.HANG, id="postgresql-hanging"),
    pytest.param("mariadb", Cut.RESET, id="mariadb-reset"),
    pytest.param("redis", Cut.REFUSE, id="redis-refused"),
    pytest.param("redis", Cut.RESET, id="redis-reset"),
]
SERVER_URLS = {"postgresql": POSTGRESQL_URL, "mariadb": MARIADB_URL, "redis": REDIS_URL}
DEFAULT_PORTS = {"postgresql": 5432, "mariadb": 3306, "redis": 6379}


@dataclass
class Sent:
    """One request of the stream: when it went and what came back."""

    key: str
    number: int
    started: float
    ended: float
    response: httpx.Response | None


@dataclass
class Outage:
    """A store behind a cuttable proxy, for one test."""

    proxy: TcpProxy
    direct: Backend  # the same records, reached without the proxy
    store: Store  # the store the service uses, through the proxy

    def during(self, sent: Sent, cut: float, restored: float) -> bool:
        return cut < sent.started and sent.ended < restored


@pytest.fixture
async def outage(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Outage]:
    name: str = request.param
    direct = await make_backend(name, tmp_path)
    with TcpProxy(upstream_port(SERVER_URLS[name], DEFAULT_PORTS[name])) as proxy:
        through = proxy.url(direct.url)
        store: Store = (
            RedisStore(through, prefix=direct.redis_prefix, socket_timeout=1)
            if name == "redis"
            else SQLStore(through, operation_timeout=1)
        )
        yield Outage(proxy, direct, store)
        await store.aclose()
    await drop_backend(direct)


async def keyed_stream(
    client: httpx.AsyncClient,
    sent: list[Sent],
    stop: anyio.Event,
    worker: int,
) -> None:
    """Fresh keys, one request after another, until ``stop``."""
    number = 0
    while not stop.is_set():
        number += 1
        key = f"stream-{worker}-{number}-{uuid.uuid4().hex[:8]}"
        began = time.monotonic()
        try:
            response: httpx.Response | None = await client.post(
                "/work", json={"n": number}, headers=headers_for(key)
            )
        except httpx.TransportError:
            response = None
        sent.append(Sent(key, number, began, time.monotonic(), response))
        await anyio.sleep(0.01)


async def run_outage(
    outage: Outage, how: Cut, client: httpx.AsyncClient, *, down_for: float
) -> tuple[list[Sent], float, float]:
    """A stream of keyed requests through a cut of ``down_for`` seconds and a recovery."""
    sent: list[Sent] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        for worker in range(4):
            group.start_soon(keyed_stream, client, sent, stop, worker)
        await anyio.sleep(0.4)
        await anyio.to_thread.run_sync(outage.proxy.cut, how)
        cut = time.monotonic()
        await anyio.sleep(down_for)
        await anyio.to_thread.run_sync(outage.proxy.restore)
        restored = time.monotonic()
        # Recovered when every worker has had a success after the restore.
        await eventually(
            lambda: (
                sum(
                    1
                    for s in sent
                    if s.started > restored and s.response is not None and s.response.is_success
                )
                >= 8
            ),
            within=15,
        )
        stop.set()
    return sent, cut, restored


@pytest.mark.parametrize(("outage", "how"), OUTAGES, indirect=["outage"])
async def test_store_outage_answers_503_runs_nothing_and_recovers_by_itself(
    outage: Outage, how: Cut, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await collecting_garbage(outage_scenario(outage, how, tmp_path, caplog), caplog)


async def outage_scenario(
    outage: Outage, how: Cut, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    effects = Effects(tmp_path / "effects.db")
    lease = 1.0
    app = create_app(outage.store, effects=effects, lease=lease, delay=0.02, retry_after=2)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        down_for = 2.5 if how is Cut.HANG else 1.0
        sent, cut, restored = await run_outage(outage, how, client, down_for=down_for)
        runs = effects.per_key("started")

        for s in sent:
            assert s.response is not None, "the service dropped a connection"
            if s.response.status_code == 503:
                assert problem_type(s.response) == "store-unavailable"
                assert s.response.headers["retry-after"] == "2"
                # Refused before the handler: it never ran.
                assert s.key not in runs
            else:
                assert s.response.status_code == 200, s.response.text
                assert runs[s.key] == 1
        during = [s for s in sent if outage.during(s, cut, restored)]
        assert len(during) >= 4
        assert all(s.response and s.response.status_code == 503 for s in during)
        recovered = [s for s in sent if s.started > restored + 1.5]
        assert all(s.response and s.response.status_code == 200 for s in recovered)

        # No key is stuck: every one of them can be used again, and an operation whose answer
        # was 503 runs exactly once now. Only a request in flight when the cut came may have
        # lost its record (its completion failed): it runs again once its lease has lapsed.
        rerun: list[str] = []
        limit = anyio.Semaphore(8)

        async def check_key(s: Sent) -> None:
            async with limit:
                again, _ = await retry_until_settled(
                    client, "/work", s.key, within=lease + 5, json={"n": s.number}
                )
            assert again.status_code == 200, again.text
            assert s.response is not None
            if s.response.status_code == 200:
                if replayed(again):
                    assert again.content == s.response.content
                else:
                    # Its answer may have reached the client just before the completion failed.
                    assert s.started < cut < s.ended + 0.5, "a completed key ran again"
                    rerun.append(s.key)
            else:
                assert not replayed(again)

        async with anyio.create_task_group() as group:
            for s in sent:
                group.start_soon(check_key, s)
    done = effects.per_key("done")
    for s in sent:
        assert done[s.key] == (2 if s.key in rerun else 1)
    for key in rerun:
        assert f"could not record the response of key {key_hash(key)}" in caplog.text


@pytest.mark.parametrize(
    ("outage", "how"),
    [
        pytest.param("postgresql", Cut.REFUSE, id="postgresql"),
        pytest.param("redis", Cut.RESET, id="redis"),
    ],
    indirect=["outage"],
)
async def test_store_outage_with_fail_open_runs_requests_unprotected(
    outage: Outage, how: Cut, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    app = create_app(outage.store, effects=effects, lease=1.0, delay=0.02, fail_open=True)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        sent, cut, restored = await run_outage(outage, how, client, down_for=1.0)
        # Protection is back: a repeat is a replay again.
        key = f"after-{uuid.uuid4().hex}"
        first = await client.post("/work", json={}, headers=headers_for(key))
        again = await replay_of(client, "/work", key, json={})
    assert all(s.response is not None and s.response.status_code == 200 for s in sent)
    during = [s for s in sent if outage.during(s, cut, restored)]
    assert len(during) >= 4
    runs = effects.per_key("done")
    assert all(runs[s.key] == 1 for s in sent)
    assert first.status_code == 200
    assert replayed(again)
    assert runs[key] == 1


@pytest.mark.parametrize(
    "outage",
    ["postgresql", "mariadb", "redis"],
    indirect=True,
)
@pytest.mark.parametrize("how", list(Cut), ids=lambda how: how.value)
async def test_every_failure_of_a_cut_store_is_a_store_error(outage: Outage, how: Cut) -> None:
    store = outage.store

    async def scenario() -> None:
        await store.claim("s", uuid.uuid4().hex, "f" * 64, ttl=60, lease=10)  # pooled
        await anyio.to_thread.run_sync(outage.proxy.cut, how)
        for _ in range(2):
            with pytest.raises(StoreError):
                await store.claim("s", uuid.uuid4().hex, "f" * 64, ttl=60, lease=10)
        await anyio.to_thread.run_sync(outage.proxy.restore)
        await store.claim("s", uuid.uuid4().hex, "f" * 64, ttl=60, lease=10)

    await collecting_garbage(scenario())


@pytest.mark.parametrize("outage", ["postgresql", "mariadb", "redis"], indirect=True)
@pytest.mark.parametrize("noticed", [True, False], ids=["closed-seen", "closed-unseen"])
async def test_store_after_an_outage_does_not_fail_on_stale_pooled_connections(
    outage: Outage, noticed: bool
) -> None:
    store = outage.store

    async def claims(count: int) -> list[str]:
        async def claim() -> str:
            try:
                await store.claim("s", uuid.uuid4().hex, "f" * 64, ttl=60, lease=10)
            except StoreError as exc:
                return str(exc)
            return "ok"

        async with anyio.create_task_group() as group:
            results: list[str] = []
            for _ in range(count):
                group.start_soon(lambda: _append(results, claim()))
        return results

    assert await claims(8) == ["ok"] * 8  # eight connections in the pool
    if noticed:
        # The event loop runs meanwhile: the store's connections see the server close them.
        await anyio.to_thread.run_sync(outage.proxy.cut, Cut.REFUSE)
        await anyio.to_thread.run_sync(outage.proxy.restore)
    else:
        # The event loop is blocked throughout: the pooled connections look alive when used.
        outage.proxy.cut(Cut.REFUSE)
        outage.proxy.restore()
    # The server is back: no claim should fail any more.
    assert await claims(8) == ["ok"] * 8


async def _append(results: list[str], outcome: Awaitable[str]) -> None:
    results.append(await outcome)


# ---------------------------------------------------------------- failed completion


@pytest.mark.parametrize("outage", ["postgresql", "redis"], indirect=True)
async def test_failed_completion_still_answers_logs_the_hash_and_never_replays_a_wrong_answer(
    outage: Outage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idempotency_mw")
    effects = Effects(tmp_path / "effects.db")
    lease = 2.0
    key = f"secret-{uuid.uuid4().hex}"
    app = create_app(outage.store, effects=effects, lease=lease, delay=0.6)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with anyio.create_task_group() as group:
            answers: list[httpx.Response] = []

            async def first() -> None:
                answers.append(await client.post("/work", json={}, headers=headers_for(key)))

            group.start_soon(first)
            await eventually(lambda: effects.count(key, "started") == 1)
            # The store goes away while the handler runs: its response cannot be recorded.
            await anyio.to_thread.run_sync(outage.proxy.cut, Cut.REFUSE)
        await anyio.to_thread.run_sync(outage.proxy.restore)
        (answer,) = answers
        # The record stays in progress (its owner lost it), so a retry waits for the lease,
        # then runs afresh: the key never replays something that was not recorded.
        later, waits = await retry_until_settled(client, "/work", key, within=lease + 5, json={})
        replay = await replay_of(client, "/work", key, json={})
    assert answer.status_code == 200
    assert answer.json()["body"] == "{}"
    assert waits
    assert all(w.status_code == 409 for w in waits)
    assert later.status_code == 200
    assert not replayed(later)
    assert replayed(replay)
    assert replay.content == later.content
    assert f"could not record the response of key {key_hash(key)}" in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)


TRIGGERS = {
    "sqlite": {
        "claim": "CREATE TRIGGER fail_claim BEFORE INSERT ON idempotency_records"
        " BEGIN SELECT RAISE(ABORT, 'disk full'); END",
        "complete": "CREATE TRIGGER fail_complete BEFORE UPDATE OF status ON idempotency_records"
        " WHEN NEW.status != 'in_progress' BEGIN SELECT RAISE(ABORT, 'disk full'); END",
    },
    "postgresql": {
        "claim": "CREATE TRIGGER fail_claim BEFORE INSERT ON idempotency_records"
        " FOR EACH ROW EXECUTE FUNCTION idem_test_fail()",
        "complete": "CREATE TRIGGER fail_complete BEFORE UPDATE ON idempotency_records"
        " FOR EACH ROW WHEN (NEW.status <> 'in_progress') EXECUTE FUNCTION idem_test_fail()",
    },
    "mariadb": {
        "claim": "CREATE TRIGGER fail_claim BEFORE INSERT ON idempotency_records FOR EACH ROW"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'disk full'",
        "complete": "CREATE TRIGGER fail_complete BEFORE UPDATE ON idempotency_records"
        " FOR EACH ROW BEGIN IF NEW.status <> 'in_progress' THEN"
        " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'disk full'; END IF; END",
    },
}
PG_FAIL_FUNCTION = (
    "CREATE OR REPLACE FUNCTION idem_test_fail() RETURNS trigger LANGUAGE plpgsql"
    " AS $$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
)


@asynccontextmanager
async def failing_store(kind: str, tmp_path: Path, when: str) -> AsyncIterator[Store]:
    """A store whose database refuses the claims or the completions (by a trigger).

    ``kind`` is ``sqlite``, ``postgresql`` or ``mariadb`` for a store made from a URL, or
    ``sqlite-engine`` for one given an AsyncEngine (SQLAlchemy all the way).
    """
    database = kind.removesuffix("-engine")
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'failing.db'}",
        "postgresql": POSTGRESQL_URL,
        "mariadb": MARIADB_URL,
    }[database]
    if database != "sqlite":
        require_server(url)
    await (await fresh_sql_store(url)).aclose()
    admin = create_async_engine(async_url(url))
    try:
        async with admin.begin() as conn:
            if database == "postgresql":
                await conn.exec_driver_sql(PG_FAIL_FUNCTION)
            await conn.exec_driver_sql(TRIGGERS[database][when])
        if kind.endswith("-engine"):
            engine = create_async_engine(async_url(url))
            yield SQLStore(engine)
            await engine.dispose()
        else:
            yield SQLStore(url)
    finally:
        async with admin.begin() as conn:
            on = " ON idempotency_records" if database == "postgresql" else ""
            await conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS fail_{when}{on}")
        await admin.dispose()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
async def test_complete_refused_by_the_database_answers_and_never_replays_a_wrong_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    effects = Effects(tmp_path / "effects.db")
    lease = 0.5
    key = f"complete-{uuid.uuid4().hex}"
    async with failing_store(kind, tmp_path, "complete") as store:
        app = create_app(store, effects=effects, lease=lease)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = await client.post("/work", json={"n": 1}, headers=headers_for(key))
            retry, waits = await retry_until_settled(
                client, "/work", key, within=lease + 5, json={"n": 1}
            )
    assert answer.status_code == 200
    assert answer.json()["body"] == '{"n":1}'
    # Not recorded: the claim stays until its lease lapses, then the retry runs afresh.
    assert waits
    assert all(w.status_code == 409 for w in waits)
    assert retry.status_code == 200
    assert not replayed(retry)
    assert retry.json()["run"] != answer.json()["run"]
    assert f"could not record the response of key {key_hash(key)}" in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)


@pytest.mark.parametrize("when", ["claim", "complete"])
@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        "postgresql",
        "mariadb",
        "sqlite-engine",
    ],
)
async def test_store_errors_never_log_the_raw_key_or_the_response(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, when: str
) -> None:
    effects = Effects(tmp_path / "effects.db")
    key = f"secret-{uuid.uuid4().hex}"
    caller = f"caller-{uuid.uuid4().hex}"
    async with failing_store(kind, tmp_path, when) as store:
        app = create_app(store, effects=effects, lease=1)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = await client.post(
                "/work", json={"card": "4111-1111"}, headers=headers_for(key, caller)
            )
    assert answer.status_code == (503 if when == "claim" else 200)
    assert key_hash(key, caller) in caplog.text
    assert key not in caplog.text
    assert caller not in caplog.text
    assert "4111-1111" not in caplog.text


# ---------------------------------------------------------------- client disconnects


@pytest.fixture(params=["sqlite", "postgresql"])
async def sql_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    made = await make_backend(request.param, tmp_path)
    yield made
    await drop_backend(made)


async def raw_exchange(url: str, request: bytes, *, read_until: bytes | None = None) -> bytes:
    """Send ``request`` bytes, read until ``read_until`` appears (or nothing), then hang up."""
    host, port = url.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    received = b""
    try:
        await stream.send(request)
        while read_until is not None and read_until not in received:
            received += await stream.receive()
    finally:
        await stream.aclose()
    return received


def request_head(path: str, key: str, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Idempotency-Key: {key}"]
    lines += [f"X-Caller: {CALLER}", *extra, "", ""]
    return "\r\n".join(lines).encode()


@pytest.mark.parametrize(
    ("framing", "partial"),
    [
        ("Transfer-Encoding: chunked", b"5\r\nhello\r\n"),
        ("Content-Length: 1000", b"only ten b"),
    ],
    ids=["chunked", "content-length"],
)
async def test_client_gone_mid_upload_leaves_no_claim(
    sql_backend: Backend, tmp_path: Path, framing: str, partial: bytes
) -> None:
    effects = Effects(tmp_path / "effects.db")
    app = create_app(sql_backend.store, effects=effects, lease=30)
    key = f"upload-{uuid.uuid4().hex}"
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        await raw_exchange(url, request_head("/upload", key, framing) + partial)
        await anyio.sleep(0.2)
        assert await sql_backend.token_of(CALLER, key) is None
        # The client sends it again, whole: it runs (a lease of 30 s would have shown a 409).
        whole = await client.post("/upload", content=b"hello world", headers=headers_for(key))
        again = await replay_of(client, "/upload", key, content=b"hello world")
    assert whole.status_code == 200
    assert whole.json()["size"] == 11
    assert replayed(again)
    assert effects.count(key) == 1


async def test_client_gone_mid_response_never_runs_the_handler_again(
    sql_backend: Backend, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    app = create_app(sql_backend.store, effects=effects, lease=30)
    key = f"stream-{uuid.uuid4().hex}"
    path = "/stream?chunks=20&interval=0.05"
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        head = await raw_exchange(
            url, request_head(path, key, "Content-Length: 0"), read_until=b"chunk 0"
        )
        assert head.startswith(b"HTTP/1.1 200")
        # A 200 had begun, so the request's effect may have happened: the server stops the
        # stream and marks the key not replayable, and a retry is told so instead of running.
        retry, waits = await retry_until_settled(client, path, key, within=5)
    assert len(waits) <= 5
    assert retry.status_code == 409
    assert problem_type(retry) == "not-replayable"
    assert effects.count(key, "started") == 1
    assert effects.count(key, "done") == 0


async def test_client_gone_while_the_handler_runs_gets_its_answer_replayed(
    sql_backend: Backend, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    app = create_app(sql_backend.store, effects=effects, lease=30, delay=0.5)
    key = f"gone-{uuid.uuid4().hex}"
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = b'{"x": 1}'
        await raw_exchange(
            url,
            request_head("/work", key, f"Content-Length: {len(body)}") + body,
        )
        await eventually(lambda: effects.count(key, "started") == 1)
        # The handler is not cancelled: it finishes, and its answer is recorded.
        retry, waits = await retry_until_settled(client, "/work", key, within=5, content=body)
    assert waits
    assert replayed(retry)
    assert retry.json()["body"] == '{"x": 1}'
    assert effects.count(key, "started") == 1
    assert effects.count(key, "done") == 1


async def test_handler_cancelled_by_server_shutdown_frees_the_key_at_once(
    sql_backend: Backend, tmp_path: Path
) -> None:
    effects = Effects(tmp_path / "effects.db")
    key = f"cancel-{uuid.uuid4().hex}"
    outcome: list[httpx.Response | httpx.TransportError] = []
    # A deploy stops the server; the request outlasts the graceful period and is cancelled.
    app = create_app(sql_backend.store, effects=effects, lease=30, delay=60)
    async with anyio.create_task_group() as group, serve(app, graceful=0.3) as url:

        async def doomed() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                try:
                    outcome.append(await client.post("/work", json={}, headers=headers_for(key)))
                except httpx.TransportError as exc:
                    outcome.append(exc)

        group.start_soon(doomed)
        await eventually(lambda: effects.count(key, "started") == 1)
    (lost,) = outcome
    assert isinstance(lost, httpx.TransportError) or lost.status_code == 500
    assert effects.count(key) == 0
    # The cancelled request released its claim: a new server runs the retry at once, where
    # a claim left behind would answer 409 for the 30 s of its lease.
    app = create_app(SQLStore(sql_backend.url), effects=effects, lease=30, delay=0)
    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        retry = await client.post("/work", json={}, headers=headers_for(key))
    assert retry.status_code == 200, retry.text
    assert not replayed(retry)
    assert effects.count(key, "started") == 2
    assert effects.count(key, "done") == 1


# --- the example service under faults, with several uvicorn workers ---------------------------

EXAMPLE = "example_app.app:create_app"


def example_workers(url: str, workers: int) -> ServerProcess:
    return ServerProcess(
        EXAMPLE, {"EXAMPLE_DATABASE_URL": url}, ready_path="/metrics", workers=workers
    )


async def post_tickets(server: ServerProcess, prefix: str, count: int) -> list[int]:
    async with server.client() as client:
        return [
            (
                await client.post(
                    "/tickets",
                    json={"title": f"{prefix} {index}"},
                    headers=headers_for(f"{prefix}-{index}"),
                )
            ).status_code
            for index in range(count)
        ]


async def test_the_example_service_on_four_workers_starts_on_a_fresh_database(
    fresh_database: str,
) -> None:
    # Every worker migrates in its lifespan, all at once: they take turns, and all start.
    with example_workers(fresh_database, 4) as server:
        server.wait_ready(60)
        await eventually(lambda: len(server.worker_pids()) == 4, within=30)
        statuses = await post_tickets(server, "fresh", 8)
        output = server.output()
    assert statuses == [201] * 8
    assert "Traceback" not in output, output
    assert "already exists" not in output, output


async def test_the_example_service_survives_a_postgresql_restart_without_a_500(
    own_postgresql: Any,
) -> None:
    # The database restarts under load: pooled connections die with it, in each worker's pool.
    # Keyed requests sent while it is down get 503; once it is back, nothing fails
    # (pool_pre_ping replaces them).
    url = own_postgresql.create_database("example")
    with example_workers(url, 2) as server:
        server.wait_ready(60)
        before = await post_tickets(server, "before", 12)
        own_postgresql.stop()
        own_postgresql.start()
        after = await post_tickets(server, "after", 24)
        output = server.output()
    assert before == [201] * 12
    assert 500 not in after, output
    assert after.count(201) == len(after), (after, output)


@pytest.mark.parametrize("database_url", ["mariadb"], indirect=True)
async def test_the_example_service_survives_its_database_connections_reset_without_a_500(
    fresh_database: str,
) -> None:
    # MariaDB: every pooled connection is closed under the service's feet (what a server
    # restart or a reset does to them; a MariaDB server of the test's own is not built here),
    # then the database answers again: no handler fails.
    with (
        TcpProxy(upstream_port(MARIADB_URL, DEFAULT_PORTS["mariadb"])) as proxy,
        example_workers(proxy.url(fresh_database), 2) as server,
    ):
        server.wait_ready(60)
        before = await post_tickets(server, "before", 12)
        proxy.cut(Cut.RESET)
        proxy.restore()
        after = await post_tickets(server, "after", 24)
        output = server.output()
    assert before == [201] * 12
    assert after == [201] * 24, (after, output)
