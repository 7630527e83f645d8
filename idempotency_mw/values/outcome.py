"""What a claim of a key finds: one decision over the record's fields and the store's clock,
:func:`decide`, asked by every store's claim and, through :func:`lookup_state`, by every lookup.

A store reads the record and its clock in the one statement or script that takes the key when
it is free (the take stays atomic there: INSERT ... ON CONFLICT, a Lua script, a lock); what it
did not take, it hands here with the clock it read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from idempotency_mw.values.records import (
    Claim,
    ClaimOutcome,
    KeyState,
    RecordState,
    RecordStatus,
    StoredResponse,
)

#: How far ahead of the store's clock a first-sent time may be (the caller's clock runs
#: ahead). An older one is never excused: refusing early is safe, running late is not.
FIRST_SENT_SKEW = 30.0


def too_old(first_sent: float | None, ttl: float, now: float) -> bool:
    """Whether an operation first sent at ``first_sent`` may have had a record that is gone:
    sent longer than ``ttl`` before ``now`` (the store's clock), or further ahead than
    :data:`FIRST_SENT_SKEW`."""
    return first_sent is not None and not (now - ttl <= first_sent <= now + FIRST_SENT_SKEW)


class Fenced(enum.Enum):
    """What a record says of its effect's fenced commit (only a SQL store marks one)."""

    NO = "no"
    COMMITTED = "committed"
    #: Committed, and its lease lapsed once: a claim gave its holder one more lease.
    ON_PROBATION = "on_probation"


@dataclass(frozen=True, slots=True)
class Found:
    """A key's record as a store read it; times are Unix seconds on the store's clock."""

    status: RecordStatus
    request_hash: str
    token: str
    binding: str
    lease_ends: float
    expires: float
    fenced: Fenced = Fenced.NO
    #: A completed record's response (``None`` otherwise).
    response: StoredResponse | None = None

    def expired(self, now: float) -> bool:
        """Past its TTL and not held by a live lease: as good as absent."""
        return self.expires <= now and not (
            self.status is RecordStatus.IN_PROGRESS and self.lease_ends > now
        )


class Asking(NamedTuple):
    """The claim that asks: what it means, whose it is, its token, the route's ``ttl`` and
    when its caller first sent it (Unix seconds, if it said)."""

    fingerprint: str
    binding: str = ""
    token: str = ""
    ttl: float = 0.0
    first_sent: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """What a claim finds. ``take``: the key is free, and the claim takes it (``ACQUIRED``);
    ``probation``: the holder's lease lapsed after its effect committed, so the claim answers
    ``IN_PROGRESS`` once it gave the holder one more lease, in one atomic step."""

    outcome: ClaimOutcome
    expires_at: float | None = None
    response: StoredResponse | None = None
    take: bool = False
    probation: bool = False

    def claim(self, token: str) -> Claim:
        """The claim's answer (``token``: the asking claim's, if it acquired the key)."""
        if self.outcome is ClaimOutcome.ACQUIRED:
            return Claim(self.outcome, token=token)
        return Claim(self.outcome, response=self.response, expires_at=self.expires_at)


_TAKE = Decision(ClaimOutcome.ACQUIRED, take=True)
_MINE = Decision(ClaimOutcome.ACQUIRED)
_NOT_THEIRS = Decision(ClaimOutcome.CREDENTIAL_MISMATCH)
_SETTLED = {
    RecordStatus.COMPLETED: ClaimOutcome.REPLAY,
    RecordStatus.UNREPLAYABLE: ClaimOutcome.UNREPLAYABLE,
    RecordStatus.COMMITTED: ClaimOutcome.COMMITTED_WITHOUT_RESPONSE,
}


def decide(found: Found | None, now: float, asking: Asking) -> Decision:
    """The outcome of ``asking``'s claim of a key whose record is ``found`` (``None``: there
    is none) at ``now`` on the store's clock. See :class:`~idempotency_mw.stores.base.Store`
    for the rules; a store takes the key exactly when this says ``take``."""
    if found is None or found.expired(now):
        return _fresh_or_refused(now, asking)
    in_progress = found.status is RecordStatus.IN_PROGRESS
    if in_progress and found.token == asking.token:
        return _MINE  # the same claim delivered again
    lapsed = in_progress and found.lease_ends <= now
    same = found.request_hash == asking.fingerprint and found.binding == asking.binding
    if lapsed and same and found.fenced is Fenced.NO:
        return _fresh_or_refused(now, asking)  # the same request's worker stopped renewing
    if found.binding != asking.binding:
        return _NOT_THEIRS
    if found.request_hash != asking.fingerprint:
        return Decision(ClaimOutcome.MISMATCH, found.expires)
    if not in_progress:
        return Decision(_SETTLED[found.status], found.expires, found.response)
    if lapsed and found.fenced is Fenced.ON_PROBATION:
        # Its holder was not heard from for a whole lease of probation.
        return Decision(ClaimOutcome.COMMITTED_WITHOUT_RESPONSE, found.expires)
    return Decision(ClaimOutcome.IN_PROGRESS, found.expires, probation=lapsed)


def _fresh_or_refused(now: float, asking: Asking) -> Decision:
    """A free key: taken, unless its caller first sent the call too long ago to tell."""
    if too_old(asking.first_sent, asking.ttl, now):
        return Decision(ClaimOutcome.EXPIRED)
    return _TAKE


def lookup_state(found: Found | None, now: float) -> RecordState | None:
    """What a lookup by the record's own caller tells of ``found`` (read at ``now``): what a
    retry of its request would find (:func:`decide`), or ``None`` when it counts as absent."""
    if found is None or found.expired(now):
        return None
    decision = decide(found, now, Asking(found.request_hash, found.binding))
    if decision.outcome in (ClaimOutcome.ACQUIRED, ClaimOutcome.IN_PROGRESS):
        # Kept while its lease holds, even past its TTL (a lapsed one: a retry takes it over).
        expires = max(found.expires, found.lease_ends)
        return RecordState(KeyState.IN_PROGRESS, expires, lease_until=found.lease_ends)
    if decision.outcome is ClaimOutcome.COMMITTED_WITHOUT_RESPONSE:
        return RecordState(KeyState.COMMITTED, found.expires)
    response = found.response
    return RecordState(
        KeyState.COMPLETED,
        found.expires,
        status=None if response is None else response.status,
        response=response,
    )
