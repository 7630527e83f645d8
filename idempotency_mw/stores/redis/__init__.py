"""RedisStore: its Lua scripts (package resources in ``lua/``) and its connection."""

from __future__ import annotations

from idempotency_mw.stores.redis.store import RedisStore, binary_client

__all__ = ["RedisStore", "binary_client"]
