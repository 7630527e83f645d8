"""RedisStore: idempotency records as Redis hashes, every state change one Lua script, sent
through a redis-py client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import redis.asyncio
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import FullJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.typing import EncodableT

from idempotency_mw._redis_client import AsyncClient, binary_client
from idempotency_mw._urls import shown_url
from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.stores.feed import CHECK_AFTER, Feeds
from idempotency_mw.stores.redis import scripts
from idempotency_mw.stores.redis.admin import RedisInspection
from idempotency_mw.stores.redis.checks import server_check
from idempotency_mw.values.exceptions import ConfigurationError, store_error
from idempotency_mw.values.findings import ServerCheck
from idempotency_mw.values.metrics import key_digest, key_hash_of
from idempotency_mw.values.outcome import FIRST_SENT_SKEW, Asking, Found, decide, lookup_state
from idempotency_mw.values.records import (
    Claim,
    ClaimOutcome,
    RecordState,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)

T = TypeVar("T")

#: The socket timeout of a client the store makes from a URL (and how long the settlement feed
#: waits to subscribe), in seconds.
DEFAULT_TIMEOUT = 5.0


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class RedisStore(RedisInspection, ClaimsWithToken):
    """Idempotency records in Redis, one hash per record, through a redis-py client.

    Give either ``url`` or ``client``. A URL is any that ``redis.asyncio.Redis.from_url`` takes
    (``redis://``, ``rediss://`` for TLS, ``unix://``, options in the query string, which win
    over the store's); ``cluster=True`` makes a ``RedisCluster`` that finds the other nodes
    from the one the URL names. ``socket_timeout`` (5 s unless given) bounds connecting and each
    reply of a client made from a URL; a command that failed on a broken connection is sent once
    more on a new one (every script is safe to run twice). The store closes what it made in
    :meth:`aclose`. A given ``client`` (``redis.asyncio.Redis``, a Sentinel's
    ``master_for(...)``, or ``redis.asyncio.RedisCluster``, with ``decode_responses=False``) is
    used as it is, its own timeouts and retries included, and never closed. Keys are ``prefix``
    plus a digest of scope and key in braces, so a record lives in one cluster slot.

    The store offers a :class:`~idempotency_mw.stores.base.SettlementFeed`: the scripts that
    complete and release a record PUBLISH its digest on the channel ``<prefix>settled``, and
    :meth:`watch_settlements` subscribes to it on a connection of its own.

    The store is :class:`~idempotency_mw.stores.base.Inspectable` (the CLI and the panel) and
    :class:`~idempotency_mw.stores.base.ServerChecked` (``idempotency-mw check``).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: AsyncClient | None = None,
        cluster: bool = False,
        prefix: str = "idem:",
        socket_timeout: float | None = None,
    ) -> None:
        if cluster and url is None:
            raise ConfigurationError("cluster=True applies to url=; pass a RedisCluster client")
        if socket_timeout is not None and client is not None:
            raise ConfigurationError("socket_timeout= applies to url=; set it on your client")
        timeout = DEFAULT_TIMEOUT if socket_timeout is None else socket_timeout

        def connect(address: str) -> AsyncClient:
            options: dict[str, Any] = {
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "decode_responses": False,
            }
            if cluster:
                return RedisCluster.from_url(address, **options)
            # One resend on a broken connection: a pooled connection that died during an
            # outage fails once. Not after a timeout, which would double the wait.
            return redis.asyncio.Redis.from_url(
                address,
                retry=Retry(FullJitterBackoff(cap=0.005, base=0.005), 1, (RedisConnectionError,)),
                retry_on_error=[RedisConnectionError],
                **options,
            )

        made, self._owns_client = binary_client(
            url, client, connect, owner="RedisStore", holds="records hold binary response bodies"
        )
        self._connect, self._url = connect, url
        #: The event loop whose connections the client holds, once a client made here is used.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefix = prefix
        self._timeout = timeout
        self._channel = f"{prefix}settled"
        self._feeds = Feeds()
        # binary_client returns what it was given or what connect() made: one of these.
        self._client = cast(AsyncClient, made)
        # Known once: isinstance() on redis-py's generic client class costs microseconds.
        self._cluster = isinstance(made, RedisCluster)
        where = shown_url(url) if url is not None else _address_of(self._client)
        self._repr = f"RedisStore({where})"
        # EVALSHA, and on NOSCRIPT (a restarted or flushed server) SCRIPT LOAD and again.
        self._claim_script = self._client.register_script(scripts.CLAIM)
        self._renew_script = self._client.register_script(scripts.RENEW)
        self._complete_script = self._client.register_script(scripts.COMPLETE)
        self._release_script = self._client.register_script(scripts.RELEASE)
        self._inspect_script = self._client.register_script(scripts.INSPECT)
        self._forget_script = self._client.register_script(scripts.FORGET)
        self._lookup_script = self._client.register_script(scripts.LOOKUP)

    def _here(self) -> AsyncClient:
        """The client for the running event loop.

        A client's connections belong to the loop that opened them: when a store that made its
        client is used from another loop (a TestClient without ``with`` runs each request in a
        loop of its own), it makes a new one, and the old one's connections go with their loop.
        A given client is the application's to use in one loop.
        """
        loop = asyncio.get_running_loop()
        if self._owns_client and self._loop is not loop:
            if self._loop is not None:
                self._client = self._connect(str(self._url))
            self._loop = loop
        return self._client

    def __repr__(self) -> str:
        return self._repr

    @property
    def client(self) -> AsyncClient:
        """The redis-py client the store talks through in the running event loop (made from
        the URL, or the one given)."""
        return self._here()

    @property
    def prefix(self) -> str:
        """The prefix of every Redis key the store writes."""
        return self._prefix

    def redis_key(self, scope: str, key: str) -> str:
        """The Redis key of the record of ``(scope, key)``: a digest, never the raw key."""
        return self._record_key(key_digest(scope, key))

    def _record_key(self, digest: str) -> str:
        # In braces: a hash tag, so that a record's one key names its cluster slot.
        return f"{self._prefix}{{{digest}}}"

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
        first_sent: float | None = None,
    ) -> Claim:
        reply = await self._run(
            "claim",
            self._claim_script,
            self.redis_key(scope, key),
            fingerprint,
            token,
            _ms(ttl),
            _ms(lease),
            binding,
            "" if first_sent is None else int(first_sent * 1000),
            _ms(FIRST_SENT_SKEW),
        )
        if reply[0] == b"taken":
            return Claim(ClaimOutcome.ACQUIRED, token=token)
        found, now = _found(reply)
        return decide(found, now, Asking(fingerprint, binding, token, ttl, first_sent)).claim(token)

    async def lookup(self, scope: str, key: str, *, binding: str = "") -> RecordState | None:
        """See :class:`~idempotency_mw.stores.base.KeyLookup`: one script. A Redis record
        never says ``committed``: ``fence()`` writes its proof in the application's database."""
        reply = await self._run("lookup", self._lookup_script, self.redis_key(scope, key), binding)
        return lookup_state(*_found(reply))

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        return bool(
            await self._run(
                "renew", self._renew_script, self.redis_key(scope, key), token, _ms(lease)
            )
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
        # One digest names the record and, shortened, the settlement it publishes.
        digest = key_digest(scope, key)
        args: list[EncodableT] = [token, _ms(ttl), self._channel, key_hash_of(digest)]
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
            await self._run("complete", self._complete_script, self._record_key(digest), *args)
        )

    async def release(self, scope: str, key: str, token: str) -> bool:
        digest = key_digest(scope, key)
        return bool(
            await self._run(
                "release",
                self._release_script,
                self._record_key(digest),
                token,
                self._channel,
                key_hash_of(digest),
            )
        )

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None:
        """Nothing to do: Redis deletes records when their TTL ends."""
        return None

    async def startup(self) -> None:
        """Check that Redis answers and load the scripts (raises StoreError when it does not)."""

        async def check() -> None:
            # redis-py sends these to every primary of a cluster.
            client = self._here()
            await client.ping()
            for source in scripts.ALL:
                await client.script_load(source)

        await self._call("startup check", check)

    async def check_server(self) -> ServerCheck:
        """See :class:`~idempotency_mw.stores.base.ServerChecked`: eviction, persistence,
        replicas (of a cluster or a Sentinel's primary) and the server's clock."""
        return await self._call("server check", lambda: server_check(self._here()))

    async def watch_settlements(self, on_settled: Callable[[str], None]) -> None:
        """Pass the digest of each record any worker settles to ``on_settled``, until cancelled
        or closed (see :class:`~idempotency_mw.stores.base.SettlementFeed`).

        A PubSub connection of its own subscribes to ``<prefix>settled``, opened here and
        again after a loss; on a cluster, to one node (every node relays a PUBLISH).
        """
        await self._feeds.run(self._repr, lambda: self._listen(on_settled))

    async def _listen(self, on_settled: Callable[[str], None]) -> None:
        """Relay the channel's messages until the connection is lost (then raise), pinging it
        after ``CHECK_AFTER`` seconds of silence."""
        pool = None
        client = self._here()
        if isinstance(client, RedisCluster):
            await client.initialize()
            node = client.get_random_node()
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            pubsub = PubSub(pool)
        else:
            pubsub = client.pubsub()
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
        if self._owns_client:
            await self._call("close", self._here().aclose)

    async def _run(
        self, operation: str, script: AsyncScript, redis_key: str, *args: EncodableT
    ) -> Any:
        """Run ``script`` on one key; its failures become StoreError."""
        try:
            client = self._here()
            if self._cluster:
                # redis-py's cluster client, first used by many tasks at once, can hand one of
                # them a connection another is still setting up: set it up first (once).
                await cast(RedisCluster, client).initialize()
            return await script((redis_key,), args, client)
        except (RedisError, OSError) as exc:
            raise store_error(operation, self._repr, exc, self._timeout) from exc

    async def _call(self, operation: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, its failures become StoreError."""
        try:
            return await call()
        except (RedisError, OSError) as exc:
            raise store_error(operation, self._repr, exc, self._timeout) from exc


def _address_of(client: AsyncClient) -> str:
    """Where a given client connects, as a URL without login."""
    if isinstance(client, RedisCluster):
        return f"cluster via {','.join(client.nodes_manager.startup_nodes)}"
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return f"sentinel service {pool.service_name}"
    options = pool.connection_kwargs
    if "path" in options:
        return f"unix://{options['path']}?db={options.get('db', 0)}"
    host, port = options.get("host", "localhost"), options.get("port", 6379)
    return f"redis://{host}:{port}/{options.get('db', 0)}"


def _found(reply: list[Any]) -> tuple[Found | None, float]:
    """A record as the claim and lookup scripts read it, and the server's clock (seconds)."""
    now = int(reply[0]) / 1000
    if len(reply) == 1:
        return None, now
    hash_, status, token, lease_ends, expires, binding = reply[1:7]
    found = Found(
        RecordStatus(_text(status)),
        _text(hash_),
        _text(token),
        _text(binding),
        int(lease_ends) / 1000,
        int(expires) / 1000,
        response=_response(*reply[7:10]) if len(reply) > 7 else None,
    )
    return found, now


def _response(status: bytes, headers: bytes, body: bytes) -> StoredResponse:
    """A completed record's response, as the scripts read it."""
    return StoredResponse(int(status), unpack_headers(bytes(headers)), bytes(body))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
