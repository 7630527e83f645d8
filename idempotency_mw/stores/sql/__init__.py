"""SQLStore and what it is made of: the table, each dialect's claim, drivers, migrations."""

from __future__ import annotations

from idempotency_mw.stores.sql.drivers import async_url
from idempotency_mw.stores.sql.store import SQLStore

__all__ = ["SQLStore", "async_url"]
