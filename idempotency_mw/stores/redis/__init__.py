"""RedisStore: its Lua scripts (package resources in ``lua/``) and its connection."""

from __future__ import annotations

from idempotency_mw._redis_client import binary_client
from idempotency_mw.stores.redis.store import RedisStore

__all__ = ["RedisStore", "binary_client"]
