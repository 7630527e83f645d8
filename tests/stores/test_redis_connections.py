"""How a user connects RedisStore, each through redis-py: URLs with TLS, a Unix socket or
options; a Sentinel's client; timeouts and failures; and what redis-py's own instrumentation
sees of a request."""

from __future__ import annotations

import asyncio
import hashlib
import json
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis.asyncio
from opentelemetry.instrumentation.redis import RedisInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from idempotency_mw import ClaimOutcome, ConfigurationError, RedisStore, StoredResponse, StoreError
from idempotency_mw.operator.cli import main
from idempotency_mw.stores.redis import scripts
from idempotency_mw.values.metrics import key_hash
from tests.conftest import REDIS_URL, redis_prefix, require_redis_server, require_server
from tests.support.apps import client_for, make_app
from tests.support.redis_servers import RedisSentinel, RedisTLS

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

RESPONSE = StoredResponse(201, ((b"content-type", b"text/plain"),), b"made\x00")


@pytest.fixture(scope="module")
def redis_tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisTLS]:
    require_redis_server()
    server = RedisTLS.start(tmp_path_factory.mktemp("redis-tls"))
    try:
        yield server
    finally:
        server.stop()


async def round_trip(store: RedisStore, key: str = "k") -> None:
    """A first claim, its completion, then the replay of what it recorded."""
    await store.startup()
    claim = await store.claim("s", key, "f", ttl=60, lease=30)
    assert claim.token
    assert await store.complete("s", key, claim.token, RESPONSE, ttl=60)
    replay = await store.claim("s", key, "f", ttl=60, lease=30)
    assert replay.outcome is ClaimOutcome.REPLAY
    assert replay.response == RESPONSE


async def silent_server() -> tuple[asyncio.Server, int]:
    """A server on a free port that accepts connections and never answers."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(100):
            pass
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_rediss_url_talks_tls_and_checks_the_certificate(
    redis_tls: RedisTLS, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"test-idem-{uuid.uuid4().hex}:"
    store = RedisStore(redis_tls.tls_url, prefix=prefix)
    try:
        await round_trip(store)
    finally:
        await store.aclose()
    # The operator's command takes the same URL (in a thread: it runs its own event loop).
    command = ["stats", "--url", redis_tls.tls_url, "--prefix", prefix, "--json"]
    assert await asyncio.to_thread(main, command) == 0
    assert json.loads(capsys.readouterr().out)["by_status"]["completed"] == 1
    # Without the authority's certificate, the server's is not trusted.
    untrusting = RedisStore(f"rediss://127.0.0.1:{redis_tls.tls_port}/0")
    try:
        with pytest.raises(StoreError) as caught:
            await untrusting.claim("s", "k", "f", ttl=60, lease=30)
    finally:
        await untrusting.aclose()
    causes: list[BaseException] = []
    error: BaseException | None = caught.value
    while error is not None:
        causes.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(cause, ssl.SSLCertVerificationError) for cause in causes), causes


async def test_a_unix_socket_url(redis_tls: RedisTLS) -> None:
    store = RedisStore(f"unix://{redis_tls.socket}?db=2")
    try:
        await round_trip(store)
        assert (await store.client.client_info())["db"] == 2
    finally:
        await store.aclose()


async def test_options_in_the_url_reach_the_client() -> None:
    require_server(REDIS_URL)
    prefix = redis_prefix("connections")
    store = RedisStore(f"{REDIS_URL}?health_check_interval=5&protocol=3", prefix=prefix)
    heard: asyncio.Queue[str] = asyncio.Queue()
    feed = asyncio.ensure_future(store.watch_settlements(heard.put_nowait))
    try:
        await round_trip(store)
        assert int((await store.client.client_info())["resp"]) == 3
        assert isinstance(store.client, redis.asyncio.Redis)
        assert store.client.connection_pool.connection_kwargs["health_check_interval"] == 5
        # Settlements arrive as RESP3 pushes on the feed's connection.
        expected = key_hash("s", "fed")
        async with asyncio.timeout(10):
            while True:
                claim = await store.claim("s", "fed", "f", ttl=60, lease=30)
                assert claim.token
                assert await store.release("s", "fed", claim.token)
                try:
                    async with asyncio.timeout(0.5):
                        while await heard.get() != expected:
                            pass
                    break
                except TimeoutError:  # not subscribed yet: settle once more
                    pass
    finally:
        keys = [key async for key in store.client.scan_iter(match=f"{prefix}*")]
        if keys:
            await store.client.delete(*keys)
        await store.aclose()
        await feed


async def test_a_sentinel_client_is_used_as_given(redis_sentinel: RedisSentinel) -> None:
    watcher = redis.asyncio.Sentinel([redis_sentinel.sentinel_address])  # type: ignore[no-untyped-call, unused-ignore]
    master = watcher.master_for(redis_sentinel.name)
    store = RedisStore(client=master, prefix=f"test-idem-{uuid.uuid4().hex}:")
    try:
        assert repr(store) == f"RedisStore(sentinel service {redis_sentinel.name})"
        await round_trip(store)
        await store.aclose()
        assert await master.ping()  # the store did not close what it was given
    finally:
        await master.aclose()
        for client in watcher.sentinels:
            await client.aclose()


async def test_a_password_never_shows_in_the_store_or_its_errors() -> None:
    for url in ("redis://:hunter2@127.0.0.1:1/0", "redis://127.0.0.1:1/0?password=hunter2&db=0"):
        store = RedisStore(url, socket_timeout=1)
        try:
            with pytest.raises(StoreError) as caught:
                await store.claim("s", "k", "f", ttl=60, lease=30)
        finally:
            await store.aclose()
        assert "hunter2" not in repr(store)
        assert "hunter2" not in str(caught.value)
        assert "***" in str(caught.value)


async def test_a_refused_connection_is_a_store_error() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", socket_timeout=1)
    try:
        with pytest.raises(StoreError, match=r"connecting to 127\.0\.0\.1:1\b"):
            await store.claim("s", "k", "f", ttl=60, lease=30)
    finally:
        await store.aclose()


async def test_a_store_call_gives_up_within_socket_timeout_behind_a_silent_server() -> None:
    # A timed-out command is not sent again: that would double the wait.
    server, port = await silent_server()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5)
    took: list[float] = []

    async def claim_after(delay: float) -> None:
        await asyncio.sleep(delay)
        began = time.monotonic()
        with pytest.raises(StoreError, match="Timeout"):
            await store.claim("s", f"k{delay}", "fp", ttl=60, lease=30)
        took.append(time.monotonic() - began)

    try:
        await asyncio.gather(claim_after(0), claim_after(0.2))
    finally:
        await store.aclose()
        server.close()
        await server.wait_closed()
    assert max(took) < 0.9


def test_a_store_closed_in_one_event_loop_works_in_the_next() -> None:
    require_server(REDIS_URL)
    store = RedisStore(REDIS_URL, prefix=redis_prefix("connections"))

    async def claim_and_close(key: str) -> None:
        outcome = await store.claim("s", key, "fp", ttl=5, lease=5)
        assert outcome.token
        await store.release("s", key, outcome.token)
        await store.aclose()

    asyncio.run(claim_and_close("a"))
    asyncio.run(claim_and_close("b"))


async def test_socket_timeout_belongs_to_a_client_the_store_makes(
    redis_client: redis.asyncio.Redis,
) -> None:
    with pytest.raises(ConfigurationError, match="set it on your client"):
        RedisStore(client=redis_client, socket_timeout=1)


def _note_script(span: Span, instance: object, args: Sequence[Any], kwargs: object) -> None:
    """Keep the SHA-1 of the script an EVALSHA runs (the span's statement hides arguments)."""
    if args and args[0] == "EVALSHA":
        span.set_attribute("test.script", str(args[1]))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans of OpenTelemetry's redis instrumentation, while the test runs."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = RedisInstrumentor()
    instrumentor.instrument(tracer_provider=provider, request_hook=_note_script)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()
        provider.shutdown()


async def test_opentelemetry_sees_each_command_of_a_request(
    spans: InMemorySpanExporter,
) -> None:
    require_server(REDIS_URL)
    prefix = redis_prefix("connections")
    store = RedisStore(REDIS_URL, prefix=prefix)
    try:
        async with client_for(make_app(store)) as http:
            answer = await http.post("/tickets", json={}, headers={"Idempotency-Key": "k-1"})
        assert answer.status_code == 201
        ran = [
            (span.name, (span.attributes or {}).get("test.script"))
            for span in spans.get_finished_spans()
        ]
    finally:
        keys = [key async for key in store.client.scan_iter(match=f"{prefix}*")]
        if keys:
            await store.client.delete(*keys)
        await store.aclose()
    assert ran == [
        ("EVALSHA", hashlib.sha1(scripts.CLAIM.encode()).hexdigest()),
        ("EVALSHA", hashlib.sha1(scripts.COMPLETE.encode()).hexdigest()),
    ]


def test_hiredis_is_optional() -> None:
    require_server(REDIS_URL)
    # As if hiredis were not installed: redis-py parses replies itself.
    code = (
        "import asyncio, sys\n"
        "sys.modules['hiredis'] = None\n"
        "from idempotency_mw import RedisStore\n"
        "async def main():\n"
        f"    store = RedisStore({REDIS_URL!r}, prefix={redis_prefix('connections')!r})\n"
        "    claim = await store.claim('s', 'k', 'f', ttl=5, lease=5)\n"
        "    print(await store.release('s', 'k', claim.token))\n"
        "    await store.aclose()\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "True", done.stderr
