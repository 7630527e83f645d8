"""Keeps an operation's lease renewed, from a thread of its own, while a request is in flight."""

from __future__ import annotations

import logging
import threading

from idempotency_mw.client.journals import Journal
from idempotency_mw.exceptions import describe

logger = logging.getLogger("idempotency_mw.client")


class Renewal:
    """Renews ``holder``'s lease on ``key`` every ``every`` seconds until :meth:`stop`.

    A thread, so that a blocking journal never stalls the request, sync or async. A renewal
    that fails is logged; the client takes the lease again before its next attempt, and waits
    for the other holder if it cannot.
    """

    def __init__(
        self, journal: Journal, key: str, *, holder: str, seconds: float, every: float, name: str
    ) -> None:
        self._journal = journal
        self._key = key
        self._holder = holder
        self._seconds = seconds
        self._every = every
        self._name = name
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idempotency-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing, once a renewal in progress has ended."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._every):
            try:
                held = self._journal.acquire(self._key, self._holder, self._seconds)
            except Exception as exc:  # the journal is unreachable: the lease may lapse
                logger.warning("renewing the lease on %s failed: %s", self._name, describe(exc))
                continue
            if not held:
                logger.warning("the lease on %s was taken over while sending", self._name)
                return
