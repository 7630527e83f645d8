"""RedisStore: idempotency records as Redis hashes, every state change one Lua script."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from idempotency_mw.exceptions import ConfigurationError, StoreError, describe
from idempotency_mw.records import (
    Claim,
    ClaimOutcome,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)
from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.stores.resp import Address, Arg, PipelinedConnection

T = TypeVar("T")

# Shared by every script. Server time keeps leases independent of worker clocks; TIME is
# non-deterministic, so servers older than 5.0 must be told to replicate effects, not scripts.
# string.format('%d') writes integers: Redis would otherwise format Lua numbers as floats.
_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(n) return string.format('%d', n) end
"""


class _Script:
    """A Lua script and the SHA-1 by which Redis knows it once loaded."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


# KEYS[1] record; ARGV fingerprint, token, ttl ms, lease ms.
# Returns {outcome} or {'replay', status, headers, body}.
_CLAIM = _Script(
    _PRELUDE
    + """
local key, fingerprint, token = KEYS[1], ARGV[1], ARGV[2]
local ttl, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local r = redis.call('HMGET', key, 'request_hash', 'status', 'token', 'lease_expires_at',
    'expires_at')
local hash, status = r[1], r[2]
-- The same call again (a client retry after a lost reply) still owns its fresh claim.
if status == 'in_progress' and r[3] == token then return {'acquired'} end
local take
if not status then
    take = true
else
    local lease_end, ttl_end = tonumber(r[4]) or 0, tonumber(r[5]) or 0
    if status == 'in_progress' then
        take = lease_end <= now and (hash == fingerprint or ttl_end <= now)
    else
        take = ttl_end <= now
    end
end
if take then
    redis.call('DEL', key)
    redis.call('HSET', key, 'request_hash', fingerprint, 'status', 'in_progress',
        'token', token, 'lease_expires_at', int(now + lease), 'expires_at', int(now + ttl))
    redis.call('PEXPIRE', key, int(math.max(ttl, lease, 1)))
    return {'acquired'}
end
if hash ~= fingerprint then return {'mismatch'} end
if status == 'completed' then
    local s = redis.call('HMGET', key, 'response_status', 'response_headers', 'result_payload')
    return {'replay', s[1] or '0', s[2] or '', s[3] or ''}
end
if status == 'unreplayable' then return {'unreplayable'} end
return {'in_progress'}
"""
)

# KEYS[1] record; ARGV token, lease ms. Returns 1 if renewed.
_RENEW = _Script(
    _PRELUDE
    + """
local key, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
local r = redis.call('HMGET', key, 'status', 'token', 'expires_at')
if r[1] ~= 'in_progress' or r[2] ~= token then return 0 end
local now = now_ms()
local lease_end = now + lease
redis.call('HSET', key, 'lease_expires_at', int(lease_end))
-- While in progress the key outlives both the lease and the TTL.
redis.call('PEXPIRE', key, int(math.max((tonumber(r[3]) or 0) - now, lease, 1)))
return 1
"""
)

# KEYS[1] record; ARGV token, ttl ms, status, [response status, packed headers, body].
# Returns 1 if recorded.
_COMPLETE = _Script(
    _PRELUDE
    + """
local key, token, ttl, status = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local r = redis.call('HMGET', key, 'status', 'token')
if r[2] ~= token then return 0 end
-- Only this token's own earlier call (a client retry after a lost reply) can have settled it.
if r[1] ~= 'in_progress' then return 1 end
local now = now_ms()
redis.call('HSET', key, 'status', status, 'lease_expires_at', int(now),
    'expires_at', int(now + ttl))
if status == 'completed' then
    redis.call('HSET', key, 'response_status', ARGV[4], 'response_headers', ARGV[5],
        'result_payload', ARGV[6])
end
redis.call('PEXPIRE', key, int(ttl))
return 1
"""
)

# KEYS[1] record; ARGV token. Returns 1 if deleted.
_RELEASE = _Script("""
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
""")
_SCRIPTS = (_CLAIM, _RENEW, _COMPLETE, _RELEASE)


Client = TypeVar("Client", redis.Redis, redis.asyncio.Redis)


def binary_client(
    url: str | None,
    client: Client | None,
    make: Callable[[str], Client],
    *,
    owner: str,
    holds: str,
) -> tuple[Client, bool]:
    """The client to use, made from ``url`` or given, and whether ``owner`` made it."""
    if (url is None) == (client is None):
        raise ConfigurationError(f"{owner} needs exactly one of url= or client=")
    if client is None:
        try:
            client = make(str(url))
        except ValueError as exc:
            raise ConfigurationError(f"not a Redis URL: {exc}") from exc
    if client.connection_pool.connection_kwargs.get("decode_responses", False):
        raise ConfigurationError(
            f"{owner} needs a Redis client with decode_responses=False: {holds}"
        )
    return client, url is not None


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


class RedisStore(ClaimsWithToken):
    """Idempotency records in Redis, one hash per record.

    Give either ``url`` or ``client``. From a ``redis://`` or ``unix://`` URL (host, port,
    database, user and password; no other options) the store opens one pipelined connection
    that every request shares; any other URL (``rediss://``, options in the query) gets a
    redis-py client. ``socket_timeout`` seconds bound connecting and every reply, and the store
    closes what it opened in :meth:`aclose`. A given ``client``, a ``redis.asyncio.Redis`` with
    ``decode_responses=False``, is used as it is and never closed. Keys are ``prefix`` plus a
    digest of scope and key in braces, so a record lives in one cluster slot.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.asyncio.Redis | None = None,
        prefix: str = "idem:",
        socket_timeout: float = 5.0,
    ) -> None:
        # One retry on a broken connection: a pooled connection that died during an outage
        # fails once, and every script is safe to run again with its token.
        client, self._owns_client = binary_client(
            url,
            client,
            lambda address: redis.asyncio.Redis.from_url(
                address,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                decode_responses=False,
                retry=Retry(NoBackoff(), 1),
                retry_on_error=[RedisConnectionError],
            ),
            owner="RedisStore",
            holds="records hold binary response bodies",
        )
        self._client = client
        self._prefix = prefix
        address = None if url is None else _plain_address(url)
        self._pipe = (
            None if address is None else PipelinedConnection(address, timeout=socket_timeout)
        )

    @property
    def client(self) -> redis.asyncio.Redis:
        """A redis-py client on the store's server, for inspecting records."""
        return self._client

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
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float, token: str
    ) -> Claim:
        reply = await self._run(
            _CLAIM, self.redis_key(scope, key), fingerprint, token, _ms(ttl), _ms(lease)
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
        return bool(await self._run(_RENEW, self.redis_key(scope, key), token, _ms(lease)))

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        args: list[Arg] = [token, _ms(ttl)]
        if response is None:
            args.append(RecordStatus.UNREPLAYABLE.value)
        else:
            args += [
                RecordStatus.COMPLETED.value,
                response.status,
                pack_headers(response.headers),
                response.body,
            ]
        return bool(await self._run(_COMPLETE, self.redis_key(scope, key), *args))

    async def release(self, scope: str, key: str, token: str) -> bool:
        return bool(await self._run(_RELEASE, self.redis_key(scope, key), token))

    async def purge_expired(self, *, batch_size: int) -> int | None:
        """Nothing to do: Redis deletes records when their TTL ends."""
        return None

    async def startup(self) -> None:
        """Check that Redis answers and load the scripts (raises StoreError when it does not)."""

        async def check() -> None:
            await self._execute("PING")
            for script in _SCRIPTS:
                await self._execute("SCRIPT", "LOAD", script.source)

        await self._call(check)

    async def aclose(self) -> None:
        if self._pipe is not None:
            await self._pipe.aclose()
        if self._owns_client:
            await self._call(self._client.aclose)

    async def _run(self, script: _Script, redis_key: str, *args: Arg) -> Any:
        """Run ``script`` on one key; EVALSHA, or EVAL (which loads it) when Redis lacks it."""

        async def run() -> Any:
            try:
                return await self._execute("EVALSHA", script.sha, 1, redis_key, *args)
            except NoScriptError:
                return await self._execute("EVAL", script.source, 1, redis_key, *args)

        return await self._call(run)

    def _execute(self, *args: Arg) -> Awaitable[Any]:
        if self._pipe is not None:
            return self._pipe.execute(*args)
        return self._client.execute_command(*args)  # type: ignore[no-untyped-call]

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        try:
            return await operation()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(describe(exc)) from exc


def _plain_address(url: str) -> Address | None:
    """Where a URL with no options beyond host, port, database and login points, else None."""
    options: dict[str, Any] = dict(parse_url(url))
    # redis:// names no connection class; unix:// names the Unix one; rediss:// the TLS one.
    connection_class = options.pop("connection_class", None)
    plain = connection_class in (None, UnixDomainSocketConnection)
    if not plain or not set(options) <= {"host", "port", "path", "db", "username", "password"}:
        return None
    return Address(**options)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
