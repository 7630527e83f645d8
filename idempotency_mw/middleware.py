"""The pure ASGI middleware: one request flows through key → policy → fingerprint → claim."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import Context
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Any, Literal, TypeVar

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw._asgi import (
    REPLAYED_HEADER,
    ReplayReceive,
    ResponseRecorder,
    invalid_key_detail,
    parse_key,
    request_headers,
    send_replay,
)
from idempotency_mw.cleanup import PurgeSchedule
from idempotency_mw.exceptions import (
    ConfigurationError,
    LeaseLost,
    SettlementFeedUnsupported,
    StoreError,
)
from idempotency_mw.fence import UNKEYED, CurrentClaim, current_claim
from idempotency_mw.fingerprint import canonical_json, credential_digest, request_fingerprint
from idempotency_mw.lifespan import run_lifespan, store_lifespan
from idempotency_mw.metrics import Event, EventHook, EventKind, guard, key_hash
from idempotency_mw.openapi import document_openapi
from idempotency_mw.policy import (
    Duration,
    FingerprintMode,
    RouteOptions,
    RouteTable,
    Settings,
    app_routes,
    fingerprint_mode,
    statuses,
    to_seconds,
)
from idempotency_mw.problems import Problem, send_http_problem, send_problem
from idempotency_mw.records import Claim, ClaimOutcome
from idempotency_mw.stores.base import SettlementFeed, Store

logger = logging.getLogger("idempotency_mw")

DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Headers left out of a record: credentials a handler may echo, challenges, hop-by-hop headers.
DEFAULT_UNRECORDED_HEADERS = frozenset(
    {
        "set-cookie",
        "www-authenticate",
        "proxy-authenticate",
        "authorization",
        "proxy-authorization",
        "cookie",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Answers that prove the handler did not run: the key is released, not recorded.
DEFAULT_RELEASE_STATUSES = frozenset({401, 403, 404, 405, 406, 408, 413, 415, 422, 429})
#: Never recorded whatever the lists say: a replay sets this header itself, once.
_ALWAYS_UNRECORDED = frozenset({REPLAYED_HEADER[0]})

T = TypeVar("T")
CallerScope = Callable[[HTTPConnection], str | Awaitable[str]]
LeaseLostAction = Literal["cancel", "continue"]


@dataclass(frozen=True, slots=True)
class Options:
    """The middleware's settings, validated and precomputed once."""

    store: Store
    defaults: Settings
    methods: frozenset[str]
    header_name: str
    #: The request headers the middleware reads (key, Content-Length, credentials, fingerprint).
    read_headers: frozenset[bytes]
    routes: RouteTable
    caller_scope: CallerScope | None
    credential_headers: tuple[str, ...]
    credential_cookies: tuple[str, ...]
    fingerprint_headers: tuple[str, ...]
    max_request_bytes: int
    max_response_bytes: int
    max_header_bytes: int
    store_server_errors: bool
    mismatch_status: int
    fail_open: bool
    retry_after: int
    records_header: Callable[[bytes], bool]
    on_lease_lost: LeaseLostAction
    purge: PurgeSchedule | None
    lifespan: bool
    on_event: EventHook | None

    def problem_answers(self) -> dict[int, str]:
        """The statuses of the problem answers the middleware may give, described."""
        answers = {
            400: "Idempotency-Key missing where required, or invalid",
            409: "Key in use by a request still running, reused with a different request, "
            "or its response cannot be replayed",
            413: "Request body too large to fingerprint",
            503: "Idempotency store unavailable, or the key could no longer be held",
        }
        if self.mismatch_status == 422:
            answers[422] = "Key reused with a different request"
        return answers


class IdempotencyMiddleware:
    """Makes non-GET requests that carry an ``Idempotency-Key`` safe to retry.

    The first request with a key runs and its response is recorded; a repeat with the same key
    and the same request gets the recorded response replayed; a repeat with a different request
    gets 409 (or 422); a repeat while the first still runs gets 409 with ``Retry-After``.
    Settings given here are defaults; ``@idempotent`` and the ``routes`` mapping override them
    per route. During the app's lifespan the store is checked, expired records are purged on the
    ``purge`` schedule (``None`` turns that off, e.g. when a cron job runs ``idempotency-mw
    purge``) and the store is closed at shutdown; ``lifespan=False`` leaves all of that to
    :func:`~idempotency_mw.lifespan.store_lifespan` in the app's own lifespan.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        ttl: Duration = timedelta(hours=24),
        lease: Duration = timedelta(seconds=60),
        required: bool = False,
        methods: Iterable[str] = DEFAULT_METHODS,
        header_name: str = "Idempotency-Key",
        routes: Mapping[str, RouteOptions] | None = None,
        scope: CallerScope | None = None,
        credential_headers: Iterable[str] = ("authorization",),
        credential_cookies: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        max_request_bytes: int = 1 << 20,
        max_response_bytes: int = 1 << 20,
        max_header_bytes: int = 1 << 16,
        release_statuses: Iterable[int] = DEFAULT_RELEASE_STATUSES,
        fingerprint: FingerprintMode = "bytes",
        wait: Duration = 0,
        store_server_errors: bool = False,
        mismatch_status: int = 409,
        fail_open: bool = False,
        retry_after: int = 1,
        replay_headers_allow: Iterable[str] | None = None,
        replay_headers_deny: Iterable[str] = DEFAULT_UNRECORDED_HEADERS,
        on_lease_lost: LeaseLostAction = "cancel",
        purge: PurgeSchedule | None = PurgeSchedule(),  # noqa: B008  (frozen, so shareable)
        lifespan: bool = True,
        on_event: EventHook | None = None,
    ) -> None:
        if not isinstance(store, Store):
            raise ConfigurationError(f"store must implement the Store protocol, got {store!r}")
        if not _accepts_binding(store):
            raise ConfigurationError(
                f"{store!r}.claim() must accept binding= (the Store protocol binds records to "
                "the caller's credentials)"
            )
        if mismatch_status not in (409, 422):
            raise ConfigurationError("mismatch_status must be 409 or 422")
        if min(max_request_bytes, max_response_bytes, max_header_bytes, retry_after) < 0:
            raise ConfigurationError("size limits and retry_after must not be negative")
        if on_lease_lost not in ("cancel", "continue"):
            raise ConfigurationError("on_lease_lost must be 'cancel' or 'continue'")
        deny = {h.lower().encode("latin-1") for h in replay_headers_deny} | _ALWAYS_UNRECORDED
        allow = (
            None
            if replay_headers_allow is None
            else frozenset(h.lower().encode("latin-1") for h in replay_headers_allow) - deny
        )
        credentials = tuple(sorted({name.lower() for name in credential_headers}))
        fingerprinted = tuple(sorted({name.lower() for name in fingerprint_headers}))
        self.app = app
        self.options = Options(
            store=store,
            defaults=Settings(
                ttl=to_seconds(ttl, "ttl"),
                required=required,
                lease=to_seconds(lease, "lease"),
                release_statuses=statuses(release_statuses),
                fingerprint=fingerprint_mode(fingerprint),
                wait=to_seconds(wait, "wait", zero=True),
            ),
            methods=frozenset(method.upper() for method in methods),
            header_name=header_name,
            read_headers=frozenset(
                name.lower().encode("latin-1")
                for name in (header_name, "content-length", *credentials, *fingerprinted)
            ),
            routes=RouteTable(routes),
            caller_scope=scope,
            credential_headers=credentials,
            credential_cookies=tuple(sorted(set(credential_cookies))),
            fingerprint_headers=fingerprinted,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            max_header_bytes=max_header_bytes,
            store_server_errors=store_server_errors,
            mismatch_status=mismatch_status,
            fail_open=fail_open,
            retry_after=retry_after,
            records_header=(lambda name: name not in deny) if allow is None else allow.__contains__,
            on_lease_lost=on_lease_lost,
            purge=purge,
            lifespan=lifespan,
            on_event=None if on_event is None else guard(on_event),
        )
        self._documented: set[int] = set()
        self._settlements = _Settlements(store)

    @property
    def store(self) -> Store:
        """The store the middleware claims keys in."""
        return self.options.store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await run_lifespan(self.app, scope, receive, send, lambda: self._lifespan(scope))
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        app = scope.get("app", self.app)
        if id(app) not in self._documented:
            # Without a lifespan (a TestClient used without `with`), the first request does it.
            self._document(app)
        if scope["method"] not in self.options.methods:
            await self.app(scope, receive, send)
            return
        options = self.options
        resolved = options.routes.resolve(app, scope)
        if resolved is None:
            # The app answers 404 or 405: nothing runs, so there is nothing to guard or record.
            await self.app(scope, receive, send)
            return
        settings = options.defaults.merge(resolved.policy)
        headers = request_headers(scope, options.read_headers)
        raw_keys = headers.get(options.header_name.lower(), ())
        if not raw_keys:
            if settings.required:
                await send_problem(
                    send,
                    Problem.MISSING_KEY,
                    400,
                    f"This operation requires {options.header_name}.",
                )
            else:
                # A guarded route without a key: fence() has nothing to mark, and says so.
                unkeyed = current_claim.set(UNKEYED)
                try:
                    await self.app(scope, receive, send)
                finally:
                    current_claim.reset(unkeyed)
            return
        key = parse_key(raw_keys[0]) if len(raw_keys) == 1 else None
        if key is None:
            detail = (
                f"Send one {options.header_name} header"
                if len(raw_keys) > 1
                else invalid_key_detail(options.header_name, raw_keys[0])
            )
            await send_problem(send, Problem.INVALID_KEY, 400, detail + ".")
            return
        exchange = _Exchange(
            self.app,
            options,
            scope,
            receive,
            send,
            headers,
            key,
            resolved.template,
            self._settlements,
        )
        await exchange.run(resolved.template, settings)

    def _document(self, app: object) -> None:
        self._documented.add(id(app))
        document_openapi(app, self.options)

    @asynccontextmanager
    async def _lifespan(self, scope: Scope) -> AsyncIterator[None]:
        app = scope.get("app", self.app)
        self._document(app)
        unmatched = self.options.routes.unmatched_entries(app_routes(app))
        if unmatched:
            logger.warning("routes= entries that match no route of the app: %s", unmatched)
        async with AsyncExitStack() as stack:
            if self.options.lifespan:
                await stack.enter_async_context(
                    store_lifespan(self.options.store, purge=self.options.purge)
                )
            stack.push_async_callback(self._settlements.stop)  # before the store closes
            yield


def _accepts_binding(store: Store) -> bool:
    try:
        parameters = inspect.signature(store.claim).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: take it on trust
        return True
    return any(p.name == "binding" or p.kind is p.VAR_KEYWORD for p in parameters)


def install(app: Any, *, store: Store, **options: Any) -> None:
    """Add :class:`IdempotencyMiddleware` to a Starlette/FastAPI ``app`` and document it now.

    The same as ``app.add_middleware(IdempotencyMiddleware, store=store, **options)``, except
    that the OpenAPI schema shows the key header and the problem answers at once, before the
    first request or the lifespan (a schema-export script, a ``TestClient`` used without
    ``with``).
    """
    middleware = IdempotencyMiddleware(app, store=store, **options)  # validates the options
    document_openapi(app, middleware.options)
    app.add_middleware(IdempotencyMiddleware, store=store, **options)


class _Exchange:
    """One keyed request: read the body, claim the key, then run, replay or reject."""

    def __init__(
        self,
        app: ASGIApp,
        options: Options,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: dict[str, list[str]],
        key: str,
        template: str,
        settlements: _Settlements,
    ) -> None:
        self.app = app
        self.settlements = settlements
        self.options = options
        self.store = options.store
        self.scope = scope
        self.receive = receive
        self.send = send
        self.headers = headers
        self.key = key
        self.template = template
        self.caller = ""

    @cached_property
    def key_id(self) -> str:
        """A short hash of scope and key, for logs: raw keys are never logged (read only once
        ``caller`` is known)."""
        return key_hash(self.caller, self.key)

    def emit(self, kind: EventKind, **details: Any) -> None:
        """Report an event to the ``on_event`` hook (guarded: it cannot raise), if there is one."""
        hook = self.options.on_event
        if hook is not None:
            hook(Event(kind, self.key_id, self.scope["method"], self.template, **details))

    def call_store(self, operation: str, call: Awaitable[T]) -> Awaitable[T]:
        """A store call: ``call`` itself, or timed and reported when an ``on_event`` hook is
        set."""
        return call if self.options.on_event is None else self._reported(operation, call)

    async def _reported(self, operation: str, call: Awaitable[T]) -> T:
        started_at, started = time.time(), time.perf_counter()
        error = None
        try:
            return await call
        except StoreError as exc:
            error = str(exc)
            self.emit(EventKind.STORE_ERROR, operation=operation, error=error)
            raise
        finally:
            self.emit(
                EventKind.STORE_CALL,
                operation=operation,
                started_at=started_at,
                duration=time.perf_counter() - started,
                error=error,
            )

    async def run(self, template: str, settings: Settings) -> None:
        options = self.options
        declared = self.headers.get("content-length", [""])[0]
        # ASCII digits only, and few enough of them for int(): the server may not have checked.
        if (
            declared.isascii()
            and declared.isdigit()
            and (len(declared) > 18 or int(declared) > options.max_request_bytes)
        ):
            await self._too_large()
            return
        body = await self._read_body()
        if body is None:
            return
        caller = await self._caller_scope()
        if caller is None:
            return
        self.caller = caller
        json_body = canonical_json(body) if settings.fingerprint == "json" else None
        fingerprint = request_fingerprint(
            self.scope["method"],
            template,
            self.scope["path"],
            self.scope.get("query_string", b""),
            [
                (name, value)
                for name in options.fingerprint_headers
                for value in self.headers.get(name, ())
            ],
            body if json_body is None else json_body,
        )
        try:
            claim, claimed_at = await self._claim(fingerprint, self._binding(), settings)
        except StoreError as exc:
            logger.warning("idempotency store failed to claim key %s: %s", self.key_id, exc)
            if options.fail_open:
                await self.app(self.scope, ReplayReceive(body, self.receive), self.send)
            else:
                await self._problem(
                    Problem.STORE_UNAVAILABLE,
                    503,
                    "The idempotency store is unavailable; retry with the same key.",
                    retry=True,
                )
            return

        self.emit(_OUTCOME_EVENTS[claim.outcome])
        if claim.outcome is ClaimOutcome.REPLAY:
            assert claim.response is not None
            await send_replay(self.send, claim.response)
        elif claim.outcome is not ClaimOutcome.ACQUIRED:
            problem, status, detail, retry = _REFUSALS[claim.outcome]
            if claim.outcome is ClaimOutcome.MISMATCH:
                status = options.mismatch_status
            await self._problem(problem, status, detail, retry=retry)
        else:
            assert claim.token is not None
            lease = _Lease(self, claim.token, settings.lease, claimed_at)
            if not await lease.prove_before_start():
                # A claim so slow that its lease may already be another's: run nothing.
                await self._problem(
                    Problem.LEASE_LOST,
                    503,
                    "The idempotency store could not confirm this request holds its key; "
                    "nothing ran. Retry with the same key.",
                    retry=True,
                )
                return
            self.emit(EventKind.CLAIM_STARTED)
            try:
                await self._execute(body, lease, settings)
            finally:
                self.emit(EventKind.CLAIM_ENDED)

    async def _claim(
        self, fingerprint: str, binding: str, settings: Settings
    ) -> tuple[Claim, float]:
        """The claim's outcome, and when (monotonic) the claim that decided it was sent.

        A duplicate that finds the key in progress waits up to ``settings.wait`` for its
        outcome: woken at once when a request of this worker settles the key, or of any worker
        when the store offers a settlement feed, and polling with backoff (holding no
        connection in between) in case no news comes.
        """
        deadline = time.monotonic() + settings.wait
        pause = _FIRST_POLL
        while True:
            claimed_at = time.monotonic()
            claim = await self.call_store(
                "claim",
                self.store.claim(
                    self.caller,
                    self.key,
                    fingerprint,
                    ttl=settings.ttl,
                    lease=settings.lease,
                    binding=binding,
                ),
            )
            if claim.outcome is not ClaimOutcome.IN_PROGRESS or claimed_at >= deadline:
                return claim, claimed_at
            await self.settlements.wait(
                self.key_id, min(pause, deadline - claimed_at), since=claimed_at
            )
            pause = min(pause * 2, self.settlements.longest_pause)

    def _binding(self) -> str:
        """A digest of the caller's credentials, which the record is bound to.

        Without a ``scope`` option a record is bound by checking: the same key sent with other
        credentials never gets this record. With ``scope``, the scope alone decides.
        """
        options = self.options
        if options.caller_scope is not None:
            return ""
        values = [
            (name, value)
            for name in options.credential_headers
            for value in self.headers.get(name, ())
        ]
        if options.credential_cookies:
            cookies = HTTPConnection(self.scope).cookies
            values += [
                (f"cookie:{name}", cookies[name])
                for name in options.credential_cookies
                if name in cookies
            ]
        if not values:
            return ""
        return credential_digest(values)

    async def _caller_scope(self) -> str | None:
        """The namespace of this request's keys, from the ``scope`` option ('' without one).

        ``None`` when the request was answered instead: the callable raised an HTTPException
        (its answer, as a problem), or failed or gave no usable scope (a 500 problem, logged:
        the handler never runs unscoped).
        """
        caller_scope = self.options.caller_scope
        if caller_scope is None:
            return ""
        try:
            value = caller_scope(HTTPConnection(self.scope))
            if inspect.isawaitable(value):
                value = await value
        except HTTPException as exc:
            await send_http_problem(self.send, exc.status_code, str(exc.detail), exc.headers)
            return None
        except Exception:
            logger.exception("the scope= callable of IdempotencyMiddleware failed")
            await self._scope_failed()
            return None
        if not isinstance(value, str) or not value:
            logger.error(
                "the scope= callable of IdempotencyMiddleware returned %s; it must return a "
                "non-empty string (the handler did not run)",
                "an empty string" if value == "" else f"a {type(value).__name__}",
            )
            await self._scope_failed()
            return None
        return value

    async def _scope_failed(self) -> None:
        await self._problem(
            Problem.SCOPE_FAILED,
            500,
            "The server could not determine whose request this is; the request did not run.",
        )

    async def _problem(
        self, problem: Problem, status: int, detail: str, *, retry: bool = False
    ) -> None:
        retry_after = self.options.retry_after if retry else None
        await send_problem(self.send, problem, status, detail, retry_after=retry_after)

    async def _read_body(self) -> bytes | None:
        """The whole request body, or ``None`` when the client left (or was answered 413)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.options.max_request_bytes:
                await self._too_large()
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self) -> None:
        await self._problem(
            Problem.TOO_LARGE,
            413,
            f"Request bodies are limited to {self.options.max_request_bytes} bytes.",
        )

    async def _execute(self, body: bytes, lease: _Lease, settings: Settings) -> None:
        settled = False

        async def settle(recorder: ResponseRecorder) -> None:
            nonlocal settled
            if not settled:
                settled = True
                with anyio.CancelScope(shield=True):
                    await self._settle(lease.token, recorder, settings)

        recorder = ResponseRecorder(
            self.send,
            max_body=self.options.max_response_bytes,
            max_headers=self.options.max_header_bytes,
            records_header=self.options.records_header,
            on_finish=settle,
        )
        # The handler's scope: a lost lease expires it at once (asyncio's own cancel scope).
        handler = asyncio.timeout(None)
        try:
            async with handler:
                lease.watch(handler, recorder)
                claim = current_claim.set(
                    CurrentClaim(self.store, self.caller, self.key, lease.token)
                )
                try:
                    await self.app(self.scope, ReplayReceive(body, self.receive), recorder.send)
                except LeaseLost:
                    if recorder.status is not None:
                        raise
                    # The handler's transaction rolled back: another request holds the key now.
                    await self._problem(
                        Problem.IN_PROGRESS,
                        409,
                        "Another request with this key took over; retry later.",
                        retry=True,
                    )
                finally:
                    current_claim.reset(claim)
                    lease.stop()
                    # Settled already when the response ended; otherwise the app failed or
                    # stopped.
                    if not lease.lost:
                        await settle(recorder)
        except TimeoutError:
            if not handler.expired():
                raise  # the app's own
        if handler.expired() and lease.lost and recorder.status is None:
            await self._problem(
                Problem.LEASE_LOST,
                503,
                "The request was stopped because the idempotency store could not confirm it "
                "still held this key; retry with the same key.",
                retry=True,
            )

    async def _settle(self, token: str, recorder: ResponseRecorder, settings: Settings) -> None:
        try:
            await self._record_or_release(token, recorder, settings)
        finally:
            if settings.wait:
                # Requests of this route may be waiting (one of another route polls).
                self.settlements.settled(self.key_id)

    async def _record_or_release(
        self, token: str, recorder: ResponseRecorder, settings: Settings
    ) -> None:
        """Record the response; release the key when it proves nothing ran (or nothing began).

        Once a response below 500 has begun that is not a refusal (``release_statuses``,
        FastAPI's request validation), the request's effect may have happened: the key is never
        run again. A complete response is recorded; one cut short, sent as a file or too large
        is recorded as not replayable.
        """
        status = recorder.status
        if (
            status is None
            or (status >= 500 and not self.options.store_server_errors)
            or status in settings.release_statuses
            or (status == 422 and recorder.is_request_validation_error())
        ):
            await self._release(token)
            return
        response = recorder.stored_response()
        if response is None:
            if recorder.too_large:
                self.emit(EventKind.RECORD_TOO_LARGE)
            logger.warning(
                "the response of key %s cannot be replayed: %s",
                self.key_id,
                recorder.unreplayable_reason or "it was cut short",
            )
        try:
            owned = await self.call_store(
                "complete",
                self.store.complete(self.caller, self.key, token, response, ttl=settings.ttl),
            )
        except StoreError as exc:
            # The client still gets its answer; the claim stays in progress until its lease
            # lapses, so a retry meanwhile gets 409, never a second run or a wrong replay.
            logger.error("could not record the response of key %s: %s", self.key_id, exc)
            return
        if not owned:
            logger.warning("key %s was taken over before its response was recorded", self.key_id)

    async def _release(self, token: str) -> None:
        try:
            if await self.call_store("release", self.store.release(self.caller, self.key, token)):
                self.emit(EventKind.RELEASED)
        except StoreError as exc:
            logger.error("could not release key %s (its lease will lapse): %s", self.key_id, exc)


#: The answer to each outcome that neither runs nor replays: problem, status (MISMATCH's is the
#: ``mismatch_status`` option), detail, and whether a retry later may succeed (Retry-After).
_REFUSALS: dict[ClaimOutcome, tuple[Problem, int, str, bool]] = {
    ClaimOutcome.IN_PROGRESS: (
        Problem.IN_PROGRESS,
        409,
        "A request with this key is still being processed; retry later.",
        True,
    ),
    ClaimOutcome.MISMATCH: (
        Problem.MISMATCH,
        409,
        "This key was used with a different request; use a new key for a new request.",
        False,
    ),
    ClaimOutcome.UNREPLAYABLE: (
        Problem.UNREPLAYABLE,
        409,
        "This key's request ran, but its response could not be recorded for replay.",
        False,
    ),
    ClaimOutcome.CREDENTIAL_MISMATCH: (
        Problem.CREDENTIAL_MISMATCH,
        409,
        "This key was used by a request with other credentials; its outcome is theirs. Use a "
        "new key, or the credentials of the first request.",
        False,
    ),
    ClaimOutcome.COMMITTED_WITHOUT_RESPONSE: (
        Problem.COMMITTED_WITHOUT_RESPONSE,
        409,
        "This key's request took effect, but its response is not available; do not send it again.",
        False,
    ),
}
_OUTCOME_EVENTS = {
    ClaimOutcome.ACQUIRED: EventKind.FIRST_RUN,
    ClaimOutcome.REPLAY: EventKind.REPLAY,
    ClaimOutcome.IN_PROGRESS: EventKind.IN_PROGRESS,
    ClaimOutcome.MISMATCH: EventKind.MISMATCH,
    ClaimOutcome.UNREPLAYABLE: EventKind.NOT_REPLAYABLE,
    ClaimOutcome.CREDENTIAL_MISMATCH: EventKind.CREDENTIAL_MISMATCH,
    ClaimOutcome.COMMITTED_WITHOUT_RESPONSE: EventKind.COMMITTED_WITHOUT_RESPONSE,
}


_FIRST_POLL = 0.02
#: The longest pause between two polls of a waiting request: without a settlement feed, and
#: with one, when polling only makes up for news that got lost.
_LAST_POLL = 0.5
_LAST_POLL_FED = 2.0
#: How long a settlement is remembered for a claim that was on its way when the news came.
_REMEMBERED = 1.0


class _Settlements:
    """Requests of this worker waiting for a key in progress, woken when it is settled.

    A request of this worker that settles a key wakes its waiters itself. When the store offers
    a :class:`~idempotency_mw.stores.base.SettlementFeed`, the first request that waits starts
    one watcher per event loop, which wakes them when any worker settles their key. Keys are
    known by their digest (:func:`~idempotency_mw.metrics.key_hash`).
    """

    def __init__(self, store: Store) -> None:
        self._feed = store if isinstance(store, SettlementFeed) else None
        self._watcher: asyncio.Task[None] | None = None
        self._waiting: dict[str, tuple[asyncio.Event, int]] = {}
        self._recent: dict[str, float] = {}

    @property
    def longest_pause(self) -> float:
        """The longest pause between two polls: longer while a feed brings the news."""
        return _LAST_POLL if self._feed is None else _LAST_POLL_FED

    async def wait(self, digest: str, seconds: float, *, since: float) -> None:
        """Until ``digest`` is settled, or ``seconds`` have passed; not at all if it was settled
        after ``since`` (``time.monotonic()`` when the claim that found it in progress began)."""
        self._watch()
        if self._recent.get(digest, -math.inf) >= since:
            return
        event, waiters = self._waiting.get(digest, (asyncio.Event(), 0))
        self._waiting[digest] = (event, waiters + 1)
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            pass
        finally:
            current = self._waiting.get(digest)
            if current is not None and current[0] is event:
                if current[1] <= 1:
                    del self._waiting[digest]
                else:
                    self._waiting[digest] = (event, current[1] - 1)

    def settled(self, digest: str) -> None:
        """Wake whoever waits for ``digest``."""
        now = time.monotonic()
        recent = self._recent
        recent.pop(digest, None)
        recent[digest] = now  # last in order: the oldest come first
        while (oldest := next(iter(recent))) != digest and recent[oldest] < now - _REMEMBERED:
            del recent[oldest]
        entry = self._waiting.pop(digest, None)
        if entry is not None:
            entry[0].set()

    def _watch(self) -> None:
        """Start the feed's watcher in this event loop, unless it runs already."""
        if self._feed is None:
            return
        loop = asyncio.get_running_loop()
        watcher = self._watcher
        if watcher is None or watcher.done() or watcher.get_loop() is not loop:
            # A context of its own: the watcher outlives the request that starts it.
            self._watcher = loop.create_task(self._follow(self._feed), context=Context())

    async def _follow(self, feed: SettlementFeed) -> None:
        try:
            await feed.watch_settlements(self.settled)
        except SettlementFeedUnsupported as exc:
            logger.info("%s", exc)
            self._feed = None
        except Exception:
            logger.exception("the settlement feed of %r failed; waiting requests poll it", feed)
            self._feed = None

    async def stop(self) -> None:
        """Stop the watcher of this event loop (at shutdown)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher.get_loop() is asyncio.get_running_loop():
            watcher.cancel()
            await asyncio.wait({watcher})


class _Lease:
    """Keeps a claim's lease while the handler runs, and knows until when it is proven.

    The lease is proven until the moment the last successful claim or renewal was *sent* plus
    the lease, on this worker's monotonic clock. Renewals begin after a third of the lease and
    retry quickly when the store fails, so a store pause shorter than a third of the lease
    costs nothing. When the proof runs out, the request is no longer protected: it is
    cancelled (``on_lease_lost="cancel"``, unless its response has begun) or goes on, logged.
    """

    def __init__(self, exchange: _Exchange, token: str, lease: float, claimed_at: float) -> None:
        self.token = token
        self.lost = False
        self._exchange = exchange
        self._lease = lease
        self._proven_until = claimed_at + lease
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        #: The renewal sent last, held here so that it runs to its end (see ``_renew``).
        self._in_flight: asyncio.Future[bool | None] | None = None

    async def prove_before_start(self) -> bool:
        """Whether the lease is proven for long enough to start the handler.

        After a claim that took more than a third of the lease, one renewal comes first: a
        handler never starts on a lease that may already be another request's.
        """
        if self._proven_until - time.monotonic() > self._lease * 2 / 3:
            return True
        return await self._renew_once() is True

    def watch(self, handler: asyncio.Timeout, recorder: ResponseRecorder) -> None:
        """Start keeping the lease a third of it after the claim (most requests end sooner)."""
        loop = asyncio.get_running_loop()

        def start() -> None:
            self._task = loop.create_task(self._keep(handler, recorder))

        first_renewal = self._proven_until - self._lease * 2 / 3
        self._timer = loop.call_later(max(0.0, first_renewal - time.monotonic()), start)

    def stop(self) -> None:
        """Stop renewing: the handler ended."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    async def _keep(self, handler: asyncio.Timeout, recorder: ResponseRecorder) -> None:
        renewal = asyncio.ensure_future(self._renew())
        try:
            # Wake when the proof runs out or the key is taken over, whichever comes first.
            while not renewal.done():
                remaining = self._proven_until - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait({renewal}, timeout=remaining)
            self._on_lost(handler, recorder)
            if not self.lost and not renewal.done():
                # Going on unprotected: protection resumes if a renewal succeeds again.
                await renewal
        finally:
            renewal.cancel()

    async def _renew(self) -> None:
        """Renew every third of the lease, quickly again after a failure; end when taken over.

        A renewal already sent runs to its end when the handler ends: cut short, it would
        throw away the store's connection mid-call (asyncpg before 0.32 then raises in the
        event loop) for an answer that no longer matters.
        """
        while True:
            self._in_flight = asyncio.ensure_future(self._renew_once())
            owned = await asyncio.shield(self._in_flight)
            if owned is None:
                await asyncio.sleep(max(0.05, self._lease / 20))
            elif not owned:
                logger.warning("lost the lease of key %s to another request", self._exchange.key_id)
                return
            else:
                await asyncio.sleep(self._lease / 3)

    async def _renew_once(self) -> bool | None:
        """One renewal: whether the token still owns the key (``None``: the store failed). A
        success proves the lease from the moment it was sent."""
        exchange = self._exchange
        sent_at = time.monotonic()
        try:
            owned = await exchange.call_store(
                "renew",
                exchange.store.renew(exchange.caller, exchange.key, self.token, lease=self._lease),
            )
        except StoreError as exc:
            logger.warning("could not renew the lease of key %s: %s", exchange.key_id, exc)
            return None
        if owned:
            self._proven_until = sent_at + self._lease
        return owned

    def _on_lost(self, handler: asyncio.Timeout, recorder: ResponseRecorder) -> None:
        exchange = self._exchange
        exchange.emit(EventKind.LEASE_LOST)
        if exchange.options.on_lease_lost == "cancel" and recorder.status is None:
            self.lost = True
            logger.error(
                "key %s: the store did not confirm the lease in time; the request is stopped "
                "and its key left to lapse",
                exchange.key_id,
            )
            handler.reschedule(-math.inf)
        else:
            logger.error(
                "key %s: the store did not confirm the lease in time; the request goes on "
                "unprotected (a retry may run it again once the lease lapses)",
                exchange.key_id,
            )
