"""The check every Redis user of the library shares: a client made from a URL or given, and
never one that decodes replies (records and journal entries hold bytes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster

from idempotency_mw.values.exceptions import ConfigurationError

#: The asynchronous clients a store or journal talks through: one server (or Sentinel's
#: master) or a Cluster.
AsyncClient = redis.asyncio.Redis | RedisCluster
Client = TypeVar("Client", bound=redis.Redis | redis.asyncio.Redis | RedisCluster)


def binary_client(
    url: str | None,
    client: Client | None,
    make: Callable[[str], Client],
    *,
    owner: str,
    holds: str,
) -> tuple[Client, bool]:
    """The client to use, made from ``url`` or given, and whether ``owner`` made it."""
    if (url is None) == (client is None):
        raise ConfigurationError(f"{owner} needs exactly one of url= or client=")
    if client is None:
        try:
            client = make(str(url))
            if isinstance(client, redis.Redis | redis.asyncio.Redis):
                # redis-py hands a URL's options to each connection it opens: one it does not
                # know (a misspelt ?health_check_interval=) would fail every command later.
                pool = client.connection_pool
                pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigurationError(f"not a Redis URL redis-py takes: {exc}") from exc
    if client.get_encoder().decode_responses:
        raise ConfigurationError(
            f"{owner} needs a Redis client with decode_responses=False: {holds}"
        )
    return client, url is not None
