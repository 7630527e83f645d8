"""A subscription on a RESP connection of its own: the settlement feed of the pipelined
transport, without redis-py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from idempotency_mw.stores.feed import CHECK_AFTER
from idempotency_mw.stores.redis.resp import Address, open_protocol, pack


async def listen(
    address: Address, channel: str, on_message: Callable[[bytes], None], *, reply_timeout: float
) -> None:
    """Pass each message published on ``channel`` to ``on_message`` until the connection is
    lost (then raise), pinging it after ``CHECK_AFTER`` seconds of silence; the connection,
    the subscription and each ping get ``reply_timeout`` seconds."""
    heard = False

    def on_push(reply: Any) -> bool:
        nonlocal heard
        if isinstance(reply, list) and reply and reply[0] == b"message":
            heard = True
            on_message(reply[2])
            return True
        return False

    protocol = await open_protocol(address, reply_timeout=reply_timeout, on_push=on_push)
    try:
        await protocol.send(pack(["SUBSCRIBE", channel]))
        assert protocol.closed is not None
        while True:
            await asyncio.wait({protocol.closed}, timeout=CHECK_AFTER)
            if protocol.lost is not None:
                raise protocol.lost
            if not heard:
                await protocol.send(pack(["PING"]))
            heard = False
    finally:
        protocol.close(RedisConnectionError("the subscription ended"))
