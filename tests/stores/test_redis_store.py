"""RedisStore against a real Redis server: claim outcomes, ownership, leases, expiry, limits."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from idempotency_mw.stores.base import Store
from idempotency_mw.stores.redis import RedisStore
from idempotency_mw.values.exceptions import ConfigurationError, StoreError
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse
from tests.conftest import REDIS_URL, redis_prefix, require_server
from tests.support import claimers
from tests.support.claimers import outcomes_from_processes

pytestmark = [pytest.mark.anyio, pytest.mark.servers]

SCOPE = "caller-1"
RESPONSE = StoredResponse(
    201,
    ((b"content-type", b"application/json"), (b"x-bin", b"\x00\xff\r\n"), (b"set-cookie", b"")),
    b'{"id": 7}\x00\xfe',
)


def unique_prefix() -> str:
    return redis_prefix("idem")


async def delete_prefix(
    client: redis.asyncio.Redis | redis.asyncio.RedisCluster, prefix: str
) -> None:
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await client.delete(*keys)


@pytest.fixture(params=["url", "client"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    """A started RedisStore with its own prefix, made from a URL or given a redis-py client.

    Its keys are deleted afterwards.
    """
    require_server(REDIS_URL)
    prefix = unique_prefix()
    given = None if request.param == "url" else redis.asyncio.Redis.from_url(REDIS_URL)
    store = (
        RedisStore(REDIS_URL, prefix=prefix)
        if given is None
        else RedisStore(client=given, prefix=prefix)
    )
    await store.startup()
    yield store
    await delete_prefix(store.client, prefix)
    await store.aclose()
    if given is not None:
        await given.aclose()


async def claim(
    store: RedisStore, fingerprint: str = "fp", key: str = "k", **times: float
) -> Claim:
    return await store.claim(
        SCOPE, key, fingerprint, ttl=times.get("ttl", 60), lease=times.get("lease", 30)
    )


async def acquire(
    store: RedisStore, fingerprint: str = "fp", key: str = "k", **times: float
) -> str:
    result = await claim(store, fingerprint, key, **times)
    assert result.outcome is ClaimOutcome.ACQUIRED
    assert result.token
    return result.token


def test_satisfies_store_protocol() -> None:
    assert isinstance(RedisStore(REDIS_URL), Store)


async def test_absent_key_is_acquired_with_a_fresh_token(store: RedisStore) -> None:
    first = await claim(store, key="a")
    second = await claim(store, key="b")
    assert first.outcome is second.outcome is ClaimOutcome.ACQUIRED
    assert first.token
    assert second.token
    assert first.token != second.token
    assert first.response is None


async def test_completed_record_replays_exact_bytes(store: RedisStore) -> None:
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    result = await claim(store)
    assert result.outcome is ClaimOutcome.REPLAY
    assert result.token is None
    assert result.response == RESPONSE


async def test_empty_response_replays(store: RedisStore) -> None:
    token = await acquire(store)
    empty = StoredResponse(204, (), b"")
    assert await store.complete(SCOPE, "k", token, empty, ttl=60)
    assert (await claim(store)).response == empty


async def test_other_fingerprint_is_a_mismatch_in_progress_or_completed(store: RedisStore) -> None:
    token = await acquire(store)
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH


async def test_same_fingerprint_within_lease_is_in_progress(store: RedisStore) -> None:
    await acquire(store)
    result = await claim(store)
    assert result.outcome is ClaimOutcome.IN_PROGRESS
    assert result.token is None


async def test_completed_without_response_is_unreplayable(store: RedisStore) -> None:
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, None, ttl=60)
    assert (await claim(store)).outcome is ClaimOutcome.UNREPLAYABLE
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH


async def test_release_forgets_the_claim(store: RedisStore) -> None:
    token = await acquire(store)
    assert not await store.release(SCOPE, "k", "not-the-token")
    assert await store.release(SCOPE, "k", token)
    assert not await store.release(SCOPE, "k", token)
    assert not await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    assert await store.client.exists(store.redis_key(SCOPE, "k")) == 0
    # Released, so any request may claim the key again.
    assert await acquire(store, "other")


async def test_completed_record_cannot_be_released_or_renewed(store: RedisStore) -> None:
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    assert not await store.release(SCOPE, "k", token)
    assert not await store.renew(SCOPE, "k", token, lease=30)
    assert (await claim(store)).response == RESPONSE


async def test_wrong_token_cannot_renew_or_complete(store: RedisStore) -> None:
    token = await acquire(store)
    assert not await store.renew(SCOPE, "k", "nope", lease=30)
    assert not await store.complete(SCOPE, "k", "nope", RESPONSE, ttl=60)
    assert await store.renew(SCOPE, "k", token, lease=30)
    assert (await claim(store)).outcome is ClaimOutcome.IN_PROGRESS


async def test_lapsed_lease_is_taken_over_by_the_same_request_only(store: RedisStore) -> None:
    stale = await acquire(store, lease=0.2)
    await asyncio.sleep(0.3)
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH
    fresh = await acquire(store)
    assert fresh != stale
    # The worker that lost its lease can no longer touch the record.
    assert not await store.renew(SCOPE, "k", stale, lease=30)
    assert not await store.complete(SCOPE, "k", stale, RESPONSE, ttl=60)
    assert not await store.release(SCOPE, "k", stale)
    assert (await claim(store)).outcome is ClaimOutcome.IN_PROGRESS
    assert await store.complete(SCOPE, "k", fresh, RESPONSE, ttl=60)
    assert (await claim(store)).response == RESPONSE


async def test_renewed_lease_is_not_taken_over(store: RedisStore) -> None:
    token = await acquire(store, lease=0.2)
    await asyncio.sleep(0.1)
    assert await store.renew(SCOPE, "k", token, lease=5)
    await asyncio.sleep(0.2)
    assert (await claim(store)).outcome is ClaimOutcome.IN_PROGRESS


async def test_completed_record_expires_after_its_ttl(store: RedisStore) -> None:
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=0.3)
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH
    await asyncio.sleep(0.4)
    assert await acquire(store, "other")


async def test_abandoned_claim_expires_after_ttl_and_lease(store: RedisStore) -> None:
    await acquire(store, ttl=0.3, lease=0.2)
    await asyncio.sleep(0.4)
    assert await acquire(store, "other")


async def test_in_progress_record_outlives_a_shorter_ttl(store: RedisStore) -> None:
    await acquire(store, ttl=0.2, lease=1.5)
    await asyncio.sleep(0.3)
    assert (await claim(store)).outcome is ClaimOutcome.IN_PROGRESS
    assert (await claim(store, "other")).outcome is ClaimOutcome.MISMATCH


async def test_expiry_is_decided_by_the_record_not_only_by_eviction(store: RedisStore) -> None:
    # With the Redis TTL removed, the scripts still read the record's own deadlines.
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=0.2)
    await store.client.persist(store.redis_key(SCOPE, "k"))
    await asyncio.sleep(0.3)
    assert await acquire(store, "other", key="k")

    await acquire(store, key="k2", ttl=0.2, lease=0.2)
    await store.client.persist(store.redis_key(SCOPE, "k2"))
    await asyncio.sleep(0.3)
    assert await acquire(store, "other", key="k2")


async def test_scopes_and_keys_are_isolated(store: RedisStore) -> None:
    token = await store.claim("alice", "k", "fp", ttl=60, lease=30)
    assert token.outcome is ClaimOutcome.ACQUIRED
    assert (await store.claim("bob", "k", "other", ttl=60, lease=30)).outcome is (
        ClaimOutcome.ACQUIRED
    )
    # Concatenating scope and key would make these two the same record.
    assert (await store.claim("ab", "c", "fp", ttl=60, lease=30)).outcome is ClaimOutcome.ACQUIRED
    assert (await store.claim("a", "bc", "fp", ttl=60, lease=30)).outcome is ClaimOutcome.ACQUIRED
    assert token.token
    assert not await store.release("bob", "k", token.token)
    assert store.redis_key("ab", "c") != store.redis_key("a", "bc")


def test_redis_key_hides_the_raw_key_behind_a_hash_tag() -> None:
    store = RedisStore(REDIS_URL, prefix="p:")
    redis_key = store.redis_key("secret-scope", "secret-key")
    assert redis_key.startswith("p:{")
    assert redis_key.endswith("}")
    assert len(redis_key) == len("p:{}") + 64
    assert "secret" not in redis_key


async def test_concurrent_claims_acquire_exactly_once(store: RedisStore) -> None:
    # Several clients, so the claims arrive on separate connections as from separate workers.
    others = [RedisStore(REDIS_URL, prefix=store.prefix) for _ in range(4)]
    stores = [store, *others]
    try:
        results = await asyncio.gather(
            *(
                stores[i % len(stores)].claim(SCOPE, "hot", "fp", ttl=60, lease=30)
                for i in range(50)
            )
        )
    finally:
        for other in others:
            await other.aclose()
    outcomes = [result.outcome for result in results]
    assert outcomes.count(ClaimOutcome.ACQUIRED) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS) == 49


async def test_claims_from_several_processes_have_one_winner(store: RedisStore) -> None:
    opened = functools.partial(claimers.redis_store, REDIS_URL, store.prefix)
    outcomes = await outcomes_from_processes(opened)
    assert outcomes.count(ClaimOutcome.ACQUIRED.value) == 1
    assert outcomes.count(ClaimOutcome.IN_PROGRESS.value) == 39


async def test_concurrent_takeovers_of_a_lapsed_lease_acquire_exactly_once(
    store: RedisStore,
) -> None:
    await acquire(store, key="hot", lease=0.1)
    await asyncio.sleep(0.2)
    results = await asyncio.gather(
        *(store.claim(SCOPE, "hot", "fp", ttl=60, lease=30) for _ in range(50))
    )
    assert [result.outcome for result in results].count(ClaimOutcome.ACQUIRED) == 1


async def test_five_mib_binary_payload_round_trips(store: RedisStore) -> None:
    body = os.urandom(5 * 1024 * 1024)
    response = StoredResponse(200, ((b"content-type", b"application/octet-stream"),), body)
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, response, ttl=60)
    replay = await claim(store)
    assert replay.response is not None
    assert replay.response.body == body
    assert replay.response == response


async def test_redis_ttl_follows_the_record(store: RedisStore) -> None:
    redis_key = store.redis_key(SCOPE, "k")
    token = await acquire(store, ttl=60, lease=5)
    assert 59_000 < await store.client.pttl(redis_key) <= 60_000
    assert await store.renew(SCOPE, "k", token, lease=90)
    assert 89_000 < await store.client.pttl(redis_key) <= 90_000
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=120)
    assert 119_000 < await store.client.pttl(redis_key) <= 120_000

    await acquire(store, key="k2", ttl=1, lease=30)
    assert 29_000 < await store.client.pttl(store.redis_key(SCOPE, "k2")) <= 30_000


async def test_record_is_a_hash_of_bytes(store: RedisStore) -> None:
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    record = await store.client.hgetall(store.redis_key(SCOPE, "k"))
    assert record[b"status"] == b"completed"
    assert record[b"request_hash"] == b"fp"
    assert record[b"response_status"] == b"201"
    assert record[b"result_payload"] == RESPONSE.body
    assert int(record[b"expires_at"]) - int(record[b"lease_expires_at"]) == 60_000


async def test_a_retried_script_call_keeps_its_outcome(store: RedisStore) -> None:
    # redis-py resends a command whose reply was lost; the same token must not lose its claim.
    for _ in range(2):
        again = await store._claim(SCOPE, "k", "fp", ttl=60, lease=30, token="token-1")
        assert again.outcome is ClaimOutcome.ACQUIRED
    assert await store.complete(SCOPE, "k", "token-1", RESPONSE, ttl=60)
    assert await store.complete(SCOPE, "k", "token-1", RESPONSE, ttl=60)
    assert (await claim(store)).response == RESPONSE


async def test_scripts_flushed_from_redis_are_loaded_again(store: RedisStore) -> None:
    await store.client.script_flush()
    token = await acquire(store)
    assert await store.complete(SCOPE, "k", token, RESPONSE, ttl=60)
    assert (await claim(store)).response == RESPONSE


async def test_non_hash_value_raises_store_error(store: RedisStore) -> None:
    await store.client.set(store.redis_key(SCOPE, "k"), b"not a hash")
    with pytest.raises(StoreError) as caught:
        await claim(store)
    assert isinstance(caught.value.__cause__, redis.exceptions.ResponseError)


async def test_given_client_is_not_closed(redis_client: redis.asyncio.Redis) -> None:
    client = redis_client
    prefix = unique_prefix()
    store = RedisStore(client=client, prefix=prefix)
    await store.startup()
    await acquire(store)
    connection = await client.client_id()
    await store.aclose()
    # The same connection still serves the client: its pool was not disconnected.
    assert await client.client_id() == connection
    await delete_prefix(client, prefix)


async def test_unreachable_server_raises_store_error() -> None:
    store = RedisStore("redis://127.0.0.1:1/0", socket_timeout=1)
    try:
        with pytest.raises(StoreError):
            await store.startup()
        with pytest.raises(StoreError):
            await store.claim(SCOPE, "k", "fp", ttl=60, lease=30)
    finally:
        await store.aclose()


async def test_client_decoding_responses_is_rejected() -> None:
    client = redis.asyncio.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError, match="decode_responses=False"):
            RedisStore(client=client)
    finally:
        await client.aclose()
    with pytest.raises(ConfigurationError, match="decode_responses=False"):
        RedisStore(f"{REDIS_URL}?decode_responses=True")


async def test_exactly_one_of_url_and_client(redis_client: redis.asyncio.Redis) -> None:
    client = redis_client
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisStore()
    with pytest.raises(ConfigurationError, match="exactly one"):
        RedisStore(REDIS_URL, client=client)
    with pytest.raises(ConfigurationError, match="not a Redis URL"):
        RedisStore("http://example.invalid/")


@pytest.mark.parametrize("cluster", [False, True])
def test_a_url_option_redis_py_does_not_take_is_a_configuration_error(cluster: bool) -> None:
    # redis-py would hand it to every connection it opens, and every command would fail.
    with pytest.raises(ConfigurationError, match="health_chek_interval"):
        RedisStore(f"{REDIS_URL}?health_chek_interval=5", cluster=cluster)
