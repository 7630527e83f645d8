"""SyncIdempotentClient: the blocking twin of IdempotentClient, on the sync interpreter."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar, Unpack

import httpx

from idempotency_mw.client._base import ClientBase, check_http_options
from idempotency_mw.client._closing import ClosedOnExit
from idempotency_mw.client._drive import SyncDriver, SyncProbe
from idempotency_mw.client.journals import DEFAULT_JOURNAL_PATH, Journal
from idempotency_mw.client.protocol import ProtocolOptions, Steps
from idempotency_mw.client.values import JournalEntry, Operation, OperationState, RequestParts

T = TypeVar("T")

__all__ = ["SyncIdempotentClient", "SyncProbe"]


class SyncIdempotentClient(ClientBase[httpx.Client], ClosedOnExit):
    """The blocking twin of :class:`IdempotentClient`, with the same behaviour and options
    (probes in ``confirm`` are plain functions)."""

    def __init__(
        self,
        *,
        http: httpx.Client | None = None,
        base_url: str = "",
        headers: Mapping[str, str] | None = None,
        auth: httpx.Auth | None = None,
        journal: Journal | str | os.PathLike[str] = DEFAULT_JOURNAL_PATH,
        confirm: Mapping[str, SyncProbe] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        **options: Unpack[ProtocolOptions],
    ) -> None:
        check_http_options(http, headers, auth)
        super().__init__(
            http
            if http is not None
            else httpx.Client(base_url=base_url, headers=headers, auth=auth),
            owns_http=http is None,
            journal=journal,
            probed=confirm or {},
            clock=clock,
            options=options,
        )
        self._driver = SyncDriver(self._protocol, self._http, self._journal, confirm or {}, sleep)

    def operation(self, name: str, *, ref: str | None = None) -> Operation:
        """See :meth:`IdempotentClient.operation`."""
        return self.perform(self._protocol.operation(name, ref))

    def send(
        self,
        operation: Operation,
        method: str,
        url: str,
        *,
        keyless: bool = False,
        **parts: Unpack[RequestParts],
    ) -> httpx.Response:
        """See :meth:`IdempotentClient.send`."""
        entry = self._protocol.prepare(operation, method, url, parts, keyless)
        return self.perform(self._protocol.exchange(entry))

    def post(
        self,
        url: str,
        *,
        operation: str,
        ref: str | None = None,
        keyless: bool = False,
        **parts: Unpack[RequestParts],
    ) -> httpx.Response:
        """See :meth:`IdempotentClient.post`."""
        op = self.operation(operation, ref=ref)
        return self.send(op, "POST", url, keyless=keyless, **parts)

    def reconcile(self) -> list[JournalEntry]:
        """See :meth:`IdempotentClient.reconcile`."""
        return self.perform(self._protocol.reconcile())

    def record(self, operation: Operation, state: OperationState) -> None:
        """See :meth:`IdempotentClient.record`."""
        self.perform(self._protocol.record(operation, state))

    def attention(self) -> list[JournalEntry]:
        """See :meth:`IdempotentClient.attention`."""
        return self.perform(self._protocol.attention())

    def perform(self, steps: Steps[T]) -> T:
        """See :meth:`IdempotentClient.perform`."""
        return self._driver.perform(steps)

    def close(self) -> None:
        """Close the httpx client and the journal, if this client opened them."""
        if self._owns_http:
            self._http.close()
        if self._owns_journal:
            self._journal.close()
