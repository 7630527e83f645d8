"""Helpers for tests: :class:`MemoryStore`, a store that needs no server, and
:class:`StoreConformance`, the Store contract's cases as pytest tests for a store of your own
(imported on first use: it needs pytest)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from idempotency_mw.stores.base import ClaimsWithToken
from idempotency_mw.values.outcome import Asking, Found, decide, lookup_state
from idempotency_mw.values.records import (
    Claim,
    RecordState,
    RecordStatus,
    RecordView,
    StoredResponse,
    StoreStats,
    pair_of,
    pair_ref,
    record_version,
)

if TYPE_CHECKING:
    from idempotency_mw.operator.conformance import CASES, StoreConformance

__all__ = ["CASES", "MemoryStore", "StoreConformance"]


def __getattr__(name: str) -> Any:
    # The cases are pytest tests: MemoryStore alone needs no pytest.
    if name not in ("CASES", "StoreConformance"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from idempotency_mw.operator import conformance

    return getattr(conformance, name)


@dataclass(frozen=True, slots=True)
class _Record(Found):
    created: float = 0.0

    def owned_by(self, token: str, now: float) -> bool:
        return (
            self.status is RecordStatus.IN_PROGRESS
            and self.token == token
            and not self.expired(now)
        )


class MemoryStore(ClaimsWithToken):
    """Idempotency records in a dict of this process, with the full :class:`Store` contract.

    For tests, yours and the middleware's own: no server, no table. Records live as long as the
    store object and are seen only by the process that holds it, so it is not for production.
    ``clock`` gives the time in seconds (``time.time`` as it was when the store was made); pass
    your own to move leases and TTLs forward in a test without sleeping. It is
    :class:`~idempotency_mw.stores.base.Inspectable`, as the other stores are.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._records: dict[tuple[str, str], _Record] = {}
        # Every method runs without awaiting, so it is atomic within one event loop; the lock
        # covers apps tested from several threads (each with its own loop).
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many records the store holds, expired ones included until they are purged."""
        return len(self._records)

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
        with self._lock:
            now = self._clock()
            asking = Asking(fingerprint, binding, token, ttl, first_sent)
            decision = decide(self._records.get((scope, key)), now, asking)
            if decision.take:
                self._records[scope, key] = _Record(
                    RecordStatus.IN_PROGRESS,
                    fingerprint,
                    token,
                    binding,
                    now + lease,
                    now + ttl,
                    created=now,
                )
            return decision.claim(token)

    async def lookup(self, scope: str, key: str, *, binding: str = "") -> RecordState | None:
        """See :class:`~idempotency_mw.stores.base.KeyLookup` (this store marks no fenced
        commits: ``fence()`` writes its proof in the application's database)."""
        with self._lock:
            record = self._records.get((scope, key))
            if record is None or record.binding != binding:
                return None
            return lookup_state(record, self._clock())

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        return self._change(
            scope,
            key,
            token,
            lambda record, now: dataclasses.replace(record, lease_ends=now + lease),
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
        status = RecordStatus.UNREPLAYABLE if response is None else RecordStatus.COMPLETED
        return self._change(
            scope,
            key,
            token,
            lambda record, now: dataclasses.replace(
                record, status=status, response=response, lease_ends=now, expires=now + ttl
            ),
            settled_as=status,
        )

    async def release(self, scope: str, key: str, token: str) -> bool:
        return self._change(scope, key, token, lambda record, now: None)

    async def purge_expired(self, *, batch_size: int, scope: str | None = None) -> int | None:
        with self._lock:
            now = self._clock()
            expired = [
                name
                for name, record in self._records.items()
                if record.expired(now) and scope in (None, name[0])
            ]
            for name in expired[:batch_size]:
                del self._records[name]
            return min(len(expired), batch_size)

    async def startup(self) -> None:
        """Nothing to check."""

    async def aclose(self) -> None:
        """Nothing to close: the records stay for the next use."""

    def record_ref(self, scope: str, key: str) -> str:
        return pair_ref(scope, key)

    async def find_record(self, ref: str, *, with_body: bool = False) -> RecordView | None:
        name = pair_of(ref, "MemoryStore")
        with self._lock:
            record = self._records.get(name)
            return None if record is None else _view(name, record, self._clock(), with_body)

    async def list_records(self, status: RecordStatus, *, limit: int) -> list[RecordView]:
        with self._lock:
            now = self._clock()
            found = [(name, r) for name, r in self._records.items() if r.status is status]
        found.sort(key=lambda item: item[1].lease_ends)
        return [_view(name, record, now, False) for name, record in found[:limit]]

    async def scopes_of(self, key: str, *, limit: int) -> list[str] | None:
        with self._lock:
            return sorted(scope for scope, named in self._records if named == key)[:limit]

    async def force_release(self, record: RecordView) -> bool:
        name = pair_of(record.ref, "MemoryStore")
        with self._lock:
            held = self._records.get(name)
            if held is None or record_version(held.token, held.status, False) != record.version:
                return False
            del self._records[name]
            return True

    async def record_stats(self) -> StoreStats:
        with self._lock:
            now = self._clock()
            held = list(self._records.values())
        by_status = dict.fromkeys(RecordStatus, 0)
        for record in held:
            by_status[record.status] += 1
        started = [r.created for r in held if r.status is RecordStatus.IN_PROGRESS]
        return StoreStats(
            by_status=by_status,
            fenced=None,
            expired=sum(record.expired(now) for record in held),
            oldest_in_progress=_utc(min(started)) if started else None,
            size_bytes=None,
            now=_utc(now),
        )

    def _change(
        self,
        scope: str,
        key: str,
        token: str,
        change: Callable[[_Record, float], _Record | None],
        *,
        settled_as: RecordStatus | None = None,
    ) -> bool:
        """Apply ``change`` to the record ``token`` owns (``None`` deletes it); whether it did.

        A live record this token already settled as ``settled_as`` is this change's own earlier
        delivery: it counts as done, unchanged.
        """
        with self._lock:
            now = self._clock()
            record = self._records.get((scope, key))
            if record is None:
                return False
            if record.token == token and record.status is settled_as:
                return not record.expired(now)
            if not record.owned_by(token, now):
                return False
            changed = change(record, now)
            if changed is None:
                del self._records[scope, key]
            else:
                self._records[scope, key] = changed
            return True


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _view(name: tuple[str, str], record: _Record, now: float, with_body: bool) -> RecordView:
    response = record.response
    return RecordView(
        ref=pair_ref(*name),
        scope=name[0],
        key=name[1],
        status=record.status,
        fenced=False,
        request_hash=record.request_hash,
        created_at=_utc(record.created),
        lease_expires_at=_utc(record.lease_ends),
        expires_at=_utc(record.expires),
        response_status=None if response is None else response.status,
        response_size=None if response is None else len(response.body),
        body=response.body if with_body and response is not None else None,
        now=_utc(now),
        version=record_version(record.token, record.status, False),
    )
