"""RedisStore: idempotency records as Redis hashes, every state change one Lua script."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from idempotency_mw.exceptions import ConfigurationError, StoreError, describe
from idempotency_mw.records import (
    Claim,
    ClaimOutcome,
    RecordStatus,
    StoredResponse,
    pack_headers,
    unpack_headers,
)

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

# KEYS[1] record; ARGV fingerprint, token, ttl ms, lease ms.
# Returns {outcome} or {'replay', status, headers, body}.
_CLAIM = (
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
_RENEW = (
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
_COMPLETE = (
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
_RELEASE = """
local r = redis.call('HMGET', KEYS[1], 'status', 'token')
if r[1] ~= 'in_progress' or r[2] ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


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


class RedisStore:
    """Idempotency records in Redis, one hash per record.

    Give either ``url`` (the store creates its client, with ``socket_timeout`` seconds for
    connecting and for every reply, and closes it in :meth:`aclose`) or ``client``, a
    ``redis.asyncio.Redis`` with ``decode_responses=False`` that the store never closes. Keys
    are ``prefix`` plus a digest of scope and key in braces, so a record lives in one cluster
    slot.
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
        self._claim = client.register_script(_CLAIM)
        self._renew = client.register_script(_RENEW)
        self._complete = client.register_script(_COMPLETE)
        self._release = client.register_script(_RELEASE)

    @property
    def client(self) -> redis.asyncio.Redis:
        """The Redis client the store runs on."""
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

    async def claim(
        self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float
    ) -> Claim:
        token = uuid.uuid4().hex
        reply = await self._run(
            self._claim, self.redis_key(scope, key), [fingerprint, token, _ms(ttl), _ms(lease)]
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
        return bool(await self._run(self._renew, self.redis_key(scope, key), [token, _ms(lease)]))

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, *, ttl: float
    ) -> bool:
        args: list[str | int | bytes] = [token, _ms(ttl)]
        if response is None:
            args.append(RecordStatus.UNREPLAYABLE.value)
        else:
            args += [
                RecordStatus.COMPLETED.value,
                response.status,
                pack_headers(response.headers),
                response.body,
            ]
        return bool(await self._run(self._complete, self.redis_key(scope, key), args))

    async def release(self, scope: str, key: str, token: str) -> bool:
        return bool(await self._run(self._release, self.redis_key(scope, key), [token]))

    async def purge_expired(self, *, batch_size: int) -> int | None:
        """Nothing to do: Redis deletes records when their TTL ends."""
        return None

    async def startup(self) -> None:
        """Check that Redis answers and load the scripts (raises StoreError when it does not)."""

        async def check() -> None:
            await self._client.ping()
            for script in (self._claim, self._renew, self._complete, self._release):
                await self._client.script_load(script.script)

        await self._call(check)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._call(self._client.aclose)

    async def _run(self, script: AsyncScript, redis_key: str, args: Sequence[Any]) -> Any:
        """Run ``script`` on one key; EVALSHA, falling back to loading it when Redis lacks it."""
        return await self._call(lambda: script(keys=[redis_key], args=args))

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        try:
            return await operation()
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(describe(exc)) from exc


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
