"""A pipelined Redis connection: many concurrent commands on one socket, replies in order.

redis-py checks a connection out of its pool for every command, and packs, times and records
each one on the way; for one short script per request that costs about as much CPU as the round
trip itself. Here every command is written straight to one socket and waits on a future; the
replies, parsed by hiredis, settle the futures in the order the commands were sent. A server
that reads slower than commands come is felt as back-pressure: while the socket's write buffer
is full, new commands wait before they are written.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from idempotency_mw.stores.replies import ReplyWait

Arg = bytes | str | int


@dataclass(frozen=True)
class Address:
    """Where the server is and how to log in: a TCP ``host``/``port`` or a Unix ``path``."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None


def pack(args: Sequence[Arg]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class RespProtocol(asyncio.Protocol):
    """The socket's side: commands go out as written, replies settle waiters first in, first out.

    One timer watches the oldest waiter (the first to be answered): when its ``timeout`` ends
    without a reply, the connection is dropped and every waiter fails. ``on_push`` sees every
    reply first and takes those that answer no command (a subscriber's messages): it returns
    whether it took one. ``writable`` is clear while the transport asks us to stop writing.
    """

    def __init__(self, timeout: float, on_push: Callable[[Any], bool] | None = None) -> None:
        self._timeout = timeout
        self._on_push = on_push
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._watchdog: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.closed = asyncio.get_running_loop().create_future()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if self._on_push is not None and self._on_push(reply):
                    continue
                waiter, _ = self._waiting.popleft()
                if waiter.done():  # its caller was cancelled
                    continue
                if isinstance(reply, ResponseError):
                    waiter.set_exception(_error(reply))
                else:
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.close(RedisConnectionError(f"Redis sent an unreadable reply: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(RedisConnectionError(f"Redis closed the connection: {exc or 'EOF'}"))

    def close(self, reason: Exception) -> None:
        """Drop the connection; waiters fail with ``reason``, later sends with it too."""
        if self.lost is None:
            self.lost = reason
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.transport is not None:
            self.transport.abort()
        self.writable.set()  # what waits to write finds the connection lost
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(None)
        while self._waiting:
            waiter, _ = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Write ``command``; the future settles with its reply."""
        if self.lost is not None:
            raise self.lost
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        deadline = loop.time() + self._timeout
        self._waiting.append((waiter, deadline))
        if self._watchdog is None:
            self._watchdog = loop.call_at(deadline, self._watch)
        self.transport.write(command)
        return waiter

    def _watch(self) -> None:
        self._watchdog = None
        if not self._waiting:
            return
        waiter, deadline = self._waiting[0]
        loop = asyncio.get_running_loop()
        if deadline > loop.time():
            self._watchdog = loop.call_at(deadline, self._watch)
            return
        if not waiter.done():
            waiter.set_exception(RedisTimeoutError(f"no reply from Redis within {self._timeout} s"))
        self.close(RedisConnectionError("an earlier command on this connection timed out"))


def _error(reply: ResponseError) -> ResponseError:
    message = str(reply)
    return NoScriptError(message) if message.startswith("NOSCRIPT") else reply


class PipelinedConnection:
    """One connection to Redis shared by every caller, made on first use and after a loss.

    A command that finds the connection lost is sent once more on a new one, at once (all
    callers share the one new connection, so there is no stampede to spread out): callers must
    only send commands that are safe to run twice. A command without a reply within
    ``timeout`` seconds raises ``TimeoutError`` and drops the connection (what else is in
    flight on it fails with ``ConnectionError`` and is sent again); a caller bounds the whole
    call, resend included, with its own timeout (RedisStore does, by ``socket_timeout``). The
    connection belongs to the event loop that opened it: close it there (:meth:`aclose`)
    before using it from another loop.
    """

    def __init__(self, address: Address, *, timeout: float) -> None:
        self._address = address
        self._timeout = timeout
        self._protocol: RespProtocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[RespProtocol] | None = None
        self._replies = ReplyWait()

    async def execute(self, *args: Arg) -> Any:
        """Send one command and return its reply; Redis errors raise ``ResponseError``."""
        command = pack(args)
        try:
            return await self._round_trip(command)
        except RedisConnectionError:
            return await self._round_trip(command)

    async def aclose(self) -> None:
        """Close the connection; the next command opens a new one."""
        protocol, self._protocol = self._protocol, None
        if protocol is not None and self._loop is _loop():
            protocol.close(RedisConnectionError("connection closed by its owner"))

    async def _round_trip(self, command: bytes) -> Any:
        protocol = self._protocol
        if protocol is None or protocol.lost is not None or self._loop is not _loop():
            protocol = await self._connected()
        while not protocol.writable.is_set():  # woken together, the first to write may pause it
            await protocol.writable.wait()
        return await self._replies.wait(protocol.send(command))

    async def _connected(self) -> RespProtocol:
        """The live connection, opened once however many callers are waiting for it."""
        loop = _loop()
        if self._loop is not loop:
            # A connection belongs to the event loop that opened it.
            self._protocol, self._connecting, self._loop = None, None, loop
        opening = self._connecting
        if opening is None or (
            opening.done() and (opening.exception() is not None or opening.result().lost)
        ):
            opening = self._connecting = asyncio.ensure_future(self._open())
            # Its callers may all give up before it fails: its failure is theirs, or no one's.
            opening.add_done_callback(_seen)
        self._protocol = await asyncio.shield(opening)
        return self._protocol

    async def _open(self) -> RespProtocol:
        return await open_protocol(self._address, reply_timeout=self._timeout)


def _seen(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s failure as seen (asyncio reports one that no one retrieved)."""
    if not future.cancelled():
        future.exception()


async def open_protocol(
    address: Address, *, reply_timeout: float, on_push: Callable[[Any], bool] | None = None
) -> RespProtocol:
    """A connection to ``address``, logged in and on its database, within ``reply_timeout``
    (which then bounds each reply, see :class:`RespProtocol`)."""
    timeout = reply_timeout
    protocol: RespProtocol | None = None

    def make() -> RespProtocol:
        return RespProtocol(timeout, on_push)

    try:
        async with asyncio.timeout(timeout):
            if address.path is not None:
                _, protocol = await _loop().create_unix_connection(make, address.path)
            else:
                _, protocol = await _loop().create_connection(make, address.host, address.port)
            await _greet(protocol, address)
    except BaseException as exc:
        if protocol is not None:
            protocol.close(RedisConnectionError(f"could not log in to Redis: {exc}"))
        if isinstance(exc, TimeoutError):
            raise RedisTimeoutError(f"no connection to Redis within {timeout} s") from None
        if isinstance(exc, OSError):
            raise RedisConnectionError(f"could not connect to Redis: {exc}") from exc
        raise
    return protocol


async def _greet(protocol: RespProtocol, address: Address) -> None:
    """Log in and choose the database, as the URL says."""
    replies = []
    if address.password is not None:
        login = [address.username] if address.username else []
        replies.append(protocol.send(pack(["AUTH", *login, address.password])))
    if address.db:
        replies.append(protocol.send(pack(["SELECT", address.db])))
    for reply in replies:
        await reply


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()
