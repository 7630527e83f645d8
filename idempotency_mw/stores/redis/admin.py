"""RedisStore's :class:`~idempotency_mw.stores.base.Inspectable` half: the operator's reads and
deletes of the records, on the store's own key layout, client and script runner.

A record's Redis key is a digest of its scope and key, so a listing names records by that key
(their ``ref``) and cannot tell their scope and key. Listings and counts scan every primary of
a cluster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.records import (
    RecordStatus,
    RecordView,
    StoreStats,
    record_version,
    utc_ms,
)

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript
    from redis.typing import EncodableT

    from idempotency_mw._redis_client import AsyncClient

T = TypeVar("T")

_BATCH = 500
#: What INSPECT reads of a record, in its order.
_FIELDS = ("status", "token", "request_hash", "lease_expires_at", "expires_at", "response_status")


class RedisInspection:
    """Inspection for :class:`~idempotency_mw.stores.redis.RedisStore` (mixed into it)."""

    if TYPE_CHECKING:

        @property
        def client(self) -> AsyncClient: ...
        @property
        def prefix(self) -> str: ...
        def redis_key(self, scope: str, key: str) -> str: ...

        _inspect_script: AsyncScript
        _forget_script: AsyncScript

        async def _run(
            self, operation: str, script: AsyncScript, redis_key: str, *args: EncodableT
        ) -> Any: ...
        async def _call(self, operation: str, call: Callable[[], Awaitable[T]]) -> T: ...

    def record_ref(self, scope: str, key: str) -> str:
        return self.redis_key(scope, key)

    async def find_record(self, ref: str, *, with_body: bool = False) -> RecordView | None:
        self._check(ref)
        reply = await self._run("inspect", self._inspect_script, ref, "1" if with_body else "0")
        return _view(ref, reply)

    async def list_records(self, status: RecordStatus, *, limit: int) -> list[RecordView]:
        async def listed() -> list[RecordView]:
            found: list[RecordView] = []
            now = await self._now()
            async for refs in self._batches():
                # HMGET, not the script: redis-py runs no scripts in a cluster's pipeline.
                async with self.client.pipeline(transaction=False) as pipe:
                    for ref in refs:
                        pipe.hmget(ref, _FIELDS)
                        pipe.hstrlen(ref, "result_payload")
                    replies = await pipe.execute()
                for ref, fields, size in zip(refs, replies[::2], replies[1::2], strict=True):
                    if fields[0] is None or fields[1] is None:  # expired since the scan
                        continue
                    view = _view(_text(ref), [now, *fields, size])
                    if view is not None and view.status is status:
                        found.append(view)
            found.sort(key=lambda view: view.lease_expires_at)
            return found[:limit]

        return await self._call("list", listed)

    async def _now(self) -> int:
        """The server's clock (ms), read by the inspection script on a key that holds no
        record."""
        return int(
            (await self._run("inspect", self._inspect_script, f"{self.prefix}{{clock}}", "0"))[0]
        )

    async def scopes_of(self, key: str, *, limit: int) -> list[str] | None:
        """``None``: a record's Redis key is a digest of its scope and key together."""
        return None

    async def force_release(self, record: RecordView) -> bool:
        self._check(record.ref)
        return bool(await self._run("release", self._forget_script, record.ref, record.version))

    async def record_stats(self) -> StoreStats:
        by_status: dict[RecordStatus, int] = dict.fromkeys(RecordStatus, 0)
        size = 0

        async def count() -> int:
            nonlocal size
            async for refs in self._batches():
                async with self.client.pipeline(transaction=False) as pipe:
                    for ref in refs:
                        pipe.hget(ref, "status")
                        pipe.memory_usage(ref)
                    replies = await pipe.execute()
                for status, usage in zip(replies[::2], replies[1::2], strict=True):
                    if status is not None:  # expired between the scan and the read
                        by_status[RecordStatus(_text(status))] += 1
                        size += usage or 0
            return await self._now()

        now = await self._call("stats", count)
        return StoreStats(
            by_status=by_status,
            fenced=None,
            expired=None,
            oldest_in_progress=None,
            size_bytes=size,
            now=utc_ms(now),
        )

    async def _batches(self) -> AsyncIterator[list[bytes]]:
        """The Redis keys of the store's records, in batches, from every primary."""
        # The prefix is literal text: escape the glob characters it may contain.
        pattern = "".join(f"\\{char}" if char in "*?[]\\" else char for char in self.prefix)
        batch: list[bytes] = []
        async for ref in self.client.scan_iter(match=pattern + r"\{*\}", count=1000, _type="hash"):
            batch.append(ref)
            if len(batch) == _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def _check(self, ref: str) -> None:
        if not (ref.startswith(self.prefix + "{") and ref.endswith("}")):
            raise ConfigurationError(f"not a record of this RedisStore: {ref!r}")


def _view(ref: str, reply: list[Any]) -> RecordView | None:
    """The record of an INSPECT reply (or of the same fields read by HMGET, absent ones
    ``None``); ``None`` when there is no record."""
    if len(reply) == 1:
        return None
    now, status, token, request_hash, lease, expires, response_status, size = (
        _text(value) if isinstance(value, bytes) else value for value in reply[:8]
    )
    state = RecordStatus(status)
    completed = state is RecordStatus.COMPLETED
    return RecordView(
        ref=ref,
        scope=None,
        key=None,
        status=state,
        fenced=False,
        request_hash=request_hash or "",
        created_at=None,
        lease_expires_at=utc_ms(int(lease or 0)),
        expires_at=utc_ms(int(expires or 0)),
        response_status=int(response_status) if completed and response_status else None,
        response_size=int(size) if completed else None,
        body=bytes(reply[8]) if len(reply) > 8 and completed else None,
        now=utc_ms(int(now)),
        version=record_version(token, state, False),
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
