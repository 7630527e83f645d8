"""Deletes expired records: a background task in the app's lifespan, or one purge on demand."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

from idempotency_mw.exceptions import ConfigurationError, StoreError
from idempotency_mw.policy import Duration, to_seconds
from idempotency_mw.stores.base import Store

logger = logging.getLogger("idempotency_mw")

DEFAULT_BATCH_SIZE = 1000
DEFAULT_INTERVAL = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What one purge did."""

    deleted: int
    batches: int
    seconds: float
    #: The store deletes records by itself (Redis TTLs): there was nothing to purge.
    self_expiring: bool = False


async def purge(store: Store, *, batch_size: int = DEFAULT_BATCH_SIZE) -> PurgeReport:
    """Delete every expired record, ``batch_size`` rows per short transaction."""
    if batch_size < 1:
        raise ConfigurationError("batch_size must be at least 1")
    started = time.perf_counter()
    deleted = batches = 0
    while True:
        count = await store.purge_expired(batch_size=batch_size)
        if count is None:
            return PurgeReport(0, 0, time.perf_counter() - started, self_expiring=True)
        deleted += count
        batches += 1
        # A short batch means the end (or rows another purger holds right now).
        if count < batch_size:
            return PurgeReport(deleted, batches, time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class PurgeSchedule:
    """How often the background purge runs: every ``interval`` ± ``jitter`` (a fraction).

    The jitter spreads the purges of many instances that started together.
    """

    interval: Duration = DEFAULT_INTERVAL
    jitter: float = 0.2
    batch_size: int = DEFAULT_BATCH_SIZE

    def __post_init__(self) -> None:
        to_seconds(self.interval, "interval")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError("jitter must be a fraction in [0, 1)")
        if self.batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")

    async def run(self, store: Store) -> None:
        """Purge on this schedule until cancelled; store errors are logged and retried."""
        seconds = to_seconds(self.interval, "interval")
        while True:
            await asyncio.sleep(seconds * random.uniform(1 - self.jitter, 1 + self.jitter))
            try:
                report = await purge(store, batch_size=self.batch_size)
            except StoreError as exc:
                logger.warning("purge of expired idempotency records failed: %s", exc)
                continue
            if report.self_expiring:
                return
            if report.deleted:
                logger.info(
                    "purged %d expired idempotency records in %.3f s",
                    report.deleted,
                    report.seconds,
                )


@asynccontextmanager
async def background_purge(
    store: Store, schedule: PurgeSchedule | None = None
) -> AsyncIterator[None]:
    """Purge on ``schedule`` while the block runs (for a FastAPI ``lifespan=``)."""
    task = asyncio.create_task((schedule or PurgeSchedule()).run(store))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
