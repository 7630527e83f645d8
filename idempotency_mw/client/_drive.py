"""The two interpreters of the protocol's effects: one async, one blocking. They own the I/O
(the httpx client, the journal, the sleeps, the probes, the caller's calls); the protocol
decides. Clients and sagas run on them alike."""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
import httpx

from idempotency_mw.client.errors import OperationError
from idempotency_mw.client.journals import Journal
from idempotency_mw.client.protocol import (
    Acquire,
    Add,
    Call,
    Effect,
    Get,
    Probe,
    Protocol,
    Release,
    Save,
    Send,
    Sleep,
    Steps,
    Unsettled,
    key_digest,
)
from idempotency_mw.client.values import JournalEntry
from idempotency_mw.values.exceptions import describe

logger = logging.getLogger("idempotency_mw.client")

T = TypeVar("T")
P = TypeVar("P")
S = TypeVar("S")

#: A confirmation probe: looks an operation's effect up (by its ``ref``, typically) and
#: returns the response that shows it, or ``None`` when it did not happen.
AsyncProbe = Callable[[httpx.AsyncClient, JournalEntry], Awaitable[httpx.Response | None]]
#: A confirmation probe for the sync client (see :data:`AsyncProbe`).
SyncProbe = Callable[[httpx.Client, JournalEntry], httpx.Response | None]


class _Journaling(Generic[P, S]):
    """The journal's effects, performed by blocking calls (the async interpreter makes them
    in a worker thread), and the leases a run holds."""

    def __init__(
        self, protocol: Protocol, journal: Journal, probes: Mapping[str, P], sleep: S
    ) -> None:
        self._protocol = protocol
        self._journal = journal
        self._probes = dict(probes)
        self._sleep = sleep

    def _journaled(self, effect: Effect, held: set[str]) -> Any:
        journal = self._journal
        if isinstance(effect, Add):
            return journal.add(effect.entry)
        if isinstance(effect, Save):
            journal.save(effect.entry)
            return None
        if isinstance(effect, Get):
            return journal.get(effect.key)
        if isinstance(effect, Unsettled):
            return journal.unsettled()
        if isinstance(effect, Acquire):
            taken = journal.acquire(effect.key, self._protocol.holder, self._protocol.lease)
            if taken:
                held.add(effect.key)
            return taken
        if isinstance(effect, Release):
            if effect.key in held:
                held.discard(effect.key)
                self._release({effect.key})
            return None
        raise TypeError(f"not an effect of the client's protocol: {effect!r}")

    def _release(self, held: set[str]) -> None:
        """Release the leases in ``held``; one that cannot be released lapses by itself."""
        for key in held:
            try:
                self._journal.release(key, self._protocol.holder)
            except Exception as exc:
                logger.warning(
                    "releasing the lease on %s failed: %s", key_digest(key), describe(exc)
                )

    def _renew(self, key: str) -> bool:
        """Renew the lease on ``key`` once; whether to go on renewing. A renewal that fails is
        logged: the protocol takes the lease again before its next attempt, and waits for the
        other holder if it cannot."""
        try:
            held = self._journal.acquire(key, self._protocol.holder, self._protocol.lease)
        except Exception as exc:  # the journal is unreachable: the lease may lapse
            logger.warning("renewing the lease on %s failed: %s", key_digest(key), describe(exc))
            return True
        if not held:
            logger.warning("the lease on %s was taken over while sending", key_digest(key))
        return held


class AsyncDriver(_Journaling[AsyncProbe, Callable[[float], Awaitable[None]]]):
    """Performs effects with an ``httpx.AsyncClient``, the journal in worker threads, and an
    asyncio task that renews the lease while a request is in flight."""

    def __init__(
        self,
        protocol: Protocol,
        http: httpx.AsyncClient,
        journal: Journal,
        probes: Mapping[str, AsyncProbe],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        super().__init__(protocol, journal, probes, sleep)
        self._http = http

    async def perform(self, steps: Steps[T]) -> T:
        """Run ``steps`` to their end; the leases still held are released however it ends."""
        held: set[str] = set()
        result: Any = None
        try:
            while True:
                try:
                    effect = steps.send(result)
                except StopIteration as done:
                    value: T = done.value
                    return value
                result = await self._perform(effect, held)
        finally:
            steps.close()
            if held:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._release, held)

    async def _perform(self, effect: Effect, held: set[str]) -> Any:
        if isinstance(effect, Send):
            return await self._send(effect)
        if isinstance(effect, Sleep):
            await self._sleep(effect.seconds)
            return None
        if isinstance(effect, Probe):
            try:
                return await self._probes[effect.entry.name](self._http, effect.entry)
            except Exception as exc:
                return exc
        if isinstance(effect, Call):
            try:
                return await effect.function(*effect.args)
            except OperationError as exc:
                return exc
        return await anyio.to_thread.run_sync(self._journaled, effect, held)

    async def _send(self, effect: Send) -> httpx.Response | Exception:
        outcome: httpx.Response | Exception | None = None
        escaped: BaseException | None = None
        async with anyio.create_task_group() as renewal:
            renewal.start_soon(self._keep, effect.lease)
            try:
                outcome = await self._http.send(effect.request)
            except Exception as exc:
                outcome = exc
            except BaseException as exc:  # re-raised below, not wrapped in an exception group
                escaped = exc
            finally:
                # The renewal ends with the send, once a renewal in progress has ended.
                renewal.cancel_scope.cancel()
        if escaped is not None:
            raise escaped
        assert outcome is not None
        return outcome

    async def _keep(self, key: str) -> None:
        # Real time: the lease lapses on the journal's clock, not on an injected one.
        every = self._protocol.lease / 3
        while True:
            await anyio.sleep(every)
            if not await anyio.to_thread.run_sync(self._renew, key):
                return


class SyncDriver(_Journaling[SyncProbe, Callable[[float], None]]):
    """Performs effects with an ``httpx.Client`` and blocking calls; a thread renews the lease
    while a request is in flight (the send blocks this one)."""

    def __init__(
        self,
        protocol: Protocol,
        http: httpx.Client,
        journal: Journal,
        probes: Mapping[str, SyncProbe],
        sleep: Callable[[float], None],
    ) -> None:
        super().__init__(protocol, journal, probes, sleep)
        self._http = http

    def perform(self, steps: Steps[T]) -> T:
        """Run ``steps`` to their end; the leases still held are released however it ends."""
        held: set[str] = set()
        result: Any = None
        try:
            while True:
                try:
                    effect = steps.send(result)
                except StopIteration as done:
                    value: T = done.value
                    return value
                result = self._perform(effect, held)
        finally:
            steps.close()
            self._release(held)

    def _perform(self, effect: Effect, held: set[str]) -> Any:
        if isinstance(effect, Send):
            return self._send(effect)
        if isinstance(effect, Sleep):
            self._sleep(effect.seconds)
            return None
        if isinstance(effect, Probe):
            try:
                return self._probes[effect.entry.name](self._http, effect.entry)
            except Exception as exc:
                return exc
        if isinstance(effect, Call):
            try:
                return effect.function(*effect.args)
            except OperationError as exc:
                return exc
        return self._journaled(effect, held)

    def _send(self, effect: Send) -> httpx.Response | Exception:
        stopped = threading.Event()

        def keep() -> None:
            while not stopped.wait(self._protocol.lease / 3) and self._renew(effect.lease):
                pass

        renewal = threading.Thread(target=keep, name="idempotency-lease", daemon=True)
        renewal.start()
        try:
            return self._http.send(effect.request)
        except Exception as exc:
            return exc
        finally:
            stopped.set()
            renewal.join()  # a renewal must never outlive its send
