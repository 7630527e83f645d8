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
from typing import Protocol

from idempotency_mw._backoff import Backoff
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.values.settings import Duration, to_seconds

logger = logging.getLogger("idempotency_mw")

DEFAULT_BATCH_SIZE = 1000
DEFAULT_INTERVAL = timedelta(minutes=10)
DEFAULT_FIRST_RETRY = timedelta(seconds=5)


class Purgeable(Protocol):
    """What a purge needs: a store, or the proof table
    (:class:`~idempotency_mw.engine.proofs.ProofTable`)."""

    async def purge_expired(self, *, batch_size: int) -> int | None:
        """Delete at most ``batch_size`` expired rows; ``None``: they expire by themselves."""
        ...


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What one purge did."""

    deleted: int
    batches: int
    seconds: float
    #: The store deletes records by itself (Redis TTLs): there was nothing to purge.
    self_expiring: bool = False


async def purge(store: Purgeable, *, batch_size: int = DEFAULT_BATCH_SIZE) -> PurgeReport:
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


@dataclass(slots=True)
class PurgeStats:
    """What a background purge has done so far: for a health check or a metric."""

    purges: int = 0
    deleted: int = 0
    #: Purges that raised; each is logged with its traceback.
    failures: int = 0


@dataclass(frozen=True, slots=True)
class PurgeSchedule:
    """How often the background purge runs: every ``interval`` ± ``jitter`` (a fraction).

    The jitter spreads the purges of many instances that started together. A purge that fails
    is tried again after ``first_retry``, then after twice as long each time, at most
    ``interval``, each pause shortened by up to ``jitter`` of it at random.
    """

    interval: Duration = DEFAULT_INTERVAL
    jitter: float = 0.2
    batch_size: int = DEFAULT_BATCH_SIZE
    first_retry: Duration = DEFAULT_FIRST_RETRY

    def __post_init__(self) -> None:
        to_seconds(self.interval, "interval")
        to_seconds(self.first_retry, "first_retry")
        if not 0 <= self.jitter < 1:
            raise ConfigurationError("jitter must be a fraction in [0, 1)")
        if self.batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")

    async def run(self, store: Purgeable, stats: PurgeStats | None = None) -> None:
        """Purge on this schedule until cancelled (or the store expires records by itself)."""
        stats = PurgeStats() if stats is None else stats
        interval = to_seconds(self.interval, "interval")
        retries = Backoff(
            first=to_seconds(self.first_retry, "first_retry"), cap=interval, jitter=self.jitter
        )

        def next_purge() -> float:
            return interval * random.uniform(1 - self.jitter, 1 + self.jitter)

        delay, failed_in_a_row = next_purge(), 0
        while True:
            await asyncio.sleep(delay)
            try:
                report = await purge(store, batch_size=self.batch_size)
            except Exception:
                stats.failures += 1
                delay = retries.delay(failed_in_a_row)
                failed_in_a_row += 1
                logger.exception(
                    "purge of expired idempotency records failed (%d in a row); next in %.1f s",
                    failed_in_a_row,
                    delay,
                )
                continue
            delay, failed_in_a_row = next_purge(), 0
            stats.purges += 1
            stats.deleted += report.deleted
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
    store: Purgeable, schedule: PurgeSchedule | None = None
) -> AsyncIterator[PurgeStats]:
    """Purge on ``schedule`` while the block runs (for a FastAPI ``lifespan=``).

    Yields the purge's :class:`PurgeStats`. A purge task that ended on an error of its own is
    logged when the block ends, never dropped silently.
    """
    stats = PurgeStats()
    task = asyncio.create_task((schedule or PurgeSchedule()).run(store, stats))
    try:
        yield stats
    finally:
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "the background purge of idempotency records had stopped on an error",
                exc_info=task.exception(),
            )
