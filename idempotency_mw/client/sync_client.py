"""SyncIdempotentClient: the blocking twin of IdempotentClient, performing the same steps."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar, Unpack

import httpx

from idempotency_mw.client._base import ClientBase, check_http_options
from idempotency_mw.client._closing import ClosedOnExit
from idempotency_mw.client.core import (
    Acquire,
    CoreOptions,
    Get,
    Probe,
    Reply,
    Save,
    Send,
    Sleep,
    Steps,
)
from idempotency_mw.client.journals import DEFAULT_JOURNAL_PATH, Journal
from idempotency_mw.client.values import JournalEntry, Operation, OperationState, RequestParts

T = TypeVar("T")

#: A confirmation probe for the sync client (see :data:`AsyncProbe`).
SyncProbe = Callable[[httpx.Client, JournalEntry], httpx.Response | None]


class SyncIdempotentClient(
    ClientBase[httpx.Client, SyncProbe, Callable[[float], None]], ClosedOnExit
):
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
        **options: Unpack[CoreOptions],
    ) -> None:
        check_http_options(http, headers, auth)
        super().__init__(
            http
            if http is not None
            else httpx.Client(base_url=base_url, headers=headers, auth=auth),
            owns_http=http is None,
            journal=journal,
            confirm=confirm,
            sleep=sleep,
            clock=clock,
            options=options,
        )

    def operation(self, name: str, *, ref: str | None = None) -> Operation:
        """See :meth:`IdempotentClient.operation`."""
        return self._core.journal.add(self._core.new_entry(name, ref)).operation

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
        entry = self._core.prepare(operation, method, url, parts, keyless)
        return self._perform(self._core.exchange(entry))

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
        return [self._perform(self._core.settle(entry)) for entry in self._core.resendable()]

    def attention(self) -> list[JournalEntry]:
        """See :meth:`IdempotentClient.attention`."""
        return self._core.attention()

    def close(self) -> None:
        """Close the httpx client and the journal, if this client opened them."""
        if self._core.owns_http:
            self._http.close()
        if self._core.owns_journal:
            self._core.journal.close()

    # --- For sagas -------------------------------------------------------------------------

    def _saga_operation(self, name: str, ref: str) -> tuple[Operation, JournalEntry]:
        stored = self._core.journal.add(self._core.derived_entry(name, ref))
        return stored.operation, stored

    def _resume(self, entry: JournalEntry) -> httpx.Response:
        return self._perform(self._core.exchange(entry))

    def _mark(self, key: str, state: OperationState) -> None:
        self._core.mark(key, state)

    # --- The driver ------------------------------------------------------------------------

    def _perform(self, steps: Steps[T]) -> T:
        held: set[str] = set()
        reply: Reply = None
        try:
            while True:
                try:
                    step = steps.send(reply)
                except StopIteration as done:
                    result: T = done.value
                    return result
                reply = self._step(step, held)
        finally:
            steps.close()
            self._core.release(held)

    def _step(self, step: object, held: set[str]) -> Reply:
        core, journal = self._core, self._core.journal
        if isinstance(step, Send):
            renewal = core.renewal(step.lease)
            try:
                return self._http.send(step.request)
            except Exception as exc:
                return exc
            finally:
                renewal.stop()
        if isinstance(step, Sleep):
            self._sleep(step.seconds)
            return None
        if isinstance(step, Save):
            journal.save(step.entry)
            return None
        if isinstance(step, Get):
            return journal.get(step.key)
        if isinstance(step, Acquire):
            return core.take_lease(step.key, held)
        assert isinstance(step, Probe)
        try:
            return self._probes[step.entry.name](self._http, step.entry)
        except Exception as exc:
            return exc
