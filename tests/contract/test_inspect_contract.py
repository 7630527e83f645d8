"""The Inspectable contract (the operator's look at a store), on every store, built every way
a user can build it: the CLI and the panel read records only through it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from idempotency_mw import ClaimOutcome, Store, StoredResponse
from idempotency_mw.operator.admin import release_record
from idempotency_mw.stores.base import Inspectable
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.records import RecordStatus, RecordView
from tests.conftest import STORE_PATHS, built_store

pytestmark = pytest.mark.anyio

TTL = 3600.0
LEASE = 600.0
RESPONSE = StoredResponse(201, ((b"content-type", b"text/plain"),), b"created 17")


class Both(Store, Inspectable):
    """What the tests hold: a store that is inspectable too."""


@pytest.fixture(params=STORE_PATHS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Both]:
    async with built_store(request.param, request) as made:
        assert isinstance(made, Inspectable)
        yield cast(Both, made)


def is_redis(store: Any) -> bool:
    return type(store).__name__ == "RedisStore"


async def claimed(store: Both, key: str, *, scope: str = "", lease: float = LEASE) -> str:
    made = await store.claim(scope, key, f"hash-of-{key}", ttl=TTL, lease=lease)
    assert made.outcome is ClaimOutcome.ACQUIRED
    assert made.token is not None
    return made.token


async def completed(store: Both, key: str, *, scope: str = "") -> None:
    token = await claimed(store, key, scope=scope)
    assert await store.complete(scope, key, token, RESPONSE, ttl=TTL)


async def found(store: Both, key: str, *, scope: str = "", body: bool = False) -> RecordView:
    record = await store.find_record(store.record_ref(scope, key), with_body=body)
    assert record is not None
    return record


def near_now(moment: datetime) -> bool:
    return abs(moment - datetime.now(UTC)) < timedelta(seconds=5)


async def test_a_key_without_record_is_none(store: Both) -> None:
    assert await store.find_record(store.record_ref("", "never-sent")) is None
    assert store.record_ref("a", "k") == store.record_ref("a", "k") != store.record_ref("b", "k")


async def test_a_record_in_progress_as_stored(store: Both) -> None:
    await claimed(store, "order-17", scope="alice")
    record = await found(store, "order-17", scope="alice")
    assert record.status is RecordStatus.IN_PROGRESS
    assert record.request_hash == "hash-of-order-17"
    assert (record.in_progress, record.stuck, record.expired, record.fenced) == (
        True,
        False,
        False,
        False,
    )
    assert near_now(record.now)
    assert abs(record.lease_expires_at - record.now - timedelta(seconds=LEASE)) < timedelta(
        seconds=5
    )
    assert abs(record.expires_at - record.now - timedelta(seconds=TTL)) < timedelta(seconds=5)
    assert (record.response_status, record.body) == (None, None)
    if is_redis(store):
        assert (record.scope, record.key, record.created_at) == (None, None, None)
    else:
        assert (record.scope, record.key) == ("alice", "order-17")
        assert record.created_at is not None
        assert near_now(record.created_at)


async def test_a_completed_record_shows_its_body_only_when_asked(store: Both) -> None:
    await completed(store, "order-17")
    record = await found(store, "order-17")
    assert record.status is RecordStatus.COMPLETED
    assert (record.response_status, record.response_size, record.body) == (201, 10, None)
    with_body = await found(store, "order-17", body=True)
    assert with_body.body == b"created 17"
    assert with_body.version == record.version


async def test_a_claim_past_its_lease_is_stuck(store: Both) -> None:
    await claimed(store, "stuck", lease=0.05)
    await asyncio.sleep(0.2)
    record = await found(store, "stuck")
    assert (record.stuck, record.expired) == (True, False)


async def test_listing_by_status_oldest_lease_first_within_the_limit(store: Both) -> None:
    await claimed(store, "short", lease=60)
    await claimed(store, "long", lease=900)
    await claimed(store, "middle", lease=300)
    await completed(store, "done")
    listed = await store.list_records(RecordStatus.IN_PROGRESS, limit=10)
    expected = [await found(store, key) for key in ("short", "middle", "long")]
    assert [record.ref for record in listed] == [record.ref for record in expected]
    assert [record.version for record in listed] == [record.version for record in expected]
    assert [r.ref for r in await store.list_records(RecordStatus.IN_PROGRESS, limit=2)] == [
        expected[0].ref,
        expected[1].ref,
    ]
    (done,) = await store.list_records(RecordStatus.COMPLETED, limit=10)
    assert done.ref == store.record_ref("", "done")
    assert done.response_status == 201
    assert await store.list_records(RecordStatus.UNREPLAYABLE, limit=10) == []
    # A listed record is found by its ref.
    again = await store.find_record(listed[0].ref)
    assert again is not None
    assert again.ref == listed[0].ref


async def test_force_release_deletes_the_record_as_it_was_read(store: Both) -> None:
    await claimed(store, "order-17")
    record = await found(store, "order-17")
    assert await store.force_release(record)
    assert await store.find_record(record.ref) is None
    assert not await store.force_release(record)  # gone already
    await claimed(store, "order-17")  # its next request runs again


async def test_force_release_of_a_record_changed_since_it_was_read_changes_nothing(
    store: Both,
) -> None:
    token = await claimed(store, "order-17")
    seen = await found(store, "order-17")
    assert await store.complete("", "order-17", token, RESPONSE, ttl=TTL)  # settled meanwhile
    assert not await store.force_release(seen)
    now = await found(store, "order-17")
    assert now.status is RecordStatus.COMPLETED
    # And one taken over by another request (a new claim token) is another record too.
    await claimed(store, "taken", lease=0.05)
    stale = await found(store, "taken")
    await asyncio.sleep(0.2)
    await claimed(store, "taken")
    assert not await store.force_release(stale)
    assert not (await found(store, "taken")).stuck


async def test_a_completed_record_is_released_only_by_force(store: Both) -> None:
    await completed(store, "order-17")
    record = await found(store, "order-17")
    refused = await release_record(store, record, force=False)
    assert refused.outcome == "refused"
    assert (await found(store, "order-17")).status is RecordStatus.COMPLETED
    assert (await release_record(store, record, force=True)).outcome == "released"
    assert await store.find_record(record.ref) is None


async def test_stats_count_records_by_status(store: Both) -> None:
    await claimed(store, "running")
    await completed(store, "done-1")
    await completed(store, "done-2")
    token = await claimed(store, "too-large")
    assert await store.complete("", "too-large", token, None, ttl=TTL)
    stats = await store.record_stats()
    assert dict(stats.by_status) == {
        RecordStatus.IN_PROGRESS: 1,
        RecordStatus.COMPLETED: 2,
        RecordStatus.UNREPLAYABLE: 1,
        RecordStatus.COMMITTED: 0,
    }
    assert stats.total == 4
    assert near_now(stats.now)
    if is_redis(store):
        assert (stats.fenced, stats.expired, stats.oldest_in_progress) == (None, None, None)
        assert stats.size_bytes is not None
        assert stats.size_bytes > 0
    else:
        assert stats.expired == 0
        assert stats.oldest_in_progress is not None
        assert near_now(stats.oldest_in_progress)


async def test_the_scopes_of_a_key(store: Both) -> None:
    await completed(store, "order-17", scope="bob")
    await completed(store, "order-17", scope="alice")
    await completed(store, "order-18", scope="carol")
    scopes = await store.scopes_of("order-17", limit=10)
    if is_redis(store):
        assert scopes is None  # a record's name is a digest of scope and key
    else:
        assert scopes == ["alice", "bob"]
        assert await store.scopes_of("order-17", limit=1) == ["alice"]
        assert await store.scopes_of("never-sent", limit=10) == []


async def test_a_ref_of_another_store_is_a_clear_error(store: Both) -> None:
    with pytest.raises(ConfigurationError, match="not a record of"):
        await store.find_record("nonsense")
    await claimed(store, "order-17")
    record = await found(store, "order-17")
    with pytest.raises(ConfigurationError, match="not a record of"):
        await store.force_release(dataclasses.replace(record, ref="nonsense"))
