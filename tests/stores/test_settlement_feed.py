"""Settlement feeds: PostgreSQL LISTEN/NOTIFY and Redis pub/sub tell every worker which records
were settled, so that a duplicate waiting in another worker is woken at once."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from asgi_lifespan import LifespanManager
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import RedisStore, SQLStore, Store, StoredResponse
from idempotency_mw.stores.base import SettlementFeed
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.exceptions import SettlementFeedUnsupported
from idempotency_mw.values.metrics import key_hash
from tests.conftest import POSTGRESQL_URL, built_store, fresh_sql_store, require_server
from tests.reliability.test_workers import logged, running_workers
from tests.support.apps import client_for, make_app
from tests.support.faults import ServerProcess, StoreServer
from tests.support.redis_servers import RedisCluster, redis_cli
from tests.support.reliability_app import Effects

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

RESPONSE = StoredResponse(201, ((b"content-type", b"text/plain"),), b"made")
#: How the listening connection of a SQLStore shows in pg_stat_activity.
PG_LISTENER = "idempotency-mw settlements"
#: Every way to build a store that has a feed.
FEEDS = [
    "postgresql-url",
    "postgresql-engine",
    "redis-url",
    "redis-client",
    "redis-cluster-url",
    "redis-cluster-client",
    "redis-sentinel-client",
]


class Heard:
    """The digests a feed reported, for a test to wait on."""

    def __init__(self) -> None:
        self.digests: list[str] = []
        self._news = anyio.Event()

    def __call__(self, digest: str) -> None:
        self.digests.append(digest)
        self._news.set()

    async def heard(self, digest: str) -> None:
        while digest not in self.digests:
            self._news = anyio.Event()
            await self._news.wait()


@asynccontextmanager
async def watching(store: Store) -> AsyncIterator[Heard]:
    """``store``'s feed, watched in the background while the block runs, and listening."""
    assert isinstance(store, SettlementFeed)
    heard = Heard()
    async with anyio.create_task_group() as group:
        group.start_soon(store.watch_settlements, heard)
        await until_listening(store, heard)
        yield heard
        group.cancel_scope.cancel()


async def settle(store: Store, key: str, *, release: bool = False) -> str:
    """Claim ``key`` and complete (or release) it; its digest."""
    claim = await store.claim("feed", key, "f", ttl=60, lease=60)
    assert claim.token is not None
    if release:
        assert await store.release("feed", key, claim.token)
    else:
        assert await store.complete("feed", key, claim.token, RESPONSE, ttl=60)
    return key_hash("feed", key)


async def until_listening(store: Store, heard: Heard, *, within: float = 20) -> None:
    """Settle probe records until the feed reports one: it listens (again) from then on.

    A probe settled while the store's server is down fails; the next one is tried.
    """
    with anyio.fail_after(within):
        while True:
            try:
                digest = await settle(store, f"probe-{uuid.uuid4().hex}")
            except Exception:  # the server is not back yet
                await anyio.sleep(0.1)
                continue
            with anyio.move_on_after(0.2):
                await heard.heard(digest)
                return


@pytest.fixture(params=FEEDS)
async def feed_store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    async with built_store(request.param, request, settlement_notices=True) as store:
        yield store


async def test_the_feed_reports_completed_and_released_records(feed_store: Store) -> None:
    async with watching(feed_store) as heard:
        completed = await settle(feed_store, "completed")
        released = await settle(feed_store, "released", release=True)
        claim = await feed_store.claim("feed", "not-mine", "f", ttl=60, lease=60)
        assert claim.token is not None
        assert not await feed_store.complete("feed", "not-mine", "other token", RESPONSE, ttl=60)
        assert not await feed_store.release("feed", "not-mine", "other token")
        assert await feed_store.complete("feed", "not-mine", claim.token, RESPONSE, ttl=60)
        not_mine = key_hash("feed", "not-mine")
        with anyio.fail_after(5):
            for digest in (completed, released, not_mine):
                await heard.heard(digest)
        # One record's news arrives in order: the calls that changed nothing announced nothing.
        assert heard.digests.count(not_mine) == 1


async def test_closing_the_store_ends_the_watch(feed_store: Store) -> None:
    assert isinstance(feed_store, SettlementFeed)
    heard = Heard()
    ended = anyio.Event()

    async def watch() -> None:
        await feed_store.watch_settlements(heard)
        ended.set()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        await until_listening(feed_store, heard)
        await feed_store.aclose()
        with anyio.fail_after(5):
            await ended.wait()


async def test_a_release_after_a_fenced_commit_is_reported() -> None:
    require_server(POSTGRESQL_URL)
    store = await fresh_sql_store(POSTGRESQL_URL, settlement_notices=True)
    engine = create_async_engine(async_url(POSTGRESQL_URL))
    try:
        async with watching(store) as heard:
            claim = await store.claim("feed", "fenced", "f", ttl=60, lease=60)
            assert claim.token is not None
            statement, params = store.fence_statement("feed", "fenced", claim.token, 60)
            async with engine.begin() as conn:
                assert (await conn.execute(statement, params)).rowcount == 1
            assert await store.release("feed", "fenced", claim.token)
            with anyio.fail_after(5):
                await heard.heard(key_hash("feed", "fenced"))
    finally:
        await engine.dispose()
        await store.aclose()


@pytest.mark.parametrize("path", ["sqlite-url", "sqlite-engine", "mariadb-url", "mariadb-engine"])
async def test_stores_without_notifications_say_so(
    path: str, request: pytest.FixtureRequest
) -> None:
    async with built_store(path, request) as store:
        assert isinstance(store, SettlementFeed)
        with pytest.raises(SettlementFeedUnsupported, match="poll"):
            await store.watch_settlements(Heard())
    assert not isinstance(MemoryStore(), SettlementFeed)


async def test_postgresql_through_another_driver_says_so() -> None:
    require_server(POSTGRESQL_URL)
    engine = create_async_engine(async_url(POSTGRESQL_URL).set(drivername="postgresql+psycopg"))
    try:
        with pytest.raises(SettlementFeedUnsupported, match="psycopg"):
            await SQLStore(engine).watch_settlements(Heard())
    finally:
        await engine.dispose()


# ------------------------------------------------------------ a lost connection is opened again


async def kill_postgresql_listeners() -> int:
    """End the backends of the feeds' listening connections on the test database."""
    engine = create_async_engine(async_url(POSTGRESQL_URL))
    try:
        async with engine.connect() as conn:
            killed = await conn.scalar(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name = :name"
                ),
                {"name": PG_LISTENER},
            )
    finally:
        await engine.dispose()
    return int(killed or 0)


async def kill_redis_subscribers(*ports: int) -> int:
    """``CLIENT KILL TYPE pubsub`` on servers of the test's own; how many were killed."""
    return sum(int(redis_cli(port, "CLIENT", "KILL", "TYPE", "pubsub")) for port in ports)


@pytest.mark.parametrize("path", ["postgresql-url", "postgresql-engine"])
async def test_a_killed_postgresql_listener_listens_again(
    path: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        built_store(path, request, settlement_notices=True) as store,
        watching(store) as heard,
    ):
        assert await kill_postgresql_listeners() >= 1
        await until_listening(store, heard)
    assert "lost its connection" in caplog.text


async def test_a_redis_feed_listens_again_after_its_server_restarts(
    own_redis: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "idempotency_mw")
    store = RedisStore(own_redis.url, socket_timeout=2)
    try:
        async with watching(store) as heard:
            assert await kill_redis_subscribers(own_redis.port) == 1
            await until_listening(store, heard)
            # Down long enough for redis-py to give up: the feed opens its connection again.
            own_redis.stop()
            await anyio.sleep(1)
            own_redis.start()
            await until_listening(store, heard)
    finally:
        await store.aclose()
    assert "lost its connection" in caplog.text


async def test_a_killed_cluster_subscriber_listens_again(redis_cluster: RedisCluster) -> None:
    store = RedisStore(redis_cluster.url, cluster=True, prefix=f"test-{uuid.uuid4().hex}:")
    try:
        async with watching(store) as heard:
            live = [node.port for node in redis_cluster.nodes if node.alive()]
            assert await kill_redis_subscribers(*live) >= 1
            await until_listening(store, heard)
    finally:
        await store.aclose()


# ------------------------------------------------------------------------------ the middleware


async def feed_listeners(server: StoreServer) -> int:
    """How many feeds listen on a server of the test's own."""
    if server.url.startswith("redis"):
        return len(redis_cli(server.port, "CLIENT", "LIST", "TYPE", "pubsub").splitlines())
    engine = create_async_engine(async_url(server.url))
    try:
        async with engine.connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name"
            return int(await conn.scalar(text(query), {"name": PG_LISTENER}) or 0)
    finally:
        await engine.dispose()


async def until_listeners(server: StoreServer, count: int) -> None:
    with anyio.fail_after(10):
        while True:
            if await feed_listeners(server) == count:
                return
            await anyio.sleep(0.05)


@pytest.mark.parametrize("lifespan", [True, False], ids=["closes-store", "leaves-store"])
async def test_the_middleware_listens_once_a_request_waits_and_stops_at_shutdown(
    own_store: StoreServer, lifespan: bool
) -> None:
    store: Store = (
        RedisStore(own_store.url)
        if own_store.url.startswith("redis")
        else SQLStore(own_store.url, settlement_notices=True)
    )
    # lifespan=False: the store outlives the app (the service closes it), its feed does not.
    app = make_app(store, wait=5, lifespan=lifespan)
    gate = app.state.gate
    answers: list[httpx.Response] = []
    async with LifespanManager(app), client_for(app) as client:

        async def post() -> None:
            answers.append(await client.post("/held", headers={"Idempotency-Key": "k"}))

        async with anyio.create_task_group() as group:
            group.start_soon(post)
            await gate.entered.wait()
            assert await feed_listeners(own_store) == 0  # nobody waits yet
            group.start_soon(post)
            await until_listeners(own_store, 1)
            gate.opened.set()
        assert [answer.status_code for answer in answers] == [200, 200]
        assert await feed_listeners(own_store) == 1  # one per middleware, for later waiters
    try:
        await until_listeners(own_store, 0)
    finally:
        await store.aclose()


# ---------------------------------------------------------- a waiter in another worker process


@pytest.fixture(params=["postgresql", "redis", "redis-cluster"])
async def feed_backend(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[str, dict[str, str], Callable[[], Awaitable[int]]]]:
    """A store URL for the workers, the settings they need, and how to kill their listeners."""
    if request.param == "postgresql":
        require_server(POSTGRESQL_URL)
        await (await fresh_sql_store(POSTGRESQL_URL)).aclose()
        yield POSTGRESQL_URL, {}, kill_postgresql_listeners
    elif request.param == "redis":
        server: StoreServer = request.getfixturevalue("own_redis")
        yield server.url, {}, lambda: kill_redis_subscribers(server.port)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        live = [node.port for node in cluster.nodes if node.alive()]
        yield cluster.url, {"RELIABILITY_REDIS_CLUSTER": "1"}, lambda: kill_redis_subscribers(*live)


async def answer_lag(
    client: httpx.AsyncClient, first: ServerProcess, second: ServerProcess, effects: Effects
) -> float:
    """Seconds from the end of the first request's handler to the answer of its duplicate,
    which waited for it in the other worker."""
    key = f"woken-{uuid.uuid4().hex}"
    answers: dict[str, httpx.Response] = {}

    async def post(name: str, server: ServerProcess) -> None:
        answers[name] = await client.post(
            server.url + "/work", content=b"same", headers={"Idempotency-Key": key}
        )

    async with anyio.create_task_group() as group:
        group.start_soon(post, "first", first)
        await logged(effects, key, "started")  # the first holds the key
        await post("duplicate", second)
        woken = time.monotonic()  # one clock for every process of the machine
    (run,) = effects.runs(key)
    assert run.ended is not None
    assert answers["first"].status_code == answers["duplicate"].status_code == 200
    assert "idempotent-replayed" not in answers["first"].headers
    assert answers["duplicate"].headers["idempotent-replayed"] == "true"
    return woken - run.ended


async def test_a_waiter_in_another_worker_is_woken_by_the_store(
    feed_backend: tuple[str, dict[str, str], Callable[[], Awaitable[int]]], tmp_path: Path
) -> None:
    url, settings, kill_listeners = feed_backend
    # The first request ends 1.7 s into the duplicate's wait, between its polls at 1.26 s and
    # 2.54 s (20 ms doubling, never capped here): only the store's news can wake it in time.
    settings |= {
        "RELIABILITY_DELAY": "2",
        "RELIABILITY_WAIT": "10",
        "RELIABILITY_LEASE": "10",
        "RELIABILITY_POLL_CAP": "60",
    }
    with running_workers(url, tmp_path, 2, **settings) as (first, second):
        effects = Effects(tmp_path / "effects.db")
        async with httpx.AsyncClient(timeout=30) as client:
            assert await answer_lag(client, first, second, effects) < 0.2
            assert await kill_listeners() >= 1
            # The duplicate's worker listens again, and wakes its next waiter as quickly.
            assert await answer_lag(client, first, second, effects) < 0.2


async def test_postgresql_announces_settlements_only_when_asked() -> None:
    require_server(POSTGRESQL_URL)
    store = await fresh_sql_store(POSTGRESQL_URL)
    try:
        with pytest.raises(SettlementFeedUnsupported, match="settlement_notices=True"):
            await store.watch_settlements(Heard())
    finally:
        await store.aclose()
