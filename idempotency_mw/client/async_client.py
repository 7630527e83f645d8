"""IdempotentClient: the async client, running the protocol on the async interpreter."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar, Unpack

import anyio
import anyio.to_thread
import httpx

from idempotency_mw.client._base import ClientBase, check_http_options
from idempotency_mw.client._closing import AClosedOnExit
from idempotency_mw.client._drive import AsyncDriver, AsyncProbe
from idempotency_mw.client.journals import DEFAULT_JOURNAL_PATH, Journal
from idempotency_mw.client.protocol import ProtocolOptions, Steps
from idempotency_mw.client.values import JournalEntry, Operation, OperationState, RequestParts

T = TypeVar("T")

__all__ = ["AsyncProbe", "IdempotentClient"]


class IdempotentClient(ClientBase[httpx.AsyncClient], AClosedOnExit):
    """An async client whose non-GET operations are safe to retry.

    ``http`` is the httpx client to send with; when omitted, one is made on ``base_url`` with
    ``headers`` and ``auth`` (only that one is closed by :meth:`aclose`). ``journal`` is a
    :class:`Journal` or the path of a SQLite file. Keys read
    ``<key_prefix>-<session_id>:<operation>:<sequence>:<random>``; an operation decided inside
    a handler (or idempotent function, or MCP tool) the middleware protects takes a key derived
    from that call's (see :func:`~idempotency_mw.wire.keys.operation_key`), so a re-run
    of the handler sends it again under the same key.

    ``lookup_path``: where the server answers ``GET <lookup_path>/<key>`` (its middleware's
    option): after an attempt whose outcome was lost, the client asks there before it sends
    again, and settles the operation without sending when the server holds its outcome.
    Every attempt carries ``first_sent_header`` (``Repeatability-First-Sent``; ``None`` sends
    none), so that a server refuses (412) a retry it can no longer tell from a new request;
    the operation then needs confirmation. The server's ``Idempotency-Key-Expires`` is
    journaled, and a :class:`ClientEvent` with ``kept_until`` warns when the retries may
    outlast it.

    ``retention`` (default 23 hours, under the server's default TTL of 24): an operation whose
    first attempt is older is never re-sent blindly, but looked up by its probe in ``confirm``
    (operation name → async probe ``(http, entry) -> Response | None``), or marked
    ``needs_confirmation``. ``keyless=True``: the server does not understand keys, so every lost
    attempt is confirmed that way before it is re-sent. ``lease`` (default 30 s): how long
    another process sharing the journal waits for this one to send an operation, renewed while
    sending. ``policy`` is the :class:`RetryPolicy`; ``header_name``, ``key_prefix`` and
    ``session_id`` shape keys; ``on_event`` receives a :class:`ClientEvent` for each journaled
    change of an operation's state; ``sleep``, ``clock`` and ``rng`` are injectable for tests.
    """

    def __init__(
        self,
        *,
        http: httpx.AsyncClient | None = None,
        base_url: str = "",
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | None = None,
        journal: Journal | str | os.PathLike[str] = DEFAULT_JOURNAL_PATH,
        confirm: Mapping[str, AsyncProbe] | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        clock: Callable[[], float] = time.monotonic,
        **options: Unpack[ProtocolOptions],
    ) -> None:
        check_http_options(http, headers, auth)
        super().__init__(
            http
            if http is not None
            else httpx.AsyncClient(base_url=base_url, headers=headers, auth=auth),
            owns_http=http is None,
            journal=journal,
            probed=confirm or {},
            clock=clock,
            options=options,
        )
        self._driver = AsyncDriver(self._protocol, self._http, self._journal, confirm or {}, sleep)

    async def operation(self, name: str, *, ref: str | None = None) -> Operation:
        """Decide an operation and journal its new key; with ``ref``, resume the journaled
        operation of that name and ref (with its key) if there is one."""
        return await self.perform(self._protocol.operation(name, ref))

    async def send(
        self,
        operation: Operation,
        method: str,
        url: str,
        *,
        keyless: bool = False,
        **parts: Unpack[RequestParts],
    ) -> httpx.Response:
        """Send ``operation`` with its key, retrying until its outcome is known.

        Returns a response below 400 (``confirmed``) or a final 4xx, 501 or 505 (``failed``).
        An operation the journal holds settled is not sent again: its journaled response is
        returned (or its error raised). Raises :class:`IdempotencyKeyMismatch`,
        :class:`ResponseNotReplayable` (or its subclass :class:`CommittedWithoutResponse`:
        it took effect, its response is not available; ``confirmed``), :class:`NotSent` (no
        attempt left the caller; ``failed``), :class:`OutcomeUnknown` or
        :class:`NeedsConfirmation`. ``keyless=True``: this server does not understand keys.
        The body is encoded once and journaled with ``headers``, but for their credentials
        (``Authorization``, ``Cookie``, API-key headers: never journaled). A resend from the
        journal (after a restart, by :meth:`reconcile`) takes those from the client as
        configured, and raises :class:`CredentialsMissing` when it has none. Attempt timeouts
        come from the :class:`RetryPolicy`.
        """
        entry = self._protocol.prepare(operation, method, url, parts, keyless)
        return await self.perform(self._protocol.exchange(entry))

    async def post(
        self,
        url: str,
        *,
        operation: str,
        ref: str | None = None,
        keyless: bool = False,
        **parts: Unpack[RequestParts],
    ) -> httpx.Response:
        """Decide a POST operation named ``operation`` and send it."""
        op = await self.operation(operation, ref=ref)
        return await self.send(op, "POST", url, keyless=keyless, **parts)

    async def reconcile(self) -> list[JournalEntry]:
        """Settle every journaled operation left pending, sent, unknown or needing
        confirmation: re-sent with its key, or looked up by its probe when re-sending is unsafe.

        Returns their entries afterwards; errors are logged, not raised. Operations never
        given a request, and those a saga handed to a person, are skipped.
        """
        return await self.perform(self._protocol.reconcile())

    async def record(self, operation: Operation, state: OperationState) -> None:
        """Journal the outcome of ``operation`` when it was sent by other means under its key
        (an SDK call given ``extra_headers={"Idempotency-Key": operation.key}``):
        ``confirmed`` once it took effect, ``failed`` once the server's final answer refused it.
        Left unrecorded, it stays
        ``pending`` (reconcile() skips it: the journal holds no request to re-send)."""
        await self.perform(self._protocol.record(operation, state))

    async def attention(self) -> list[JournalEntry]:
        """Operations a person has to look at: ``needs_confirmation`` or ``needs_intervention``."""
        return await self.perform(self._protocol.attention())

    async def perform(self, steps: Steps[T]) -> T:
        """Run a generator of the protocol's effects (see :mod:`idempotency_mw.client.protocol`)
        on this client's httpx client, journal, probes and sleep: what every method above and
        :class:`Saga` do. Leases it takes are released when it ends."""
        return await self._driver.perform(steps)

    async def aclose(self) -> None:
        """Close the httpx client and the journal, if this client opened them."""
        if self._owns_http:
            await self._http.aclose()
        if self._owns_journal:
            await anyio.to_thread.run_sync(self._journal.close)
