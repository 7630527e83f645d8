"""SQLStore and what it is made of: the table, each dialect's claim, its engine, migrations."""

from __future__ import annotations

from idempotency_mw.stores.sql.database import async_url
from idempotency_mw.stores.sql.store import SQLStore

__all__ = ["SQLStore", "async_url"]
