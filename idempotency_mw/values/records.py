"""Values that travel between the layers: what the engine asks of a store, and what the
stores return (claims, responses, records as an operator sees them, counts)."""

from __future__ import annotations

import enum
import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from idempotency_mw.values.exceptions import ConfigurationError


class RecordStatus(enum.StrEnum):
    """Lifecycle of one key's record, as stored."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    #: The handler ran but its response exceeded the size limit, so it cannot be replayed.
    UNREPLAYABLE = "unreplayable"
    #: The handler's effect was committed (``fence``), but it gave no response worth recording.
    COMMITTED = "committed"


class ClaimOutcome(enum.Enum):
    """What a claim found; exactly one concurrent claim of a key gets ``ACQUIRED``."""

    ACQUIRED = "acquired"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"
    UNREPLAYABLE = "unreplayable"
    #: The record is bound to other credentials: never replayed to this caller, never re-run.
    CREDENTIAL_MISMATCH = "credential_mismatch"
    #: The effect was committed (``fence``) but no response is available.
    COMMITTED_WITHOUT_RESPONSE = "committed_without_response"
    #: No record of the key, and its caller first sent the call longer ago than ``ttl`` (or
    #: ahead of the store's clock): its record may be gone, so nothing was taken.
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as recorded: replayed byte for byte."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer to :meth:`Store.claim`.

    ``token`` is set only for ``ACQUIRED`` and must be presented to complete, renew or release the
    claim; ``response`` is set only for ``REPLAY``. ``expires_at`` (Unix seconds, the store's
    clock) is when the record found ends, for outcomes that found one of this caller's records
    (not ``ACQUIRED``, not ``CREDENTIAL_MISMATCH``); ``None`` where the store does not say.
    """

    outcome: ClaimOutcome
    token: str | None = None
    response: StoredResponse | None = None
    #: Told to the caller, never compared: two claims that decide alike are equal.
    expires_at: float | None = field(default=None, compare=False)


class KeyState(enum.StrEnum):
    """What a lookup by key tells its caller (see :class:`RecordState`)."""

    #: No record for this caller: never arrived, expired, purged, or another caller's.
    UNKNOWN = "unknown"
    IN_PROGRESS = "in-progress"
    COMPLETED = "completed"
    #: Its effect was committed (``fence``), its answer is not available.
    COMMITTED = "committed"


@dataclass(frozen=True, slots=True)
class RecordState:
    """A record as a lookup by key sees it (:meth:`~idempotency_mw.stores.base.KeyLookup.lookup`).

    Times are Unix seconds on the store's clock. ``lease_until`` is set while ``IN_PROGRESS``
    (in the past when the worker stopped renewing: a retry takes it over); ``status`` and
    ``response`` are the recorded answer's, when there is one.
    """

    state: KeyState
    expires_at: float
    lease_until: float | None = None
    status: int | None = None
    response: StoredResponse | None = None

    @property
    def replayable(self) -> bool:
        """Whether a retry with the key gets the recorded answer replayed."""
        return self.response is not None


def new_token() -> str:
    """A fresh claim token: 32 hex digits, unguessable."""
    return secrets.token_hex(16)


def pack_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """Headers as bytes: a length-prefixed name and value per header (no pickle, no JSON)."""
    parts: list[bytes] = []
    for name, value in headers:
        parts += [len(name).to_bytes(4, "big"), name, len(value).to_bytes(4, "big"), value]
    return b"".join(parts)


def unpack_headers(packed: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """The inverse of :func:`pack_headers`."""
    fields: list[bytes] = []
    offset = 0
    while offset < len(packed):
        length = int.from_bytes(packed[offset : offset + 4], "big")
        fields.append(packed[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return tuple(zip(fields[::2], fields[1::2], strict=True))


def utc_ms(ms: int) -> datetime:
    """A store's time (milliseconds since the Unix epoch) as a UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, UTC)


def record_version(token: str, status: RecordStatus, fenced: bool) -> str:
    """What tells one state of a record from another: a release acts only on the state it saw.

    The claim token stays inside the store; RedisStore's script computes the same digest.
    """
    seen = f"{token} {status.value}" + (" fenced" if fenced else "")
    return hashlib.sha1(seen.encode(), usedforsecurity=False).hexdigest()


def pair_ref(scope: str, key: str) -> str:
    """The ``ref`` of a record a store names by its scope and key (SQL, memory)."""
    return json.dumps([scope, key])


def pair_of(ref: str, store: str) -> tuple[str, str]:
    """The scope and key of :func:`pair_ref`'s ``ref``; a ConfigurationError for another."""
    try:
        scope, key = json.loads(ref)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"not a record of a {store}: {ref!r}") from exc
    if not isinstance(scope, str) or not isinstance(key, str):
        raise ConfigurationError(f"not a record of a {store}: {ref!r}")
    return scope, key


@dataclass(frozen=True, slots=True)
class RecordView:
    """One record as stored.

    ``ref`` names the record in its store (what :meth:`Inspectable.find_record` takes).
    ``scope`` and ``key`` are ``None`` where the store keeps only their digest (Redis), and are
    the stored names (maybe a ``sha256:`` digest of a long name) in a SQL listing.
    ``fenced``: a fenced commit marked the handler's effect as done. ``created_at`` is ``None``
    where the store keeps no such time; ``body`` is ``None`` unless it was asked for.
    """

    ref: str
    scope: str | None
    key: str | None
    status: RecordStatus
    fenced: bool
    request_hash: str
    created_at: datetime | None
    lease_expires_at: datetime
    expires_at: datetime
    response_status: int | None
    response_size: int | None
    body: bytes | None
    #: The store's clock when the record was read.
    now: datetime
    #: See :func:`record_version`.
    version: str

    @property
    def expired(self) -> bool:
        """Past its TTL and not held by a live lease: treated as absent, awaiting the purge."""
        return self.expires_at <= self.now and not (self.in_progress and not self.lease_lapsed)

    @property
    def in_progress(self) -> bool:
        """Whether a request holds (or held, until its lease lapsed) the key."""
        return self.status is RecordStatus.IN_PROGRESS

    @property
    def lease_lapsed(self) -> bool:
        """Whether the lease of the request that held it ended (its worker stopped renewing)."""
        return self.lease_expires_at <= self.now

    @property
    def stuck(self) -> bool:
        """In progress past its lease, TTL not over: its key answers 409 until it is taken."""
        return self.in_progress and self.lease_lapsed and not self.expired

    @property
    def releasable(self) -> bool:
        """Whether a release (without ``force``) may delete it: in progress, and its effect
        not committed (a release would let a retry run a committed effect again)."""
        return self.in_progress and not self.fenced


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts of a store's records.

    ``fenced`` counts the records whose effect a fenced commit marked, whatever their status
    (``None`` where the store takes no fenced commits). ``expired`` (awaiting the purge) is
    ``None`` for Redis, which deletes records itself; ``oldest_in_progress`` is ``None`` when
    nothing is in progress or the store keeps no creation time; ``size_bytes`` is the table's
    (or keys') size where the store tells it.
    """

    by_status: Mapping[RecordStatus, int]
    fenced: int | None
    expired: int | None
    oldest_in_progress: datetime | None
    size_bytes: int | None
    now: datetime

    @property
    def total(self) -> int:
        """All records, expired ones included."""
        return sum(self.by_status.values())
