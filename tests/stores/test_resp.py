"""The pipelined Redis connection against a real Redis, and against servers that misbehave."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from idempotency_mw.exceptions import ConfigurationError, StoreError
from idempotency_mw.metrics import key_hash
from idempotency_mw.stores.redis.resp import Address, PipelinedConnection, pack
from idempotency_mw.stores.redis.store import RedisStore, Transport, _plain_address
from tests.conftest import REDIS_URL, redis_prefix, require_server

pytestmark = [pytest.mark.anyio, pytest.mark.servers]


def redis_address(db: int | None = None, **login: str) -> Address:
    """The test server's address; its database is the one REDIS_URL names unless ``db`` is given."""
    options = redis.asyncio.connection.parse_url(REDIS_URL)
    return Address(
        host=options.get("host", "localhost"),
        port=options.get("port", 6379),
        db=options.get("db", 0) if db is None else db,
        **login,
    )


@pytest.fixture
async def connection() -> AsyncIterator[PipelinedConnection]:
    require_server(REDIS_URL)
    made = PipelinedConnection(redis_address(), timeout=5)
    yield made
    await made.aclose()


def test_pack_writes_resp_bulk_strings() -> None:
    assert pack(["SET", "k", b"\x00\r\n", 12]) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\n\x00\r\n\r\n$2\r\n12\r\n"
    )


async def test_concurrent_commands_each_get_their_own_reply(
    connection: PipelinedConnection,
) -> None:
    replies = await asyncio.gather(*(connection.execute("ECHO", f"n{i}") for i in range(500)))
    assert replies == [f"n{i}".encode() for i in range(500)]


async def test_all_commands_share_one_connection(
    connection: PipelinedConnection, redis_client: redis.asyncio.Redis
) -> None:
    ids = await asyncio.gather(*(connection.execute("CLIENT", "ID") for _ in range(50)))
    assert len(set(ids)) == 1


async def test_error_replies_raise_and_leave_the_connection_usable(
    connection: PipelinedConnection,
) -> None:
    with pytest.raises(NoScriptError):
        await connection.execute("EVALSHA", "0" * 40, 0)
    with pytest.raises(ResponseError, match="unknown command"):
        await connection.execute("NO-SUCH-COMMAND")
    assert await connection.execute("PING") == b"PONG"


async def test_a_connection_killed_between_commands_is_replaced(
    connection: PipelinedConnection, redis_client: redis.asyncio.Redis
) -> None:
    first = await connection.execute("CLIENT", "ID")
    await redis_client.client_kill_filter(_id=first)
    await asyncio.sleep(0.05)
    assert await connection.execute("CLIENT", "ID") != first


async def test_a_command_in_flight_on_a_killed_connection_is_sent_again(
    connection: PipelinedConnection, redis_client: redis.asyncio.Redis
) -> None:
    queue = f"test-resp-{uuid.uuid4().hex}"
    first = await connection.execute("CLIENT", "ID")
    waiting = asyncio.ensure_future(connection.execute("BLPOP", queue, 5))
    await asyncio.sleep(0.1)
    await redis_client.client_kill_filter(_id=first)
    await asyncio.sleep(0.1)
    assert not waiting.done()  # sent again on a new connection, blocked there
    await redis_client.rpush(queue, b"item")
    assert await waiting == [queue.encode(), b"item"]


async def test_a_slow_reply_times_out_and_what_queued_behind_it_is_sent_again() -> None:
    require_server(REDIS_URL)
    connection = PipelinedConnection(redis_address(), timeout=0.3)
    try:
        queue = f"test-resp-{uuid.uuid4().hex}"
        began = time.monotonic()
        blocked = asyncio.ensure_future(connection.execute("BLPOP", queue, 2))
        behind = asyncio.ensure_future(connection.execute("PING"))
        with pytest.raises(RedisTimeoutError):
            await blocked
        assert time.monotonic() - began < 1.5
        assert await behind == b"PONG"
    finally:
        await connection.aclose()


async def test_database_and_login_come_from_the_address(redis_client: redis.asyncio.Redis) -> None:
    user, password = f"idem-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.acl_setuser(
        user, enabled=True, passwords=[f"+{password}"], keys="*", commands=["+@all"]
    )
    key = f"test-resp-{uuid.uuid4().hex}"
    connection = PipelinedConnection(
        redis_address(db=3, username=user, password=password), timeout=5
    )
    wrong = PipelinedConnection(redis_address(username=user, password="wrong"), timeout=5)
    try:
        assert await connection.execute("ACL", "WHOAMI") == user.encode()
        await connection.execute("SET", key, b"v", "EX", 60)
        assert await redis_client.exists(key) == 0
        await redis_client.execute_command("SELECT", 3)  # type: ignore[no-untyped-call]
        assert await redis_client.get(key) == b"v"
        with pytest.raises(ResponseError, match="WRONGPASS"):
            await wrong.execute("PING")
    finally:
        await redis_client.delete(key)
        await redis_client.execute_command("SELECT", redis_address().db)  # type: ignore[no-untyped-call]
        await redis_client.acl_deluser(user)
        await connection.aclose()
        await wrong.aclose()


def test_a_store_closed_in_one_event_loop_works_in_the_next() -> None:
    require_server(REDIS_URL)
    store = RedisStore(REDIS_URL, prefix=redis_prefix("resp"))

    async def claim_and_close(key: str) -> None:
        outcome = await store.claim("s", key, "fp", ttl=5, lease=5)
        assert outcome.token
        await store.aclose()

    asyncio.run(claim_and_close("a"))
    asyncio.run(claim_and_close("b"))


async def serve(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> tuple[asyncio.Server, int]:
    """A server on a free port that answers every connection with ``handle``, then closes it."""

    async def handle_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle_and_close, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_an_unreadable_reply_fails_the_command_instead_of_hanging() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"?this is not RESP\r\n")
        await writer.drain()
        await reader.read(100)

    server, port = await serve(garbage)
    connection = PipelinedConnection(Address(host="127.0.0.1", port=port), timeout=2)
    try:
        with pytest.raises(RedisConnectionError, match="unreadable"):
            await connection.execute("PING")
    finally:
        await connection.aclose()
        server.close()
        await server.wait_closed()


async def test_a_server_that_never_answers_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(100):  # until the client gives up and closes
            pass

    server, port = await serve(silent)
    # Made from a plain URL, the store talks through the pipelined connection.
    store = RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(StoreError, match=r"within 0\.3 s"):
            await store.claim("s", "k", "fp", ttl=60, lease=30)
        assert time.monotonic() - began < 2
    finally:
        await store.aclose()
        server.close()
        await server.wait_closed()


async def test_a_connection_whose_caller_gave_up_fails_without_an_unretrieved_error() -> None:
    # The store's operation timeout can end the wait for a connection just before the
    # connection's own timeout fails it: nobody awaits that failure any more, and asyncio
    # would report an exception that was never retrieved.
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(100):
            pass

    reported: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
    server, port = await serve(silent)
    # With a password, opening waits for the server to answer the login.
    address = Address(host="127.0.0.1", port=port, password="secret")
    connection = PipelinedConnection(address, timeout=0.2)
    try:
        gave_up = False
        try:
            async with asyncio.timeout(0.05):
                await connection.execute("PING")
        except TimeoutError:  # not kept: its traceback would keep the connection's task
            gave_up = True
        assert gave_up
        await asyncio.sleep(0.4)  # the connection's own timeout has failed it meanwhile
        del connection
        gc.collect()
        await asyncio.sleep(0)
    finally:
        asyncio.get_running_loop().set_exception_handler(None)
        server.close()
        await server.wait_closed()
    assert reported == []


async def test_a_refused_connection_is_a_store_error() -> None:
    server, port = await serve(lambda reader, writer: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=1)
    with pytest.raises(StoreError, match="could not connect"):
        await store.claim("s", "k", "fp", ttl=60, lease=30)
    await store.aclose()


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis://h/3", Address(host="h", db=3)),
        ("redis://u:p@h:7000/1", Address(host="h", port=7000, db=1, username="u", password="p")),
        ("unix:///run/redis.sock?db=2", Address(path="/run/redis.sock", db=2)),
        ("rediss://h:6380/0", None),  # TLS: redis-py
        ("redis://h/0?protocol=3", None),  # any option: redis-py
    ],
)
def test_only_plain_urls_get_the_pipelined_connection(url: str, address: Address | None) -> None:
    assert _plain_address(url) == address


@pytest.mark.parametrize("url", ["rediss://h:6380/0", "redis://h/0?protocol=3"])
def test_a_url_the_pipelined_transport_cannot_serve_is_refused_until_redis_py_is_chosen(
    url: str,
) -> None:
    with pytest.raises(ConfigurationError, match="transport='redis-py'"):
        RedisStore(url)
    with pytest.raises(ConfigurationError, match="transport='redis-py'"):
        RedisStore(url, transport="pipelined")
    assert RedisStore(url, transport="redis-py").client is not None


async def test_the_transport_is_chosen_for_urls_only(redis_client: redis.asyncio.Redis) -> None:
    with pytest.raises(ConfigurationError, match="url="):
        RedisStore(client=redis_client, transport="pipelined")
    with pytest.raises(ConfigurationError, match="cluster=True"):
        RedisStore(REDIS_URL, cluster=True, transport="pipelined")
    with pytest.raises(ConfigurationError, match="transport must be"):
        RedisStore(REDIS_URL, transport="hiredis")  # type: ignore[arg-type]


async def test_the_pipelined_transport_builds_no_redis_py_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Requests and the settlement feed both go through connections of the store's own.
    require_server(REDIS_URL)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a redis-py client was built")

    monkeypatch.setattr(redis.asyncio.Redis, "from_url", refuse)
    store = RedisStore(REDIS_URL, prefix=redis_prefix("resp"))
    heard: asyncio.Queue[str] = asyncio.Queue()
    feed = asyncio.ensure_future(store.watch_settlements(heard.put_nowait))
    try:
        await store.startup()
        await asyncio.sleep(0.2)  # subscribed by now
        claim = await store.claim("s", "k", "fp", ttl=5, lease=5)
        assert claim.token is not None
        assert await store.complete("s", "k", claim.token, None, ttl=5)
        async with asyncio.timeout(5):
            assert await heard.get() == key_hash("s", "k")
    finally:
        await store.aclose()
        await feed


@pytest.mark.parametrize("transport", ["pipelined", "redis-py"])
async def test_a_store_call_gives_up_within_socket_timeout_behind_a_silent_server(
    transport: Transport,
) -> None:
    # The second call is sent behind the first on the shared connection; when the first times
    # out and drops it, the second is sent again on a new one, within what is left of its own
    # socket_timeout (before, it waited for a whole socket_timeout more).
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(100):
            pass

    server, port = await serve(silent)
    store = RedisStore(f"redis://127.0.0.1:{port}/0", transport=transport, socket_timeout=1)
    took: list[float] = []

    async def claim_after(delay: float) -> None:
        await asyncio.sleep(delay)
        began = time.monotonic()
        with pytest.raises(StoreError):
            await store.claim("s", f"k{delay}", "fp", ttl=60, lease=30)
        took.append(time.monotonic() - began)

    try:
        await asyncio.gather(claim_after(0), claim_after(0.5))
    finally:
        await store.aclose()
        server.close()
        await server.wait_closed()
    assert max(took) < 1.25


@asynccontextmanager
async def flooding(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    *,
    reply_timeout: float,
) -> AsyncIterator[PipelinedConnection]:
    """A connection to a server that answers with ``handle``, 150 commands of 200 KB sent
    on it at once; the block ends them all."""
    server, port = await serve(handle)
    connection = PipelinedConnection(Address(host="127.0.0.1", port=port), timeout=reply_timeout)
    value = b"x" * 200_000
    sends = [asyncio.ensure_future(connection.execute("SET", "k", value)) for _ in range(150)]
    try:
        yield connection
    finally:
        for send in sends:
            send.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        await connection.aclose()
        server.close()
        await server.wait_closed()


async def test_a_server_that_reads_slowly_lets_one_waiting_command_through_at_a_time() -> None:
    # Each time the socket drains a little, one waiting command goes out and fills it again;
    # the others keep waiting instead of all writing at once.
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(1000):
            if not await reader.read(65_536):
                return
            await asyncio.sleep(0.005)

    largest = 0
    async with flooding(slow, reply_timeout=5) as connection:
        for _ in range(100):
            await asyncio.sleep(0.01)
            protocol = connection._protocol
            if protocol is not None and protocol.transport is not None:
                largest = max(largest, protocol.transport.get_write_buffer_size())
    assert 0 < largest < 1_000_000


async def test_commands_wait_while_the_server_reads_nothing() -> None:
    # A server that stops reading fills the socket; what the callers send meanwhile waits
    # instead of piling up in the connection's write buffer.
    async def deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3)

    async with flooding(deaf, reply_timeout=2) as connection:
        await asyncio.sleep(0.5)
        transport = connection._protocol.transport if connection._protocol else None
        assert transport is not None
        assert transport.get_write_buffer_size() < 1_000_000
