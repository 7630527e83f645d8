"""How SQLStore's statements reach the database: one file per driver, one rule to choose.

Every driver runs the same SQLAlchemy Core statements, each on its own in autocommit, and
takes the call's deadline as an argument. :func:`~.choice.open_driver` states the rule.
"""

from __future__ import annotations

from idempotency_mw.stores.sql.drivers.base import Driver
from idempotency_mw.stores.sql.drivers.choice import DriverChoice, async_url, open_driver
from idempotency_mw.stores.sql.drivers.sqlite import Synchronous

__all__ = ["Driver", "DriverChoice", "Synchronous", "async_url", "open_driver"]
