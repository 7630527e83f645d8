"""Idempotent functions: code that is not an HTTP request (a tool body, a queue consumer, a
scheduled job) run once per key on the claim engine the middleware uses.

A call's key is claimed with a fingerprint of its arguments; the first call runs and its return
value is recorded with a codec; a repeat with the same arguments gets that value back, other
arguments under the key are refused. Leases, takeover after a crash and ``fence()`` are the
engine's, exactly as for a request.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any, ParamSpec, Protocol, TypeVar, Unpack, cast, overload

import anyio.to_thread

from idempotency_mw.engine.claim import Call, ClaimEngine, ClaimRequest, LeaseUnproven
from idempotency_mw.engine.lease import Clock
from idempotency_mw.stores.base import KeyLookup, Store
from idempotency_mw.stores.checks import check_store
from idempotency_mw.values.exceptions import (
    ConfigurationError,
    IdempotencyError,
    InvalidKey,
    LeaseLost,
    StoreError,
)
from idempotency_mw.values.metrics import EventHook, EventKind, guard
from idempotency_mw.values.records import ClaimOutcome, RecordState, StoredResponse
from idempotency_mw.values.settings import CALL_SETTINGS, CallOptions, LeaseLostAction, settings_of
from idempotency_mw.wire.keys import current_claim, is_valid_key, key_rule

logger = logging.getLogger("idempotency_mw")

P = ParamSpec("P")
R = TypeVar("R")

#: The status a function's result is recorded under (a store keeps responses).
_RESULT_STATUS = 200


class Codec(Protocol):
    """How return values are stored: ``encode`` to bytes, ``decode`` back."""

    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class JSONCodec:
    """Return values as JSON (the default): what ``json.dumps`` takes, back as ``json.loads``
    gives it (a tuple comes back a list)."""

    def encode(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def decode(self, data: bytes) -> Any:
        return json.loads(data)


class BytesCodec:
    """Return values that are bytes, stored as they are."""

    def encode(self, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"BytesCodec stores bytes, not {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> Any:
        return data


class Decorator(Protocol):
    """What ``IdempotentFunctions(...)(key=...)`` returns: a decorator that keeps the
    function's parameters and makes it async, awaiting to the function's result (an async
    function's, too)."""

    @overload
    def __call__(
        self, fn: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]: ...


class KeyReused(IdempotencyError):
    """The key was used with other arguments: its result is another call's. Use a new key."""


class CredentialMismatch(IdempotencyError):
    """The key belongs to a call made with other credentials: its result is theirs. Use a new
    key, or the first call's credentials."""


class StillRunning(IdempotencyError):
    """A call with this key is still running (past ``wait``): retry after ``retry_after`` s."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ResultNotReplayable(IdempotencyError):
    """The call with this key ran, but its result could not be recorded (too large, or the
    store failed to take it): do not run it again."""


class CommittedWithoutResult(IdempotencyError):
    """The call with this key committed its effect (``fence``) and then failed: there is no
    result to give, and it must not run again."""


#: Why a call is refused with :class:`CommittedWithoutResult`.
COMMITTED_WITHOUT_RESULT = (
    "the call with this key committed its effect, but has no result; do not run it again"
)


class KeyExpired(IdempotencyError):
    """The call was first sent longer ago than its key is kept (or later than now), and no
    record of it is left: whether it ran cannot be told, so it did not run. Look its outcome
    up by other means; a new call takes a new key."""


#: A first-sent time: Unix seconds, or an aware datetime.
FirstSent = float | datetime


def arguments_fingerprint(fn: Callable[..., Any], args: Any, kwargs: Any) -> str:
    """The canonical JSON of ``fn``'s arguments as bound by its signature (defaults
    applied), hashed: the same call however its arguments were passed."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    try:
        text = json.dumps(
            bound.arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the arguments of {fn.__qualname__} are not JSON ({exc}): pass fingerprint= "
            "(a callable of the same arguments that returns a string)"
        ) from exc
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class IdempotentFunctions:
    """Runs functions once per key on ``store``.

    ``settings`` are those of every idempotent call (:class:`~idempotency_mw.CallOptions`):
    ``ttl``, how long a result is kept; ``lease``, how long a running call holds its key
    without renewal (renewed while it runs; a crashed worker's key is taken over once it
    lapses); ``wait``, how long a repeat waits for a running call before :class:`StillRunning`;
    ``fenced``, whether the calls commit their effects with :func:`~idempotency_mw.fence` (their
    claim and completion then skip their own flush where the database allows it).
    ``scope`` is the namespace of the keys (never shared with HTTP requests' records unless
    you say so); ``codec`` stores the return values, at most ``max_result_bytes`` each.
    ``on_event``, ``on_lease_lost``, ``clock`` and ``server_checks`` are the middleware's. The
    store is checked before the first call (or by :meth:`startup`), as the middleware checks it
    at start.
    """

    def __init__(
        self,
        store: Store,
        *,
        scope: str = "functions",
        codec: Codec | None = None,
        max_result_bytes: int = 1 << 20,
        on_event: EventHook | None = None,
        on_lease_lost: LeaseLostAction = "cancel",
        clock: Clock = time.monotonic,
        server_checks: bool = True,
        **settings: Unpack[CallOptions],
    ) -> None:
        if not scope:
            raise ConfigurationError("scope must be a non-empty string")
        if max_result_bytes < 0:
            raise ConfigurationError("max_result_bytes must not be negative")
        if on_lease_lost not in ("cancel", "continue"):
            raise ConfigurationError("on_lease_lost must be 'cancel' or 'continue'")
        self.settings = settings_of(settings, names=CALL_SETTINGS)
        self.scope = scope
        self.codec: Codec = codec or JSONCodec()
        self.max_result_bytes = max_result_bytes
        self.engine = ClaimEngine(
            store,
            on_event=None if on_event is None else guard(on_event),
            on_lease_lost=on_lease_lost,
            clock=clock,
        )
        self.server_checks = server_checks
        self._checked = False

    async def startup(self) -> None:
        """Check the store as the middleware does at start: a missing or old table raises
        :class:`~idempotency_mw.SchemaError` (naming ``idempotency-mw migrate``); an
        unreachable store, and each setting of its server that can lose records, is only
        logged."""
        await check_store(self.engine.store, server_checks=self.server_checks)
        self._checked = True

    def __call__(
        self,
        *,
        key: Callable[..., str],
        fingerprint: Callable[..., str] | None = None,
        name: str | None = None,
        first_sent: Callable[..., FirstSent | None] | None = None,
    ) -> Decorator:
        """A decorator: each call of the function runs once per ``key``, fingerprinted by
        ``fingerprint`` (default: its arguments' canonical JSON) and named ``name`` (default:
        its module and qualified name); ``first_sent`` gives when the caller first sent the
        call (see :meth:`call`). ``key``, ``fingerprint`` and ``first_sent`` are called with
        the call's arguments by name, as its signature binds them (defaults applied), however
        they were passed. The decorated function is async, whether the function is async or
        sync."""

        def decorate(fn: Callable[P, Any]) -> Callable[P, Coroutine[Any, Any, Any]]:
            signature = inspect.signature(fn)

            @functools.wraps(fn)
            async def protected(*args: P.args, **kwargs: P.kwargs) -> Any:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                named = bound.arguments
                digest = None if fingerprint is None else fingerprint(**named)
                sent = None if first_sent is None else first_sent(**named)
                return await self._run(key(**named), fn, args, kwargs, digest, name, sent)

            return protected

        # One implementation for both overloads (the function's result type is not used).
        return cast(Decorator, decorate)

    # key and fn are positional-only: fn's own arguments may have those names.
    @overload
    async def run(
        self,
        key: str,
        fn: Callable[P, Coroutine[Any, Any, R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    @overload
    async def run(
        self, key: str, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    async def run(self, key: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` once per ``key``: its result, or the first call's.

        Raises :class:`~idempotency_mw.values.exceptions.InvalidKey` (``key`` is not 1-255 visible
        ASCII characters), :class:`KeyReused`, :class:`StillRunning`, :class:`ResultNotReplayable`,
        :class:`CommittedWithoutResult`, :class:`~idempotency_mw.LeaseLost` (the store could
        not confirm the key was held: the call was stopped, or nothing ran), and
        :class:`~idempotency_mw.StoreError`; what ``fn`` raises is raised (the key released,
        unless ``fence()`` committed its effect).
        """
        return await self._run(key, fn, args, kwargs, None, None, None)

    async def _run(
        self,
        key: str,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        fingerprint: str | None,
        name: str | None,
        first_sent: FirstSent | None,
    ) -> Any:
        name = name or f"{fn.__module__}.{fn.__qualname__}"
        digest = fingerprint or arguments_fingerprint(fn, args, kwargs)
        body = functools.partial(fn, *args, **kwargs)
        work: Callable[[], Awaitable[Any]]
        if inspect.iscoroutinefunction(fn):
            work = cast(Callable[[], Awaitable[Any]], body)
        else:
            # A sync function runs in a worker thread; its store calls stay on the loop.
            work = functools.partial(anyio.to_thread.run_sync, body)
        meant = hashlib.sha256(f"{name}\0{digest}".encode()).hexdigest()
        return await self.call(key, meant, work, name=name, first_sent=first_sent)

    async def call(
        self,
        key: str,
        fingerprint: str,
        work: Callable[[], Awaitable[Any]],
        *,
        name: str,
        scope: str | None = None,
        binding: str = "",
        first_sent: FirstSent | None = None,
    ) -> Any:
        """Run ``work()`` once per ``key`` under ``fingerprint`` (what the call means) and
        return its result, or the recorded one decoded (``name`` names it in events); the key
        lives in ``scope`` (default: this instance's) and its record is bound to ``binding``
        (a digest of the caller's credentials, ``""`` for none).

        ``first_sent``: when the caller first sent this call (Unix seconds or an aware
        datetime), given on every retry. When the key has no record and that is longer ago
        than ``ttl`` on the store's clock (the record may be gone) or ahead of it,
        :class:`KeyExpired` is raised and nothing runs.
        """
        if not is_valid_key(key):
            raise InvalidKey(key_rule(f"the key of {name}"))
        if not self._checked:
            await self.startup()
        sent = first_sent.timestamp() if isinstance(first_sent, datetime) else first_sent
        request = ClaimRequest(
            scope or self.scope,
            key,
            fingerprint,
            ttl=self.settings.ttl,
            lease=self.settings.lease,
            wait=self.settings.wait,
            binding=binding,
            fenced=self.settings.fenced,
            first_sent=sent,
        )
        call = self.engine.call(request, method="CALL", route=name)
        async with self.engine.hold(answered=lambda: False) as hold:
            try:
                claim = await hold.claim(call)
            except StoreError as exc:
                logger.warning("idempotency store failed to claim key %s: %s", call.key_id, exc)
                raise
            except LeaseUnproven:
                raise LeaseLost(
                    "the store could not confirm this call holds its key: nothing ran; retry "
                    "with the same key"
                ) from None
            if claim.outcome is ClaimOutcome.REPLAY:
                assert claim.response is not None
                return self.codec.decode(claim.response.body)
            if claim.outcome is not ClaimOutcome.ACQUIRED:
                raise self._refusal(claim.outcome)
            assert hold.claim_held is not None
            token = hold.claim_held.token
            reset = current_claim.set(hold.claim_held)
            try:
                result = await work()
            except BaseException:
                if not hold.stopped:  # a stopped call's key is left to lapse
                    await call.release(token)
                raise
            finally:
                current_claim.reset(reset)
            fenced = hold.claim_held.fenced or hold.claim_held.committed_earlier
            await call.complete(token, self._stored(result, call), fenced=fenced)
            return result
        # The lease could not be proven any more, and the work was stopped.
        raise LeaseLost(
            "the call was stopped because the store could not confirm it still held its key; "
            "retry with the same key"
        )

    async def lookup(
        self, key: str, *, scope: str | None = None, binding: str = ""
    ) -> RecordState | None:
        """What became of ``key`` (in ``scope``, default this instance's) without running
        anything: its record's state, or ``None`` when there is none (never called, expired,
        or bound to other credentials than ``binding``). Raises
        :class:`~idempotency_mw.ConfigurationError` when the store cannot look keys up (see
        :class:`~idempotency_mw.stores.base.KeyLookup`)."""
        store = self.engine.store
        if not isinstance(store, KeyLookup):
            raise ConfigurationError(f"{store!r} cannot look keys up")
        if not self._checked:
            await self.startup()
        return await store.lookup(scope or self.scope, key, binding=binding)

    def _stored(self, result: Any, call: Call) -> StoredResponse | None:
        """The result as recorded, or ``None``: it ran, but a repeat cannot be given it."""
        try:
            data = self.codec.encode(result)
        except Exception:
            logger.exception("the result of key %s cannot be encoded for replay", call.key_id)
            return None
        if len(data) > self.max_result_bytes:
            call.emit(EventKind.RECORD_TOO_LARGE)
            logger.warning(
                "the result of key %s cannot be replayed: %d bytes, over max_result_bytes",
                call.key_id,
                len(data),
            )
            return None
        return StoredResponse(_RESULT_STATUS, (), data)

    def _refusal(self, outcome: ClaimOutcome) -> IdempotencyError:
        if outcome is ClaimOutcome.IN_PROGRESS:
            return StillRunning(
                "a call with this key is still running; retry later",
                retry_after=min(self.settings.lease, max(self.settings.wait, 1.0)),
            )
        if outcome is ClaimOutcome.MISMATCH:
            return KeyReused("this key was used with other arguments; use a new key for a new call")
        if outcome is ClaimOutcome.CREDENTIAL_MISMATCH:
            return CredentialMismatch(
                "this key was used by a call with other credentials; its result is theirs. Use "
                "a new key, or the credentials of the first call"
            )
        if outcome is ClaimOutcome.COMMITTED_WITHOUT_RESPONSE:
            return CommittedWithoutResult(COMMITTED_WITHOUT_RESULT)
        if outcome is ClaimOutcome.EXPIRED:
            return KeyExpired(
                f"this call was first sent longer ago than its key is kept "
                f"({self.settings.ttl:g} s), or later than now: whether it ran cannot be told, "
                "so it did not run"
            )
        return ResultNotReplayable(
            "the call with this key ran, but its result could not be recorded for replay"
        )

    async def aclose(self) -> None:
        """Stop the engine's settlement watcher; the store stays open."""
        await self.engine.aclose()
