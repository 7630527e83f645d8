"""A fault-injecting HTTP/1.1 proxy on 127.0.0.1, for showing what retries do to a service.

Each client connection carries one exchange: the proxy reads one request (framed by its
``Content-Length``), forwards it with ``Connection: close`` so that the service answers and
hangs up, and relays the response, which then says ``Connection: close`` to the client too.
That keeps framing trivial and works with any client, keep-alive or not. Per exchange, a
seeded random choice injects at most one fault (see :class:`Fault`).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import random
from contextlib import suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Self

HOST = "127.0.0.1"
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection"})
_NOT_IMPLEMENTED = b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Fault(enum.StrEnum):
    """What the proxy does with one exchange."""

    NONE = "forwarded"  # request and response relayed
    DROP_REQUEST = "request dropped"  # the client is hung up on; the service never sees it
    DROP_RESPONSE = "response dropped"  # the service acts; the client is hung up on
    DELAY = "delayed"  # the service acts; the response is held past the client's timeout


@dataclass(frozen=True, slots=True)
class FaultRates:
    """The probability of each fault per exchange (their sum is at most 1)."""

    drop_request: float = 0.0
    drop_response: float = 0.0
    delay: float = 0.0

    def __post_init__(self) -> None:
        rates = (self.drop_request, self.drop_response, self.delay)
        if any(not 0.0 <= rate <= 1.0 for rate in rates) or sum(rates) > 1.0:
            raise ValueError("fault rates must be in [0, 1] and sum to at most 1")

    def choose(self, rng: random.Random) -> Fault:
        """One fault (or :attr:`Fault.NONE`) drawn from ``rng``."""
        draw = rng.random()
        for fault, rate in (
            (Fault.DROP_REQUEST, self.drop_request),
            (Fault.DROP_RESPONSE, self.drop_response),
            (Fault.DELAY, self.delay),
        ):
            if draw < rate:
                return fault
            draw -= rate
        return Fault.NONE


class FaultProxy:
    """Listens on a free port of 127.0.0.1 and relays to ``upstream_port`` there.

    A delayed response is sent after ``delay`` seconds, or not at all if the client hangs up
    first. ``counts`` tallies the exchanges by :class:`Fault`. Use ``async with``, or
    :meth:`start` and :meth:`aclose`.
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        rates: FaultRates,
        delay: float,
        seed: int | None = None,
    ) -> None:
        self.upstream_port = upstream_port
        self.rates = rates
        self.delay = delay
        self.counts: collections.Counter[Fault] = collections.Counter()
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._closing = False
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return f"http://{HOST}:{self.port}"

    async def start(self) -> None:
        """Start listening."""
        self._closing = False
        self._server = await asyncio.start_server(self._accept, HOST, 0)

    async def aclose(self) -> None:
        """Stop listening and cut the exchanges in flight."""
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        for task in self._handlers:
            task.cancel()
        # Before 3.12, wait_closed() does not wait for the connections' handlers.
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, so that its task is tracked before it first runs.
        if self._closing:
            writer.close()
            return
        task = asyncio.create_task(self._handle(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._exchange(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a client or the service hung up mid-exchange: nothing left to relay
        finally:
            writer.close()
            with suppress(ConnectionError):
                await writer.wait_closed()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head[:-4].split(b"\r\n")
        headers = [line.partition(b":") for line in header_lines]
        fields = {name.strip().lower(): value.strip() for name, _, value in headers}
        if b"transfer-encoding" in fields or not fields.get(b"content-length", b"0").isdigit():
            writer.write(_NOT_IMPLEMENTED)
            await writer.drain()
            return
        body = await reader.readexactly(int(fields.get(b"content-length", b"0")))
        fault = self.rates.choose(self._rng)
        self.counts[fault] += 1
        if fault is Fault.DROP_REQUEST:
            return
        kept = [b"".join(parts) for parts in headers if parts[0].strip().lower() not in _HOP_BY_HOP]
        request = b"\r\n".join([request_line, *kept, b"Connection: close", b"", b""]) + body
        response = await self._forward(request)
        if fault is Fault.DROP_RESPONSE:
            return
        if fault is Fault.DELAY and await self._client_leaves(reader):
            return
        writer.write(response)
        await writer.drain()

    async def _forward(self, request: bytes) -> bytes:
        """The service's whole response to ``request`` (it hangs up when done)."""
        upstream_reader, upstream_writer = await asyncio.open_connection(HOST, self.upstream_port)
        try:
            upstream_writer.write(request)
            await upstream_writer.drain()
            return await upstream_reader.read()
        finally:
            upstream_writer.close()
            with suppress(ConnectionError):
                await upstream_writer.wait_closed()

    async def _client_leaves(self, reader: asyncio.StreamReader) -> bool:
        """Whether the client hangs up within the delay."""
        try:
            async with asyncio.timeout(self.delay):
                await reader.read()
        except TimeoutError:
            return False
        return True
