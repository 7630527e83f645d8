"""Safe retries for HTTP APIs: an ASGI ``Idempotency-Key`` middleware and its stores.

The server's names are imported on first use, so that the caller's half
(``idempotency_mw.client``) loads none of the server, and ``import idempotency_mw`` loads
neither SQLAlchemy nor redis-py: each store needs its extra (``[sql]``, ``[postgresql]``,
``[mysql]``, ``[redis]``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from idempotency_mw._version import __version__
from idempotency_mw.values.exceptions import (
    ConfigurationError,
    EffectCommitted,
    IdempotencyError,
    InvalidKey,
    LeaseLost,
    SchemaError,
    StoreError,
)
from idempotency_mw.values.key_sources import KeySource, from_header, from_json
from idempotency_mw.values.records import Claim, ClaimOutcome, StoredResponse
from idempotency_mw.values.settings import CallOptions, RouteOptions
from idempotency_mw.wire.keys import downstream_key

if TYPE_CHECKING:
    from idempotency_mw.engine.cleanup import PurgeSchedule
    from idempotency_mw.engine.fence import fence, fence_sync
    from idempotency_mw.functions import (
        BytesCodec,
        Codec,
        CommittedWithoutResult,
        CredentialMismatch,
        IdempotentFunctions,
        JSONCodec,
        KeyExpired,
        KeyReused,
        ResultNotReplayable,
        StillRunning,
    )
    from idempotency_mw.http.lifespan import store_lifespan
    from idempotency_mw.http.middleware import IdempotencyMiddleware, install
    from idempotency_mw.http.policy import idempotent
    from idempotency_mw.stores.base import Store
    from idempotency_mw.stores.redis import RedisStore
    from idempotency_mw.stores.sql import SQLStore

__all__ = [
    "BytesCodec",
    "CallOptions",
    "Claim",
    "ClaimOutcome",
    "Codec",
    "CommittedWithoutResult",
    "ConfigurationError",
    "CredentialMismatch",
    "EffectCommitted",
    "IdempotencyError",
    "IdempotencyMiddleware",
    "IdempotentFunctions",
    "InvalidKey",
    "JSONCodec",
    "KeyExpired",
    "KeyReused",
    "KeySource",
    "LeaseLost",
    "PurgeSchedule",
    "RedisStore",
    "ResultNotReplayable",
    "RouteOptions",
    "SQLStore",
    "SchemaError",
    "StillRunning",
    "Store",
    "StoreError",
    "StoredResponse",
    "__version__",
    "downstream_key",
    "fence",
    "fence_sync",
    "from_header",
    "from_json",
    "idempotent",
    "install",
    "store_lifespan",
]

#: The module of each name of the server, imported on first use.
_SERVER = {
    "PurgeSchedule": "idempotency_mw.engine.cleanup",
    **dict.fromkeys(["fence", "fence_sync"], "idempotency_mw.engine.fence"),
    **dict.fromkeys(
        [
            "BytesCodec",
            "Codec",
            "CommittedWithoutResult",
            "CredentialMismatch",
            "IdempotentFunctions",
            "JSONCodec",
            "KeyExpired",
            "KeyReused",
            "ResultNotReplayable",
            "StillRunning",
        ],
        "idempotency_mw.functions",
    ),
    "store_lifespan": "idempotency_mw.http.lifespan",
    **dict.fromkeys(["IdempotencyMiddleware", "install"], "idempotency_mw.http.middleware"),
    "idempotent": "idempotency_mw.http.policy",
    "Store": "idempotency_mw.stores.base",
}
#: Each store: its module, the packages it needs, and the extra that has them.
_STORES = {
    "SQLStore": ("idempotency_mw.stores.sql", ("sqlalchemy", "alembic"), "sql"),
    "RedisStore": ("idempotency_mw.stores.redis", ("redis",), "redis"),
}


def __getattr__(name: str) -> Any:
    if name in _SERVER:
        value = getattr(importlib.import_module(_SERVER[name]), name)
    elif name in _STORES:
        module, needs, extra = _STORES[name]
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.partition(".")[0] not in needs:
                raise
            from idempotency_mw.values.exceptions import install_extra

            raise ImportError(f"{name} needs {exc.name}: {install_extra(extra)}") from exc
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
