"""The event hook: what the middleware reports, for metrics, traces and logs of your own."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class EventKind(enum.StrEnum):
    """What happened to one keyed request, or one store call."""

    FIRST_RUN = "first_run"
    REPLAY = "replay"
    MISMATCH = "mismatch"
    IN_PROGRESS = "in_progress"
    NOT_REPLAYABLE = "not_replayable"
    RELEASED = "released"
    STORE_ERROR = "store_error"
    LEASE_LOST = "lease_lost"
    CREDENTIAL_MISMATCH = "credential_mismatch"
    RECORD_TOO_LARGE = "record_too_large"
    COMMITTED_WITHOUT_RESPONSE = "committed_without_response"
    #: One store operation finished (ok or not).
    STORE_CALL = "store_call"
    #: A claim was acquired / settled: the in-flight gauge goes up / down.
    CLAIM_STARTED = "claim_started"
    CLAIM_ENDED = "claim_ended"


@dataclass(frozen=True, slots=True)
class Event:
    """One event; ``key_hash`` is 12 hex characters of a digest of scope and key, never the key."""

    kind: EventKind
    key_hash: str
    method: str
    route: str
    #: STORE_CALL only: "claim", "renew", "complete", "release" or "purge".
    operation: str | None = None
    #: STORE_CALL: ``time.time()`` when the call started (for spans).
    started_at: float | None = None
    #: STORE_CALL: seconds the call took.
    duration: float | None = None
    #: STORE_CALL and STORE_ERROR: the error, on one line.
    error: str | None = None


EventHook = Callable[[Event], None]
