"""The pure ASGI middleware: one request flows through key → policy → fingerprint → claim."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from datetime import timedelta

import anyio
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from idempotency_mw.cleanup import PurgeSchedule, background_purge
from idempotency_mw.exceptions import ConfigurationError, SchemaError, StoreError
from idempotency_mw.fingerprint import request_fingerprint
from idempotency_mw.openapi import document_key_header
from idempotency_mw.policy import Duration, RouteOptions, RouteTable, Settings, to_seconds
from idempotency_mw.problems import Problem, send_problem
from idempotency_mw.records import ClaimOutcome, StoredResponse
from idempotency_mw.stores.base import Store

logger = logging.getLogger("idempotency_mw")

DEFAULT_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Response headers left out of a record: credentials, challenges and hop-by-hop headers.
DEFAULT_UNRECORDED_HEADERS = frozenset(
    {
        "set-cookie",
        "www-authenticate",
        "proxy-authenticate",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
REPLAYED_HEADER = (b"idempotent-replayed", b"true")
MAX_KEY_LENGTH = 255

CallerScope = Callable[[HTTPConnection], str | Awaitable[str]]


class IdempotencyMiddleware:
    """Makes non-GET requests that carry an ``Idempotency-Key`` safe to retry.

    The first request with a key runs and its response is recorded; a repeat with the same key
    and the same request gets the recorded response replayed; a repeat with a different request
    gets 409 (or 422); a repeat while the first still runs gets 409 with ``Retry-After``.
    Settings given here are defaults; ``@idempotent`` and the ``routes`` mapping override them
    per route. During the app's lifespan, expired records are purged on the ``purge`` schedule
    (``None`` turns that off, e.g. when a cron job runs ``idempotency-mw purge``).
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
        fingerprint_headers: Iterable[str] = (),
        max_request_bytes: int = 1 << 20,
        max_response_bytes: int = 1 << 20,
        store_server_errors: bool = False,
        mismatch_status: int = 409,
        fail_open: bool = False,
        retry_after: int = 1,
        replay_headers_allow: Iterable[str] | None = None,
        replay_headers_deny: Iterable[str] = DEFAULT_UNRECORDED_HEADERS,
        purge: PurgeSchedule | None = PurgeSchedule(),  # noqa: B008  (frozen, so shareable)
    ) -> None:
        if not isinstance(store, Store):
            raise ConfigurationError(f"store must implement the Store protocol, got {store!r}")
        if mismatch_status not in (409, 422):
            raise ConfigurationError("mismatch_status must be 409 or 422")
        if max_request_bytes < 0 or max_response_bytes < 0 or retry_after < 0:
            raise ConfigurationError("size limits and retry_after must not be negative")
        self.app = app
        self.store = store
        self._defaults = Settings(
            ttl=to_seconds(ttl, "ttl"), required=required, lease=to_seconds(lease, "lease")
        )
        self._methods = frozenset(method.upper() for method in methods)
        self._header_name = header_name
        self._routes = RouteTable(routes)
        self._caller_scope = scope
        self._fingerprint_headers = tuple(sorted({name.lower() for name in fingerprint_headers}))
        self._max_request_bytes = max_request_bytes
        self._max_response_bytes = max_response_bytes
        self._store_server_errors = store_server_errors
        self._mismatch_status = mismatch_status
        self._fail_open = fail_open
        self._retry_after = retry_after
        self._purge = purge
        self._lifespan_resources = AsyncExitStack()
        allow = None if replay_headers_allow is None else {h.lower() for h in replay_headers_allow}
        deny = {h.lower() for h in replay_headers_deny}
        self._records_header: Callable[[bytes], bool] = (
            (lambda name: name.decode("latin-1") not in deny)
            if allow is None
            else (lambda name: name.decode("latin-1") in allow - deny)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(scope, send))
            return
        if scope["type"] != "http" or scope["method"] not in self._methods:
            await self.app(scope, receive, send)
            return

        headers = Headers(scope=scope)
        raw_keys = headers.getlist(self._header_name)
        template, policy = self._routes.resolve(scope)
        settings = self._defaults.merge(policy)
        if not raw_keys:
            if settings.required:
                await send_problem(
                    send, Problem.MISSING_KEY, 400, f"This operation requires {self._header_name}."
                )
            else:
                await self.app(scope, receive, send)
            return
        key = parse_key(raw_keys[0]) if len(raw_keys) == 1 else None
        if key is None:
            detail = (
                f"Send one {self._header_name} header"
                if len(raw_keys) > 1
                else f"{self._header_name} must be 1-{MAX_KEY_LENGTH} visible ASCII characters"
            )
            await send_problem(send, Problem.INVALID_KEY, 400, detail + ".")
            return
        await _Exchange(self, scope, receive, send, headers, key, template, settings).run()

    async def caller_scope(self, scope: Scope) -> str:
        """The namespace of this request's keys, from the ``scope`` option ('' without one)."""
        if self._caller_scope is None:
            return ""
        value = self._caller_scope(HTTPConnection(scope))
        return await value if inspect.isawaitable(value) else value

    def fingerprint(self, scope: Scope, headers: Headers, template: str, body: bytes) -> str:
        """The request's hash: method, route template, path, query, chosen headers, body."""
        return request_fingerprint(
            scope["method"],
            template,
            scope["path"],
            scope.get("query_string", b""),
            [
                (name, value)
                for name in self._fingerprint_headers
                for value in headers.getlist(name)
            ],
            body,
        )

    def _lifespan_send(self, scope: Scope, send: Send) -> Send:
        async def checked_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                # Raising here makes the app report the startup as failed, with our message.
                try:
                    await self.store.startup()
                except StoreError as exc:
                    if isinstance(exc, SchemaError) or not self._fail_open:
                        logger.error("idempotency store not ready: %s", exc)
                        raise
                    logger.warning("idempotency store unreachable at startup: %s", exc)
                document_key_header(
                    scope.get("app"), self._header_name, self._methods, self._defaults, self._routes
                )
                if self._purge is not None:
                    await self._lifespan_resources.enter_async_context(
                        background_purge(self.store, self._purge)
                    )
            elif message["type"] == "lifespan.shutdown.complete":
                await self._lifespan_resources.aclose()
                await self.store.aclose()
            await send(message)

        return checked_send


class _Exchange:
    """One keyed request: read the body, claim the key, then run, replay or reject."""

    def __init__(
        self,
        middleware: IdempotencyMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send,
        headers: Headers,
        key: str,
        template: str,
        settings: Settings,
    ) -> None:
        self.mw = middleware
        self.scope = scope
        self.receive = receive
        self.send = send
        self.headers = headers
        self.key = key
        self.template = template
        self.settings = settings
        self.caller = ""

    @property
    def key_id(self) -> str:
        """A short hash of scope and key, for logs: raw keys are never logged."""
        return hashlib.sha256(f"{self.caller}\0{self.key}".encode()).hexdigest()[:12]

    async def run(self) -> None:
        mw = self.mw
        declared = self.headers.get("content-length", "")
        # ASCII digits only, and few enough of them for int(): the server may not have checked.
        if (
            declared.isascii()
            and declared.isdigit()
            and (len(declared) > 18 or int(declared) > mw._max_request_bytes)
        ):
            await self._too_large()
            return
        body = await self._read_body()
        if body is None:
            return
        self.caller = await mw.caller_scope(self.scope)
        fingerprint = mw.fingerprint(self.scope, self.headers, self.template, body)
        try:
            claim = await mw.store.claim(
                self.caller,
                self.key,
                fingerprint,
                ttl=self.settings.ttl,
                lease=self.settings.lease,
            )
        except StoreError as exc:
            logger.warning("idempotency store failed to claim key %s: %s", self.key_id, exc)
            if mw._fail_open:
                await mw.app(self.scope, _ReplayReceive(body, self.receive), self.send)
            else:
                await send_problem(
                    self.send,
                    Problem.STORE_UNAVAILABLE,
                    503,
                    "The idempotency store is unavailable; retry with the same key.",
                    retry_after=mw._retry_after,
                )
            return

        match claim.outcome:
            case ClaimOutcome.ACQUIRED:
                assert claim.token is not None
                await self._execute(body, claim.token)
            case ClaimOutcome.REPLAY:
                assert claim.response is not None
                await _replay(self.send, claim.response)
            case ClaimOutcome.IN_PROGRESS:
                await send_problem(
                    self.send,
                    Problem.IN_PROGRESS,
                    409,
                    "A request with this key is still being processed; retry later.",
                    retry_after=mw._retry_after,
                )
            case ClaimOutcome.MISMATCH:
                await send_problem(
                    self.send,
                    Problem.MISMATCH,
                    mw._mismatch_status,
                    "This key was used with a different request; use a new key for a new request.",
                )
            case ClaimOutcome.UNREPLAYABLE:
                await send_problem(
                    self.send,
                    Problem.UNREPLAYABLE,
                    409,
                    "This key's request ran, but its response was too large to record.",
                )

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
            if size > self.mw._max_request_bytes:
                await self._too_large()
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self) -> None:
        await send_problem(
            self.send,
            Problem.TOO_LARGE,
            413,
            f"Request bodies are limited to {self.mw._max_request_bytes} bytes.",
        )

    async def _execute(self, body: bytes, token: str) -> None:
        settled = False

        async def settle(recorder: _ResponseRecorder) -> None:
            nonlocal settled
            if not settled:
                settled = True
                with anyio.CancelScope(shield=True):
                    await self._settle(token, recorder)

        recorder = _ResponseRecorder(
            self.send, self.mw._max_response_bytes, self.mw._records_header, settle
        )
        # Most requests end within a third of the lease: only the others start renewing it.
        loop = asyncio.get_running_loop()
        keeper: list[asyncio.Task[None]] = []
        timer = loop.call_later(
            self.settings.lease / 3,
            lambda: keeper.append(loop.create_task(self._keep_lease(token))),
        )
        try:
            await self.mw.app(self.scope, _ReplayReceive(body, self.receive), recorder.send)
        finally:
            timer.cancel()
            for task in keeper:
                task.cancel()
            # Settled already when the response ended; otherwise the app failed or stopped.
            await settle(recorder)

    async def _settle(self, token: str, recorder: _ResponseRecorder) -> None:
        """Record the response, or release the key when there is none worth replaying."""
        status = recorder.status
        if (
            status is None
            or not recorder.finished
            or (status >= 500 and not self.mw._store_server_errors)
        ):
            await self._release(token)
            return
        try:
            owned = await self.mw.store.complete(
                self.caller, self.key, token, recorder.stored_response(), ttl=self.settings.ttl
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
            await self.mw.store.release(self.caller, self.key, token)
        except StoreError as exc:
            logger.error("could not release key %s (its lease will lapse): %s", self.key_id, exc)

    async def _keep_lease(self, token: str) -> None:
        lease = self.settings.lease
        while True:
            try:
                owned = await self.mw.store.renew(self.caller, self.key, token, lease=lease)
            except StoreError as exc:
                logger.warning("could not renew the lease of key %s: %s", self.key_id, exc)
                owned = True
            if not owned:
                logger.warning("lost the lease of key %s to another request", self.key_id)
                return
            await asyncio.sleep(lease / 3)


def parse_key(raw: str) -> str | None:
    """The key from a header value, or ``None`` if it is not a valid key.

    A bare key is 1-255 visible ASCII characters; a value that opens with a double quote must
    be a Structured-Field string (``"abc"``, with ``\\"`` and ``\\\\`` escapes) and is unquoted.
    """
    if raw.startswith('"'):
        key = _unquote_sf_string(raw[1:-1]) if len(raw) >= 2 and raw.endswith('"') else None
    else:
        # Printable ASCII without the space: "!" to "~".
        key = raw if raw.isascii() and raw.isprintable() and " " not in raw else None
    if key is None or not 1 <= len(key) <= MAX_KEY_LENGTH:
        return None
    return key


def _unquote_sf_string(quoted: str) -> str | None:
    chars: list[str] = []
    escaped = False
    for char in quoted:
        if not " " <= char <= "~":
            return None
        if escaped:
            if char not in '"\\':
                return None
            chars.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return None
        else:
            chars.append(char)
    return None if escaped else "".join(chars)


class _ReplayReceive:
    """Gives the app the body already read, then hands over to the server's ``receive``."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        if self._body is None:
            return await self._receive()
        body, self._body = self._body, None
        return {"type": "http.request", "body": body, "more_body": False}


class _ResponseRecorder:
    """Passes the response through unchanged while keeping a copy up to ``limit`` bytes.

    ``on_finish`` runs when the last body chunk arrives, before that chunk is passed on.
    """

    def __init__(
        self,
        send: Send,
        limit: int,
        records_header: Callable[[bytes], bool],
        on_finish: Callable[[_ResponseRecorder], Awaitable[None]],
    ) -> None:
        self._send = send
        self._on_finish = on_finish
        self._limit = limit
        self._records_header = records_header
        self._chunks: list[bytes] = []
        self._size = 0
        self.status: int | None = None
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.replayable = True
        self.finished = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = tuple(
                (bytes(name), bytes(value))
                for name, value in message.get("headers", ())
                if self._records_header(bytes(name).lower())
            )
        elif kind == "http.response.body":
            chunk: bytes = message.get("body", b"")
            if self.replayable:
                self._size += len(chunk)
                if self._size <= self._limit:
                    self._chunks.append(chunk)
                else:
                    self.replayable = False
                    self._chunks.clear()
            self.finished = not message.get("more_body", False)
            if self.finished:
                # Recorded before the client sees the end: a retry sent after the answer
                # arrived is replayed, never told the request is still in progress.
                await self._on_finish(self)
        else:
            # A file sent by path, trailers and the like are not recorded.
            self.replayable = False
        await self._send(message)

    def stored_response(self) -> StoredResponse | None:
        """The response as it will be replayed, or ``None`` when it cannot be."""
        if not self.replayable or self.status is None:
            return None
        return StoredResponse(self.status, self.headers, b"".join(self._chunks))


async def _replay(send: Send, response: StoredResponse) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": [*response.headers, REPLAYED_HEADER],
        }
    )
    await send({"type": "http.response.body", "body": response.body})
