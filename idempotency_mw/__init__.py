"""Safe retries for HTTP APIs: an ASGI ``Idempotency-Key`` middleware and its stores."""

from __future__ import annotations

from idempotency_mw._version import __version__
from idempotency_mw.cleanup import PurgeSchedule
from idempotency_mw.exceptions import ConfigurationError, IdempotencyError, SchemaError, StoreError
from idempotency_mw.lifespan import store_lifespan
from idempotency_mw.middleware import IdempotencyMiddleware, install
from idempotency_mw.policy import RouteOptions, idempotent
from idempotency_mw.records import Claim, ClaimOutcome, StoredResponse
from idempotency_mw.stores.base import Store
from idempotency_mw.stores.redis import RedisStore
from idempotency_mw.stores.sql import SQLStore

__all__ = [
    "Claim",
    "ClaimOutcome",
    "ConfigurationError",
    "IdempotencyError",
    "IdempotencyMiddleware",
    "PurgeSchedule",
    "RedisStore",
    "RouteOptions",
    "SQLStore",
    "SchemaError",
    "Store",
    "StoreError",
    "StoredResponse",
    "__version__",
    "idempotent",
    "install",
    "store_lifespan",
]
