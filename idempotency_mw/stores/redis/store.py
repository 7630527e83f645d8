"""RedisStore: idempotency records as Redis hashes, every state change one Lua script."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar, cast

import redis
import redis.asyncio
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool, UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from idempotency_mw._backoff import Backoff
from idempotency_mw._redis_client import binary_client
from idempotency_mw._urls import shown_url
from idempotency_mw.exceptions import ConfigurationError, store_error
from idempotency_mw.metrics import key_hash
from idempotency_mw.records import (
    Claim,
    ClaimOutcome,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)
from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.stores.feed import CHECK_AFTER, Feeds
from idempotency_mw.stores.redis import scripts, subscriber
from idempotency_mw.stores.redis.admin import RedisInspection
from idempotency_mw.stores.redis.resp import Address, Arg, PipelinedConnection
from idempotency_mw.stores.redis.scripts import Script

T = TypeVar("T")


#: A client RedisStore takes: one server (standalone, or a Sentinel's master) or a cluster.
AsyncClient = redis.asyncio.Redis | RedisCluster
#: How the store talks to Redis when it makes the connection from a URL.
Transport = Literal["pipelined", "redis-py"]
#: The pause before redis-py sends a command again on a new connection.
_RESEND = Backoff(first=0.005, cap=0.005)


class _Pauses(AbstractBackoff):
    """redis-py's retry pauses, drawn from the package's one backoff."""

    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return self._backoff.delay(max(failures - 1, 0))


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class RedisStore(RedisInspection, ClaimsWithToken):
    """Idempotency records in Redis, one hash per record.

    Give either ``url`` or ``client``. From a URL, ``transport`` says how the store talks to
    Redis: ``"pipelined"`` (the default) is one connection that every request shares, for a
    ``redis://`` or ``unix://`` URL with nothing beyond host, port, database and login;
    ``"redis-py"`` is a redis-py client, for any URL redis-py takes (``rediss://``, options in
    the query string). ``cluster=True`` is a redis-py ``RedisCluster`` that finds the other
    nodes from the one the URL names (its transport is redis-py). ``socket_timeout`` seconds
    bound every call of the store, connecting and any resend included, and the store closes
    what it opened in :meth:`aclose`. A given ``client`` (``redis.asyncio.Redis``, a
    Sentinel's ``master_for(...)``, or ``redis.asyncio.RedisCluster``, with
    ``decode_responses=False``) is used as it is and never closed. Keys are ``prefix`` plus a
    digest of scope and key in braces, so a record lives in one cluster slot.

    The store offers a :class:`~idempotency_mw.stores.base.SettlementFeed`: the scripts that
    complete and release a record PUBLISH its digest on the channel ``<prefix>settled``, and
    :meth:`watch_settlements` subscribes to it on a connection of its own.

    The store is :class:`~idempotency_mw.stores.base.Inspectable` (the CLI and the panel).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: AsyncClient | None = None,
        cluster: bool = False,
        transport: Transport | None = None,
        prefix: str = "idem:",
        socket_timeout: float = 5.0,
    ) -> None:
        if cluster and url is None:
            raise ConfigurationError("cluster=True applies to url=; pass a RedisCluster client")
        if transport not in (None, "pipelined", "redis-py"):
            raise ConfigurationError("transport must be 'pipelined' or 'redis-py'")
        if transport is not None and url is None:
            raise ConfigurationError("transport= applies to url=; a given client is redis-py")
        if cluster and transport == "pipelined":
            raise ConfigurationError("cluster=True talks through redis-py: drop transport=")

        def connect(address: str) -> AsyncClient:
            options: dict[str, Any] = {
                "socket_timeout": socket_timeout,
                "socket_connect_timeout": socket_timeout,
                "decode_responses": False,
            }
            if cluster:
                return RedisCluster.from_url(address, **options)
            # One retry on a broken connection: a pooled connection that died during an
            # outage fails once, and every script is safe to run again with its token.
            return redis.asyncio.Redis.from_url(
                address,
                retry=Retry(_Pauses(_RESEND), 1),
                retry_on_error=[RedisConnectionError],
                **options,
            )

        self._connect = connect
        self._prefix = prefix
        self._timeout = socket_timeout
        self._channel = f"{prefix}settled"
        self._feeds = Feeds()
        self._address: Address | None = None
        self._pipe: PipelinedConnection | None = None
        self._client_of_own: AsyncClient | None = None
        self._cluster: RedisCluster | None = None
        if client is None and url is not None and not cluster and transport != "redis-py":
            self._address = _plain_address(url)
            if self._address is None:
                raise ConfigurationError(
                    "the pipelined transport takes a redis:// or unix:// URL with host, port, "
                    "database and login only: for TLS or URL options pass transport='redis-py'"
                )
            self._pipe = PipelinedConnection(self._address, timeout=socket_timeout)
            self._url: str | None = url
            self._owns_client = True
            self._where = shown_url(url)
            return
        made, self._owns_client = binary_client(
            url, client, connect, owner="RedisStore", holds="records hold binary response bodies"
        )
        # binary_client returns what it was given or what connect() made: one of these.
        self._client_of_own = cast(AsyncClient, made)
        # Known once: isinstance() on redis-py's generic client class costs microseconds.
        self._cluster = made if isinstance(made, RedisCluster) else None
        self._url = url
        self._where = shown_url(url) if url is not None else _address_of(self._client_of_own)

    def __repr__(self) -> str:
        return f"RedisStore({self._where})"

    @property
    def client(self) -> AsyncClient:
        """A redis-py client on the store's server, for inspecting records: the store's own,
        or with the pipelined transport one made on first use (and closed by :meth:`aclose`);
        the store itself never uses it then."""
        if self._client_of_own is None:
            assert self._url is not None  # only a store made from a URL has no client yet
            self._client_of_own = self._connect(self._url)
        return self._client_of_own

    @property
    def prefix(self) -> str:
        """The prefix of every Redis key the store writes."""
        return self._prefix

    def redis_key(self, scope: str, key: str) -> str:
        """The Redis key of the record of ``(scope, key)``: a digest, never the raw key."""
        digest = hashlib.sha256()
        for part in (scope, key):
            encoded = part.encode("utf-8", "surrogatepass")
            digest.update(len(encoded).to_bytes(8, "big"))
            digest.update(encoded)
        return f"{self._prefix}{{{digest.hexdigest()}}}"

    async def _claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        token: str,
        binding: str = "",
        durable: bool = True,  # ignored: every step is as durable as this store can be
    ) -> Claim:
        reply = await self._run(
            "claim",
            scripts.CLAIM,
            self.redis_key(scope, key),
            fingerprint,
            token,
            _ms(ttl),
            _ms(lease),
            binding,
        )
        outcome = ClaimOutcome(_text(reply[0]))
        if outcome is ClaimOutcome.ACQUIRED:
            return Claim(outcome, token=token)
        if outcome is ClaimOutcome.REPLAY:
            status, headers, body = reply[1:4]
            response = StoredResponse(int(status), unpack_headers(bytes(headers)), bytes(body))
            return Claim(outcome, response=response)
        return Claim(outcome)

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        return bool(
            await self._run("renew", scripts.RENEW, self.redis_key(scope, key), token, _ms(lease))
        )

    async def complete(
        self,
        scope: str,
        key: str,
        token: str,
        response: StoredResponse | None,
        *,
        ttl: float,
        durable: bool = True,
    ) -> bool:
        args: list[Arg] = [token, _ms(ttl), self._channel, key_hash(scope, key)]
        if response is None:
            args.append(RecordStatus.UNREPLAYABLE.value)
        else:
            args += [
                RecordStatus.COMPLETED.value,
                response.status,
                pack_headers(response.headers),
                response.body,
            ]
        return bool(
            await self._run("complete", scripts.COMPLETE, self.redis_key(scope, key), *args)
        )

    async def release(self, scope: str, key: str, token: str) -> bool:
        return bool(
            await self._run(
                "release",
                scripts.RELEASE,
                self.redis_key(scope, key),
                token,
                self._channel,
                key_hash(scope, key),
            )
        )

    async def purge_expired(self, *, batch_size: int) -> int | None:
        """Nothing to do: Redis deletes records when their TTL ends."""
        return None

    async def startup(self) -> None:
        """Check that Redis answers and load the scripts (raises StoreError when it does not)."""

        async def check() -> None:
            if self._pipe is not None:
                await self._pipe.execute("PING")
                for script in scripts.ALL:
                    await self._pipe.execute("SCRIPT", "LOAD", script.source)
                return
            # Through redis-py, which sends these to every node of a cluster.
            await self.client.ping()
            for script in scripts.ALL:
                await self.client.script_load(script.source)

        await self._call("startup check", check)

    async def watch_settlements(self, on_settled: Callable[[str], None]) -> None:
        """Pass the digest of each record any worker settles to ``on_settled``, until cancelled
        or closed (see :class:`~idempotency_mw.stores.base.SettlementFeed`).

        One connection of its own subscribes to ``<prefix>settled``, opened here and again
        after a loss; on a cluster, to one node (every node relays a PUBLISH).
        """
        if self._address is not None:
            address = self._address

            def relay(digest: bytes) -> None:
                on_settled(_text(digest))

            await self._feeds.run(
                repr(self),
                lambda: subscriber.listen(
                    address, self._channel, relay, reply_timeout=self._timeout
                ),
            )
            return
        await self._feeds.run(repr(self), lambda: self._listen(on_settled))

    async def _listen(self, on_settled: Callable[[str], None]) -> None:
        """Relay the channel's messages until the connection is lost (then raise), pinging it
        after ``CHECK_AFTER`` seconds of silence."""
        pool = None
        if self._cluster is not None:
            await self._cluster.initialize()
            node = self._cluster.get_random_node()
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            pubsub = PubSub(pool)
        else:
            pubsub = self.client.pubsub()
        try:
            async with asyncio.timeout(self._timeout):
                await pubsub.subscribe(self._channel)
            pinged = False
            while True:
                message = await pubsub.get_message(timeout=CHECK_AFTER)
                if message is None:
                    if pinged:
                        raise RedisConnectionError("no answer to a ping within the check")
                    await pubsub.ping()
                    pinged = True
                    continue
                pinged = False
                if message["type"] == "message":
                    on_settled(_text(message["data"]))
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            if pool is not None:
                await pool.disconnect()

    async def aclose(self) -> None:
        await self._feeds.close()
        if self._pipe is not None:
            await self._pipe.aclose()
        if self._owns_client and self._client_of_own is not None:
            await self._call("close", self._client_of_own.aclose)

    async def _run(self, operation: str, script: Script, redis_key: str, *args: Arg) -> Any:
        """Run ``script`` on one key; EVALSHA, or EVAL (which loads it) when Redis lacks it."""

        async def run() -> Any:
            if self._cluster is not None:
                # redis-py's cluster client, first used by many tasks at once, can hand one of
                # them a connection another is still setting up: set it up first (once).
                await self._cluster.initialize()
            try:
                return await self._execute("EVALSHA", script.sha, 1, redis_key, *args)
            except NoScriptError:
                return await self._execute("EVAL", script.source, 1, redis_key, *args)

        return await self._call(operation, run)

    def _execute(self, *args: Arg) -> Awaitable[Any]:
        if self._pipe is not None:
            return self._pipe.execute(*args)
        return self.client.execute_command(*args)

    async def _call(self, operation: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` within ``socket_timeout``, however many connections it takes (a resend
        after a lost or timed-out connection included); its failures become StoreError."""
        try:
            async with asyncio.timeout(self._timeout):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            raise store_error(operation, repr(self), exc, self._timeout) from exc


def _plain_address(url: str) -> Address | None:
    """Where a URL with no options beyond host, port, database and login points, else None."""
    try:
        options: dict[str, Any] = dict(parse_url(url))
    except ValueError as exc:
        raise ConfigurationError(f"not a Redis URL: {exc}") from exc
    # redis:// names no connection class; unix:// names the Unix one; rediss:// the TLS one.
    connection_class = options.pop("connection_class", None)
    plain = connection_class in (None, UnixDomainSocketConnection)
    if not plain or not set(options) <= {"host", "port", "path", "db", "username", "password"}:
        return None
    return Address(**options)


def _address_of(client: AsyncClient) -> str:
    """Where a given client connects, as a URL without login."""
    if isinstance(client, RedisCluster):
        return f"cluster via {','.join(client.nodes_manager.startup_nodes)}"
    options = client.connection_pool.connection_kwargs
    if "path" in options:
        return f"unix://{options['path']}?db={options.get('db', 0)}"
    host, port = options.get("host", "localhost"), options.get("port", 6379)
    return f"redis://{host}:{port}/{options.get('db', 0)}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
