"""The pure ASGI middleware: pass through what is not ours, read the key and the route's
policy, then hand the request to its :class:`~idempotency_mw.http.exchange.Exchange`."""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Unpack

from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw.engine.claim import ClaimEngine
from idempotency_mw.engine.cleanup import PurgeSchedule
from idempotency_mw.engine.fence import UNKEYED
from idempotency_mw.http._asgi import ReplayReceive, invalid_key_detail, parse_key, request_headers
from idempotency_mw.http.door import give_door
from idempotency_mw.http.exchange import Exchange, read_body
from idempotency_mw.http.lifespan import run_lifespan, store_lifespan
from idempotency_mw.http.lookup import answer_lookup, looked_up_key
from idempotency_mw.http.openapi import document_openapi
from idempotency_mw.http.options import (
    DEFAULT_METHODS,
    DEFAULT_UNRECORDED_HEADERS,
    SAFE_METHODS,
    CallerScope,
    build_options,
)
from idempotency_mw.http.policy import RouteTable, app_routes, routes_within
from idempotency_mw.http.retention import KeyAnswers
from idempotency_mw.stores.base import Store
from idempotency_mw.values.key_sources import NotAKey
from idempotency_mw.values.metrics import EventHook
from idempotency_mw.values.problems import Problem, send_problem
from idempotency_mw.values.settings import LeaseLostAction, RouteOptions
from idempotency_mw.wire.http import (
    FIRST_SENT_HEADER,
    KEY_HEADER,
    REQUEST_ID_HEADER,
    parse_http_date,
)
from idempotency_mw.wire.keys import current_claim

logger = logging.getLogger("idempotency_mw")


class IdempotencyMiddleware:
    """Makes non-GET requests that carry an ``Idempotency-Key`` safe to retry.

    The first request with a key runs and its response is recorded; a repeat with the same key
    and the same request gets the recorded response replayed; a repeat with a different request
    gets 409 (or 422); a repeat while the first still runs gets 409 with ``Retry-After``.
    Every answer below 500 of an endpoint that began is recorded; a route's door tells where
    it begins (see :mod:`idempotency_mw.http.door`: ``@idempotent`` gives an endpoint its own,
    after FastAPI's validation and the route's dependencies; the others get theirs before the
    app's first request, lifespan or not). The route settings given here by name
    (:class:`~idempotency_mw.RouteOptions`: ``ttl``, ``lease``, ``required``, ``wait``,
    ``fingerprint``, ``release_statuses``, ``fenced``, ``max_request_bytes``, ``key``) are every
    route's defaults; ``@idempotent`` and the ``routes`` mapping override them per route. An
    app whose routes the middleware cannot read (Litestar, a bare ASGI callable) is guarded by
    method and path. During the app's lifespan the store is checked (``server_checks=False``
    leaves out the warnings about its server's settings: see ``idempotency-mw check``), expired
    records are purged on the ``purge`` schedule (``None`` turns that off, e.g. when a cron job runs
    ``idempotency-mw purge``) and the store is closed at shutdown; ``lifespan=False`` leaves
    all of that to :func:`~idempotency_mw.http.lifespan.store_lifespan` in the app's own lifespan.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        methods: Iterable[str] = DEFAULT_METHODS,
        header_name: str = KEY_HEADER,
        request_id_header: str | None = REQUEST_ID_HEADER,
        first_sent_header: str = FIRST_SENT_HEADER,
        lookup_path: str | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
        scope: CallerScope | None = None,
        credential_headers: Iterable[str] | None = None,
        credential_cookies: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        max_response_bytes: int = 1 << 20,
        max_header_bytes: int = 1 << 16,
        store_server_errors: bool = False,
        mismatch_status: int = 409,
        fail_open: bool = False,
        retry_after: int = 1,
        replay_headers_allow: Iterable[str] | None = None,
        replay_headers_deny: Iterable[str] = DEFAULT_UNRECORDED_HEADERS,
        on_lease_lost: LeaseLostAction = "cancel",
        purge: PurgeSchedule | None = PurgeSchedule(),  # noqa: B008  (frozen, so shareable)
        lifespan: bool = True,
        server_checks: bool = True,
        on_event: EventHook | None = None,
        **settings: Unpack[RouteOptions],
    ) -> None:
        # Every parameter but app is an option, listed (with its default) for readers and
        # type checkers and handed on as it is: a new option is one more parameter here.
        given = {name: value for name, value in locals().items() if name not in ("self", "app")}
        self.app = app
        self.options = build_options(**given)
        self.routes = RouteTable(self.options.routes)
        self.engine = ClaimEngine(
            store, on_event=self.options.on_event, on_lease_lost=on_lease_lost
        )
        #: The apps (by id) whose routes have their doors.
        self._prepared: set[int] = set()
        self._preparing = threading.Lock()

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
        if id(app) not in self._prepared:
            # Without a lifespan (a TestClient used without `with`), the first request does it.
            self._prepare(app)
        options = self.options
        method = scope["method"]
        if method not in options.methods:
            if options.lookup_path is not None and method == "GET":
                raw = looked_up_key(scope, options.lookup_path)
                if raw is not None:
                    await answer_lookup(options, scope, send, raw)
                    return
            if method in SAFE_METHODS or not self._repeatable(scope):
                await self.app(scope, receive, send)
                return
            # Sent as repeatable with a method this middleware does not guard (OASIS 3.1.1).
            answers = KeyAnswers(send, oasis=True)
            if self.routes.resolve(app, scope) is None:
                await self.app(scope, receive, answers.send)  # the app's own 404 or 405
                return
            await send_problem(
                answers.send,
                Problem.NOT_REPEATABLE,
                501,
                f"{method} requests are not made repeatable here: send it without "
                f"{options.request_id_header}, or use a method of {sorted(options.methods)}.",
            )
            return
        headers = request_headers(scope, options.read_headers)
        keyed = headers.get(options.header_name.lower(), [])
        # An OASIS caller sends its key as the request id: the same key, or a second one.
        ids = headers.get((options.request_id_header or "").lower(), [])
        answers = KeyAnswers(send, oasis=bool(ids))
        resolved = self.routes.resolve(app, scope)
        if resolved is None:
            # The app answers 404 or 405: nothing runs, so there is nothing to guard or record.
            await self.app(scope, receive, answers.send)
            return
        settings = options.defaults.merge(resolved.policy)
        source = settings.key
        body: bytes | None = None
        if source is None:
            name = options.header_name
            raw_keys = ids if keyed in ([], ids) else keyed + ids
            # What the caller is told names the header its key came in.
            key_header = " or ".join(
                header
                for header, given in ((name, keyed), (options.request_id_header, ids))
                if given and header is not None
            )
        elif not source.in_body:
            name = key_header = source.name
            raw_keys = request_headers(scope, frozenset({name.lower().encode("latin-1")})).get(
                name.lower(), []
            )
        else:
            # The body is read once: its key now, its fingerprint and the app's copy later.
            name = key_header = source.label
            body = await read_body(receive, answers.send, headers, settings, options)
            if body is None:
                return
            try:
                found = source.in_json(body)
            except NotAKey as exc:
                await send_problem(answers.send, Problem.INVALID_KEY, 400, f"{exc}.")
                return
            raw_keys = [] if found is None else [found]
        if not raw_keys:
            if settings.required:
                await send_problem(
                    send, Problem.MISSING_KEY, 400, f"This operation requires {name}."
                )
            else:
                # A guarded route without a key: fence() has nothing to mark, and says so.
                unkeyed = current_claim.set(UNKEYED)
                try:
                    await self.app(
                        scope, receive if body is None else ReplayReceive(body, receive), send
                    )
                finally:
                    current_claim.reset(unkeyed)
            return
        key = parse_key(raw_keys[0]) if len(raw_keys) == 1 else None
        if key is None:
            detail = (
                f"Send one {key_header} header"
                if len(raw_keys) > 1
                else invalid_key_detail(key_header, raw_keys[0])
            )
            await send_problem(answers.send, Problem.INVALID_KEY, 400, detail + ".")
            return
        sent = headers.get(options.first_sent_header.lower())
        if sent:
            answers.first_sent = parse_http_date(sent[0]) if len(sent) == 1 else None
            if answers.first_sent is None:
                answers.reject()
                await send_problem(
                    answers.send,
                    Problem.INVALID_FIRST_SENT,
                    400,
                    f"Send one {options.first_sent_header} header, an HTTP-date "
                    "(e.g. Sun, 06 Nov 1994 08:49:37 GMT).",
                )
                return
        exchange = Exchange(
            self.app,
            options,
            self.engine,
            scope,
            receive,
            answers,
            headers,
            key,
            resolved.template,
            settings,
        )
        await exchange.run(doors=resolved.doors, body=body)

    def _repeatable(self, scope: Scope) -> bool:
        """Whether the request was sent as repeatable: it carries the OASIS request id."""
        name = self.options.request_id_header
        return name is not None and bool(
            request_headers(scope, frozenset({name.lower().encode("latin-1")}))
        )

    def _prepare(self, app: object) -> None:
        """Document ``app``'s schema and give its routes their doors: once, before its first
        request is dispatched (at the lifespan's start-up, else at its first request), so that
        an app answers the same with a lifespan or without."""
        with self._preparing:  # a TestClient without `with` may send from several threads
            if id(app) in self._prepared:
                return
            routes = app_routes(app)
            if routes is not None:
                # A route's ttl and the middleware's lease meet here (a ConfigurationError).
                self.routes.check(routes, self.options.defaults)
            document_openapi(app, self.options, self.routes)
            for route in routes_within(app):
                give_door(route)
            self.routes.forget()
            self._prepared.add(id(app))

    @asynccontextmanager
    async def _lifespan(self, scope: Scope) -> AsyncIterator[None]:
        app = scope.get("app", self.app)
        self._prepare(app)
        routes = app_routes(app)
        if routes is None:
            logger.info(
                "the routes of %s cannot be read (not a Starlette or FastAPI app): every "
                "path is guarded by method and path, with the routes= entries matched "
                "against paths",
                type(app).__name__,
            )
        else:
            unmatched = self.routes.unmatched_entries(routes)
            if unmatched:
                logger.warning("routes= entries that match no route of the app: %s", unmatched)
        async with AsyncExitStack() as stack:
            if self.options.lifespan:
                await stack.enter_async_context(
                    store_lifespan(
                        self.options.store,
                        purge=self.options.purge,
                        server_checks=self.options.server_checks,
                    )
                )
            stack.push_async_callback(self.engine.aclose)  # before the store closes
            yield


def install(app: Any, *, store: Store, **options: Any) -> None:
    """Add :class:`IdempotencyMiddleware` to a Starlette/FastAPI ``app``; document it now.

    The same as ``app.add_middleware(IdempotencyMiddleware, store=store, **options)``, except
    that the OpenAPI schema shows the key header and the problem answers at once, before the
    first request or the lifespan (for a script that exports the schema without serving).
    """
    # The options validated as the middleware will take them, defaults from its signature.
    given = inspect.signature(IdempotencyMiddleware).bind(app, store=store, **options)
    given.apply_defaults()
    built = build_options(**{name: v for name, v in given.arguments.items() if name != "app"})
    document_openapi(app, built, RouteTable(built.routes))
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
