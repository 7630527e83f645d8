"""The check every Redis user of the library shares: a client made from a URL or given, and
never one that decodes replies (records and journal entries hold bytes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis
import redis.asyncio

from idempotency_mw.exceptions import ConfigurationError

Client = TypeVar("Client", redis.Redis, redis.asyncio.Redis)


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
        except ValueError as exc:
            raise ConfigurationError(f"not a Redis URL: {exc}") from exc
    if client.connection_pool.connection_kwargs.get("decode_responses", False):
        raise ConfigurationError(
            f"{owner} needs a Redis client with decode_responses=False: {holds}"
        )
    return client, url is not None
