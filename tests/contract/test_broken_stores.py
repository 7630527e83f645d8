"""The shipped cases catch a broken store: each breaks one rule of the Store contract, and
the cases that name that rule fail while the others pass. A store that is only slow for a
moment is not taken for a broken one. The cases run as a user runs them: pytest on a test
module that subclasses ``StoreConformance``, the one the docs show."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from idempotency_mw import Claim, Store, StoredResponse
from idempotency_mw.testing import CASES, MemoryStore
from idempotency_mw.values.records import ClaimOutcome
from tests.support.readme import marked

pytest_plugins = ["pytester"]

#: The docs' test module and conftest for a store of one's own, run here as written, and on
#: the stores below in place of the conftest's.
USERS_MODULE = marked("file test_my_store.py (run by tests/contract/test_broken_stores.py)")
USERS_CONFTEST = marked("file conftest.py (its store fixture, for the block below)")


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


@dataclass
class Given:
    """A pytest plugin whose ``store`` fixture stands for the docs' conftest."""

    make: Callable[[], Store]

    @pytest.fixture
    def store(self) -> Store:
        return self.make()


def outcomes(
    pytester: pytest.Pytester, make: Callable[[], Store] | None, *cases: str
) -> dict[str, pytest.TestReport]:
    """Each case's report, as pytest ran the docs' test module on the stores ``make`` builds
    (``None``: the docs' conftest's)."""
    path = pytester.path / "test_my_store.py"
    path.write_text(USERS_MODULE.text)
    given = []
    if make is None:
        (pytester.path / "conftest.py").write_text(USERS_CONFTEST.text)
    else:
        given.append(Given(make))
    chosen = [f"{path}::TestMyStore::test_{case}" for case in cases] or [str(path)]
    # anyio's plugin only: loading every installed one costs seconds per run.
    plugins = ["--disable-plugin-autoload", "-p", "anyio", "-p", "no:cacheprovider"]
    run = pytester.inline_run(*plugins, *chosen, plugins=given)
    reports = run.getreports("pytest_runtest_logreport")
    ended = {
        report.nodeid.rpartition("::test_")[2]: report
        for report in reports
        if report.when == "call"
    }
    assert not [report for report in reports if report.when != "call" and not report.passed]
    return ended


def failed_cases(pytester: pytest.Pytester, broken: Callable[[], Store]) -> set[str]:
    ended = outcomes(pytester, broken)
    assert list(ended) == list(CASES)
    assert not [case for case, report in ended.items() if report.skipped]
    return {case for case, report in ended.items() if report.failed}


def test_the_docs_module_passes_as_written(pytester: pytest.Pytester) -> None:
    ended = outcomes(pytester, None)
    assert [case for case, report in ended.items() if report.passed] == list(CASES)


def test_a_store_that_ignores_the_token_on_complete_fails(pytester: pytest.Pytester) -> None:
    assert failed_cases(pytester, TokenBlindStore) == {
        "a_strangers_token_changes_nothing",
        "a_lapsed_lease_is_taken_over_and_the_stale_holder_changes_nothing",
        "a_completion_delivered_twice_is_acknowledged_both_times",
        "steps_that_skip_their_flush_have_the_same_outcomes",
    }


def test_a_store_that_reads_then_writes_fails(pytester: pytest.Pytester) -> None:
    assert failed_cases(pytester, ReadThenWriteStore) == {
        "of_concurrent_claims_exactly_one_acquires"
    }


@pytest.mark.parametrize("broken", [CallersClockStore, CallersMonotonicClockStore])
def test_a_store_on_the_callers_clock_fails(
    pytester: pytest.Pytester, broken: type[MemoryStore]
) -> None:
    assert failed_cases(pytester, broken) == {
        "leases_and_ttls_run_on_the_stores_clock",
        "first_sent_times_are_judged_on_the_stores_clock",
    }


def test_a_store_that_forgets_retention_fails(pytester: pytest.Pytester) -> None:
    # Kept as long as the lease, a record outlives a TTL shorter than its lease too.
    assert failed_cases(pytester, LeaseRetentionStore) == {
        "a_completed_record_keeps_its_retention",
        "an_expired_record_is_absent",
        "a_purge_never_touches_live_records",
    }


def test_a_store_whose_renewals_do_not_last_fails(pytester: pytest.Pytester) -> None:
    assert failed_cases(pytester, StaleRenewalStore) == {"a_renewed_lease_is_never_taken_over"}


def test_a_failure_names_what_the_store_did(pytester: pytest.Pytester) -> None:
    case = "leases_and_ttls_run_on_the_stores_clock"
    ended = outcomes(pytester, CallersClockStore, case)
    assert ended[case].failed
    said = "Failed: a claim from a worker a day ahead answered ACQUIRED, not IN_PROGRESS"
    assert said in ended[case].longreprtext


def test_a_stall_past_the_lease_is_judged_again_not_failed(pytester: pytest.Pytester) -> None:
    # A claim that reaches the store after the renewed lease ended may take the key over: the
    # case starts again on another key instead of failing the store.
    stalling = StallingStore()
    case = "a_renewed_lease_is_never_taken_over"
    assert outcomes(pytester, lambda: stalling, case)[case].passed
    assert stalling.stalls == 0
