"""The conformance suite catches a broken store: each breaks one rule of the Store contract,
and the cases that name that rule fail while the others pass. A store that is only slow for a
moment is not taken for a broken one."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from idempotency_mw import Claim, StoredResponse
from idempotency_mw.testing import ConformanceResult, MemoryStore, conformance
from idempotency_mw.values.records import ClaimOutcome

pytestmark = pytest.mark.anyio


class TokenBlindStore(MemoryStore):
    """Completes a record whatever token it is given: it passes on the holder's own."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[tuple[str, str], str] = {}

    async def _claim(self, scope: str, key: str, fingerprint: str, **options: Any) -> Claim:
        claim = await super()._claim(scope, key, fingerprint, **options)
        if claim.outcome is ClaimOutcome.ACQUIRED:
            self.holders[scope, key] = options["token"]
        return claim

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, **options: Any
    ) -> bool:
        holder = self.holders.get((scope, key), token)
        return await super().complete(scope, key, holder, response, **options)


class ReadThenWriteStore(MemoryStore):
    """Reads the record, then writes its claim in another step: claims that meet in between
    all see the key free."""

    async def _claim(self, scope: str, key: str, fingerprint: str, **options: Any) -> Claim:
        ref = self.record_ref(scope, key)
        seen = await self.find_record(ref)
        await anyio.lowlevel.checkpoint()  # the round trip between the read and the write
        if seen is None or seen.expired:
            written = await self.find_record(ref)
            if written is not None:
                await self.force_release(written)  # the write overwrites what it did not read
        return await super()._claim(scope, key, fingerprint, **options)


class CallersClockStore(MemoryStore):
    """Times leases and TTLs by the calling worker's wall clock, read at each call (what a store
    does that writes ``time.time() + lease`` into a shared table)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: time.time())


class CallersMonotonicClockStore(MemoryStore):
    """Times leases and TTLs by the calling process's monotonic clock, read at each call (no
    two machines' monotonic clocks agree)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: time.monotonic())


class LeaseRetentionStore(MemoryStore):
    """Keeps a completed record until its claim's lease ends, not for the TTL it was given."""

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse | None, **options: Any
    ) -> bool:
        record = await self.find_record(self.record_ref(scope, key))
        lease_left = 0.0
        if record is not None:
            lease_left = (record.lease_expires_at - record.now).total_seconds()
        options["ttl"] = max(lease_left, 0.001)
        return await super().complete(scope, key, token, response, **options)


class StaleRenewalStore(MemoryStore):
    """Acknowledges a renewal but keeps the lease it had: a key its holder renews is taken
    over as an orphan once the first lease ends (Powertools #8386)."""

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        record = await self.find_record(self.record_ref(scope, key))
        if record is None:
            return False
        left = (record.lease_expires_at - record.now).total_seconds()
        return await super().renew(scope, key, token, lease=left)


class StallingStore(MemoryStore):
    """Takes its first claim after a renewal only once the renewed lease has ended, as a stalled
    server or a paused machine would."""

    def __init__(self) -> None:
        super().__init__()
        self.stalls = 1
        self.renewed_for = 0.0

    async def renew(self, scope: str, key: str, token: str, *, lease: float) -> bool:
        self.renewed_for = lease
        return await super().renew(scope, key, token, lease=lease)

    async def _claim(self, scope: str, key: str, fingerprint: str, **options: Any) -> Claim:
        if self.renewed_for and self.stalls:
            self.stalls -= 1
            await anyio.sleep(self.renewed_for * 1.5)
        return await super()._claim(scope, key, fingerprint, **options)


async def failed_cases(broken: type[MemoryStore]) -> set[str]:
    result: ConformanceResult = await conformance(broken, tick=0.05)
    assert not result.skipped, str(result)
    assert not result.ok
    return {case.name for case in result.failed}


async def test_a_store_that_ignores_the_token_on_complete_fails() -> None:
    assert await failed_cases(TokenBlindStore) == {
        "a_strangers_token_changes_nothing",
        "a_lapsed_lease_is_taken_over_and_the_stale_holder_changes_nothing",
        "a_completion_delivered_twice_is_acknowledged_both_times",
        "steps_that_skip_their_flush_have_the_same_outcomes",
    }


async def test_a_store_that_reads_then_writes_fails() -> None:
    assert await failed_cases(ReadThenWriteStore) == {"of_concurrent_claims_exactly_one_acquires"}


@pytest.mark.parametrize("broken", [CallersClockStore, CallersMonotonicClockStore])
async def test_a_store_on_the_callers_clock_fails(broken: type[MemoryStore]) -> None:
    assert await failed_cases(broken) == {
        "leases_and_ttls_run_on_the_stores_clock",
        "first_sent_times_are_judged_on_the_stores_clock",
    }


async def test_a_store_that_forgets_retention_fails() -> None:
    # Kept as long as the lease, a record outlives a TTL shorter than its lease too.
    assert await failed_cases(LeaseRetentionStore) == {
        "a_completed_record_keeps_its_retention",
        "an_expired_record_is_absent",
        "a_purge_never_touches_live_records",
    }


async def test_a_store_whose_renewals_do_not_last_fails() -> None:
    assert await failed_cases(StaleRenewalStore) == {"a_renewed_lease_is_never_taken_over"}


async def test_the_result_names_each_failure_and_its_message() -> None:
    result = await conformance(
        CallersClockStore,
        cases=["first_claim_acquires_and_a_repeat_is_in_progress", *_CLOCK],
    )
    assert result.passed == ("first_claim_acquires_and_a_repeat_is_in_progress",)
    (failure,) = result.failed
    assert failure.name == _CLOCK[0]
    assert failure.message == "a claim from a worker a day ahead answered ACQUIRED, not IN_PROGRESS"
    lines = str(result).splitlines()
    assert lines[0].startswith("PASSED  first_claim_acquires_and_a_repeat_is_in_progress (")
    assert lines[1].startswith(f"FAILED  {_CLOCK[0]} (")
    assert lines[1].endswith(f": {failure.message}")
    assert lines[2] == "1 passed, 1 failed, 0 skipped"


_CLOCK = ["leases_and_ttls_run_on_the_stores_clock"]


async def test_an_unknown_case_is_refused() -> None:
    with pytest.raises(ValueError, match="no such conformance case: nope"):
        await conformance(MemoryStore, cases=["nope"])


async def test_a_stall_past_the_lease_is_judged_again_not_failed() -> None:
    # A claim that reaches the store after the renewed lease ended may take the key over: the
    # case starts again on another key instead of failing the store.
    stalling = StallingStore()
    result = await conformance(lambda: stalling, cases=["a_renewed_lease_is_never_taken_over"])
    assert result.ok, str(result)
    assert stalling.stalls == 0
