"""When a statement that failed may run again, and how long to pause before it does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from idempotency_mw._backoff import Backoff

T = TypeVar("T")

ATTEMPTS = 3
#: Pauses between attempts: short, jittered so that two deadlock victims do not meet again.
PAUSES = Backoff(first=0.005, cap=0.05)
MYSQL_DEADLOCK = 1213
#: Deadlock victim, and the codes of a connection that is gone (as SQLAlchemy reads them).
MYSQL_RERUN = frozenset({MYSQL_DEADLOCK, 1927, 2006, 2013, 2014, 2045, 2055, 4031})
#: READ COMMITTED spares MariaDB/MySQL the gap locks that make concurrent purges deadlock.
READ_COMMITTED = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"


async def with_reruns(
    run: Callable[[], Awaitable[T]], may_rerun: Callable[[Exception], bool], *, deadline: float
) -> T:
    """``run()``, run again (up to ``ATTEMPTS`` in all, never past ``deadline``) when it fails
    as ``may_rerun`` allows.

    Every statement of the store is safe to run twice; this covers a pooled connection that
    died unnoticed (an outage, a server restart) and a deadlock's victim, which InnoDB rolls
    back whole.
    """
    attempt = 0
    while True:
        try:
            return await run()
        except Exception as exc:
            pause = PAUSES.delay(attempt)
            if (
                attempt + 1 >= ATTEMPTS
                or not may_rerun(exc)
                or time.monotonic() + pause >= deadline
            ):
                raise
        await asyncio.sleep(pause)
        attempt += 1


def deadlock(exc: Exception) -> bool:
    """Whether SQLAlchemy raised ``exc`` for a MariaDB/MySQL deadlock's victim."""
    return isinstance(exc, DBAPIError) and mysql_error_code(exc) == MYSQL_DEADLOCK


def mysql_error_code(exc: Exception) -> object:
    """The MySQL error code of a driver error, or of the one SQLAlchemy wrapped."""
    error = exc.orig if isinstance(exc, DBAPIError) else exc
    args = getattr(error, "args", ())
    return args[0] if args else None
