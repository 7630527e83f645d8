"""The Store protocol: the only thing the middleware knows about persistence."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from idempotency_mw.values.findings import ServerCheck
from idempotency_mw.values.records import (
    Claim,
    RecordState,
    RecordStatus,
    RecordView,
    StoredResponse,
    StoreStats,
    new_token,
)


def takes_keyword(method: Callable[..., object], name: str) -> bool:
    """Whether ``method`` accepts the keyword ``name`` (a store's method written for an earlier
    protocol may not); one without a signature is taken on trust."""
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


@runtime_checkable
class Store(Protocol):
    """Persistence of idempotency records.

    A record is identified by ``(scope, key)``. Every change to a record is one atomic step in
    the backend (a single SQL statement, a single Lua script), never a read followed by a
    separate write. Times are measured by the backend's clock, never the caller's.

    Contract of :meth:`claim` (decided by :func:`~idempotency_mw.values.outcome.decide` over the
    record's fields and the store's clock) for a record that is:

    - absent, expired (past its TTL and not in progress), or in progress with a lapsed lease,
      the same fingerprint and binding, and no committed effect: taken over, a fresh token
      issued: ``ACQUIRED``. An in-progress record whose lease lapsed and whose TTL also ended is
      taken over whatever it holds;
    - present with another ``binding`` (a digest of the caller's credentials; ``""`` for none):
      ``CREDENTIAL_MISMATCH``, before anything else is compared;
    - present with another fingerprint: ``MISMATCH``;
    - in progress within its lease: ``IN_PROGRESS``;
    - in progress with its effect committed (a fenced commit the store knows of) and its lease
      lapsed: its holder may still be alive behind a store that stalled, and able to record its
      answer. The first such claim answers ``IN_PROGRESS`` and, in the same atomic step, gives
      the record one more ``lease``, on probation; the holder's :meth:`renew` or settlement
      ends the probation. A claim that finds the lease lapsed again while on probation (the
      holder was not heard from for a whole lease): ``COMMITTED_WITHOUT_RESPONSE``. A store
      that keeps no mark of a fenced commit (its proof is in the application's database:
      Redis, ``MemoryStore``) never holds such a record;
    - settled as committed without a response: ``COMMITTED_WITHOUT_RESPONSE``;
    - completed: ``REPLAY`` with the stored response;
    - completed without a replayable response: ``UNREPLAYABLE``.

    A claim that would take the key (absent, expired, or taken over) given a ``first_sent``
    (Unix seconds: when its caller first sent the call) longer than ``ttl`` before the store's
    clock, or further ahead than :data:`~idempotency_mw.values.outcome.FIRST_SENT_SKEW`, takes
    nothing and answers ``EXPIRED``: the caller's record may have been purged.

    Of any number of concurrent claims of one absent key, across processes, exactly one is
    ``ACQUIRED``. :meth:`renew`, :meth:`complete` and :meth:`release` act only while the token
    still owns the record and return whether they did, so a worker that lost its lease cannot
    overwrite the record of the one that took over. Once both the lease and the TTL of an
    in-progress record have passed, the record counts as absent even if nobody took it over:
    they return ``False`` and change nothing, so a late writer never revives it.

    Every step may reach the backend twice (a reply lost, the statement run again): a claim that
    finds the record in progress under its own token answers ``ACQUIRED`` with that token again,
    and a completion that finds it settled as it would settle it answers ``True`` again.

    ``durable=False`` (of :meth:`claim` and :meth:`complete`) says the caller's effect is fenced
    in its application's own transaction, which decides whether it happened: the step need not
    wait for its own flush to disk, and may be lost in a crash (never half-applied). The
    outcomes are the same. A store may ignore it (``MemoryStore``, Redis, MariaDB/MySQL: every
    step stays durable, which is always safe); a store whose methods lack the keyword is simply
    never given it.

    A claim that finds a record of the caller's (any outcome but ``ACQUIRED`` and
    ``CREDENTIAL_MISMATCH``) may say when it ends in ``Claim.expires_at``; the middleware then
    tells the caller (the ``Idempotency-Key-Expires`` header).

    Backend failures raise :class:`~idempotency_mw.values.exceptions.StoreError`.

    A store may also offer :class:`SettlementFeed` and :class:`KeyLookup`, which are optional:
    no store has to (every store of this package offers :class:`KeyLookup`).
    """

    async def claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        binding: str = "",
        durable: bool = True,
        first_sent: float | None = None,
    ) -> Claim:
        """Claim ``key`` for a request whose hash is ``fingerprint`` (times in seconds)."""
        ...

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        """Extend the lease of a claim still in progress."""
        ...

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
        """Record the response (``None``: not replayable); the record then lives for ``ttl``."""
        ...

    async def release(self, scope: str, key: str, token: str) -> bool:
        """Forget an in-progress claim so that a retry runs the request again.

        A record whose effect was committed is never forgotten: it is settled as committed
        without a response instead.
        """
        ...

    async def purge_expired(self, *, batch_size: int) -> int | None:
        """Delete at most ``batch_size`` expired records in one short step; return how many.

        Records in progress within their lease are never touched. ``None`` means the store
        expires records by itself (Redis) and there is nothing to purge.
        """
        ...

    async def startup(self) -> None:
        """Check that the backend is ready to use (raises SchemaError when it is not)."""
        ...

    async def aclose(self) -> None:
        """Release what the store opened itself; never what it was given."""
        ...


@runtime_checkable
class SettlementFeed(Protocol):
    """An optional capability of a store: news of records settled by any worker.

    Not part of :class:`Store`. A store offers it when its backend can push changes
    (PostgreSQL LISTEN/NOTIFY, Redis pub/sub); the middleware then wakes a request that waits
    for a key (``wait=``) as soon as any worker completes or releases it, and otherwise polls.
    """

    async def watch_settlements(self, on_settled: Callable[[str], None]) -> None:
        """Call ``on_settled(digest)`` each time any worker completes or releases a record,
        until cancelled or until the store is closed (then it returns).

        ``digest`` is :func:`~idempotency_mw.values.metrics.key_hash` of the record's scope and key,
        never the key. News is best effort: a notification sent while the listening
        connection is down is lost, and a digest may be repeated or shared by two keys, so a
        waiter always checks the record itself. A lost connection is logged and opened again
        with capped backoff; it never ends the watch. Raises
        :class:`~idempotency_mw.values.exceptions.SettlementFeedUnsupported` when this store's
        backend cannot (e.g. a SQLStore on SQLite).
        """
        ...


@runtime_checkable
class KeyLookup(Protocol):
    """An optional capability of a store: a caller's look at its own key's record, without
    claiming it (``lookup_path=`` of the middleware, ``IdempotentFunctions.lookup``, the MCP
    lookup). A read: it changes nothing, in one statement or script with the backend's clock.
    """

    async def lookup(self, scope: str, key: str, *, binding: str = "") -> RecordState | None:
        """The state of the record of ``(scope, key)``, or ``None`` when the caller has none:
        no record, one that counts as absent (past its TTL, no live lease), or one bound to
        other credentials than ``binding`` (so another caller learns nothing, not even that
        the key exists). The recorded response is read along when the record holds one.
        See :func:`~idempotency_mw.values.outcome.lookup_state`.
        """
        ...


@runtime_checkable
class Inspectable(Protocol):
    """An optional capability of a store: an operator's look at its records (the CLI, the
    panel), through the store's own statements and scripts.

    A record is named by a ``ref`` (:meth:`record_ref`), which listings return too. Times come
    from the backend's clock; bodies are read only when asked for.
    """

    def record_ref(self, scope: str, key: str) -> str:
        """The name of the record of ``(scope, key)`` in this store (no I/O)."""
        ...

    async def find_record(self, ref: str, *, with_body: bool = False) -> RecordView | None:
        """The record named ``ref``, or ``None`` when there is none (an expired one is found)."""
        ...

    async def list_records(self, status: RecordStatus, *, limit: int) -> list[RecordView]:
        """At most ``limit`` records in ``status``, the earliest lease end first (so the keys
        stuck longest in progress come first)."""
        ...

    async def scopes_of(self, key: str, *, limit: int) -> list[str] | None:
        """At most ``limit`` scopes that hold a record of ``key``; ``None`` when the store
        cannot tell (it keeps only a digest of scope and key)."""
        ...

    async def force_release(self, record: RecordView) -> bool:
        """Delete ``record`` if it is still as it was read (its ``version``), whatever its
        status; whether it did. The key's next request then runs again."""
        ...

    async def record_stats(self) -> StoreStats:
        """Counts of the store's records by status, fenced and expired, and their size."""
        ...


class ClaimFields(Protocol):
    """What a live claim's record holds: enough to write the record again (the fence's
    re-write of a claim lost before its flush)."""

    scope: str
    key: str
    token: str
    fingerprint: str
    binding: str
    ttl: float
    lease: float


@runtime_checkable
class ServerChecked(Protocol):
    """An optional capability of a store: a look at the settings of its server that can lose
    records (``idempotency-mw check``, the start-up warnings, the panel)."""

    async def check_server(self) -> ServerCheck:
        """The findings about the server's settings, and its clock, read through the store's
        own client; a setting the server will not show is a note, never an error. Backend
        failures raise :class:`~idempotency_mw.values.exceptions.StoreError`."""
        ...


class ClaimsWithToken(abc.ABC):
    """A store whose :meth:`claim` is :meth:`_claim` with a fresh token.

    ``_claim`` with a token already used is that claim delivered again: the conformance cases
    (:class:`idempotency_mw.testing.StoreConformance`) call it twice to check that a store
    recognises its own token, on a store of this class only (they skip that case on any other).
    """

    async def claim(
        self,
        scope: str,
        key: str,
        fingerprint: str,
        *,
        ttl: float,
        lease: float,
        binding: str = "",
        durable: bool = True,
        first_sent: float | None = None,
    ) -> Claim:
        """Claim ``key`` for a request whose hash is ``fingerprint`` (see :class:`Store`)."""
        return await self._claim(
            scope,
            key,
            fingerprint,
            ttl=ttl,
            lease=lease,
            token=new_token(),
            binding=binding,
            durable=durable,
            first_sent=first_sent,
        )

    @abc.abstractmethod
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
        durable: bool = True,
        first_sent: float | None = None,
    ) -> Claim:
        """:meth:`claim` with the request's ``token``."""
