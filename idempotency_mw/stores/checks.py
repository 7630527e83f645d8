"""The settings that lose records, found before they do: ``idempotency-mw check``, the entries'
start-up check (:func:`check_store`) and the panel's overview all read them here.

Each store says what its server is set to (:class:`~idempotency_mw.stores.base.ServerChecked`);
this module adds the app's clock against the server's.
:func:`idempotency_mw.operator.admin.check` opens a store from its URL for them.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

from idempotency_mw.stores.base import ServerChecked, Store
from idempotency_mw.values.exceptions import ConfigurationError, SchemaError, StoreError
from idempotency_mw.values.findings import Finding, Severity

logger = logging.getLogger("idempotency_mw")

#: How far the app's clock may be from the store's.
CLOCK_TOLERANCE = 1.0
#: The stores checked at start-up in this process: once each, however many entries or
#: lifespans share one.
_checked: weakref.WeakSet[Store] = weakref.WeakSet()


async def findings(store: Store) -> tuple[Finding, ...]:
    """What can lose ``store``'s records: its server's settings (none for a store that cannot
    tell) and the app's clock against the server's. Raises
    :class:`~idempotency_mw.values.exceptions.StoreError` when the store does not answer."""
    if not isinstance(store, ServerChecked):
        return ()
    before = time.time()
    report = await store.check_server()
    after = time.time()
    if report.now is None:
        return report.findings
    # The server read its clock between the two readings of the app's.
    apart = max(report.now - after, before - report.now)
    if apart <= CLOCK_TOLERANCE:
        return report.findings
    side = "behind" if report.now > after else "ahead of"
    return (
        *report.findings,
        Finding(
            "the app's clock",
            f"{apart:.1f} s {side} the store's",
            "the app tells callers when a key ends (Idempotency-Key-Expires) and how old a "
            "first sending is on its own clock: a caller can retry after its record ended, "
            "and run again",
            "keep both clocks in sync (NTP)",
        ),
    )


def can_lose_records(found: tuple[Finding, ...]) -> bool:
    """Whether any of ``found`` can lose records (not only a note)."""
    return any(finding.severity is Severity.RISK for finding in found)


async def warn_at_startup(store: Store) -> None:
    """Log each finding of ``store`` once per process: a WARNING for each that can lose
    records, a note at INFO. A store that does not answer is logged, never raised: start-up
    goes on either way."""
    if store in _checked:
        return
    try:
        found = await findings(store)
    except StoreError as exc:
        logger.info("the settings of %r were not checked: %s", store, exc)
        return
    # A store that cannot be referred to weakly is checked at each start-up instead.
    with contextlib.suppress(TypeError):
        _checked.add(store)
    for finding in found:
        level = logging.WARNING if finding.severity is Severity.RISK else logging.INFO
        logger.log(level, "%r: %s (idempotency-mw check)", store, finding)


async def check_store(store: Store, *, server_checks: bool = True) -> None:
    """Check the store at start-up: a wrong schema or a setting the store's server refuses
    raises, an unreachable store only warns.

    A service must start (and a server must be able to replace a worker) while its store is
    down; keyed requests get 503 until the store answers. ``server_checks``: log a WARNING
    for each setting of the store's server that can lose records (what ``idempotency-mw
    check`` finds), once per store in the process.
    """
    try:
        await store.startup()
    except (SchemaError, ConfigurationError) as exc:
        logger.error("idempotency store not ready: %s", exc)
        raise
    except StoreError as exc:
        logger.warning(
            "idempotency store unreachable at start-up; keyed requests get 503 until it "
            "answers: %s",
            exc,
        )
        return
    if server_checks:
        await warn_at_startup(store)
