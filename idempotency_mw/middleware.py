"""The pure ASGI middleware: pass through what is not ours, read the key and the route's
policy, then hand the request to its :class:`~idempotency_mw.exchange.Exchange`."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Unpack

from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw._asgi import invalid_key_detail, parse_key, request_headers
from idempotency_mw.cleanup import PurgeSchedule
from idempotency_mw.door import give_door
from idempotency_mw.engine import ClaimEngine
from idempotency_mw.exchange import Exchange
from idempotency_mw.fence import UNKEYED, current_claim
from idempotency_mw.lifespan import run_lifespan, store_lifespan
from idempotency_mw.lookup import answer_lookup, looked_up_key
from idempotency_mw.metrics import EventHook
from idempotency_mw.openapi import document_openapi
from idempotency_mw.options import (
    DEFAULT_METHODS,
    DEFAULT_UNRECORDED_HEADERS,
    CallerScope,
    LeaseLostAction,
    build_options,
)
from idempotency_mw.policy import RouteTable, app_routes, routes_within
from idempotency_mw.problems import Problem, send_problem
from idempotency_mw.retention import (
    FIRST_SENT_HEADER,
    REQUEST_ID_HEADER,
    KeyAnswers,
    parse_http_date,
)
from idempotency_mw.settings import RouteOptions
from idempotency_mw.stores.base import Store

logger = logging.getLogger("idempotency_mw")


class IdempotencyMiddleware:
    """Makes non-GET requests that carry an ``Idempotency-Key`` safe to retry.

    The first request with a key runs and its response is recorded; a repeat with the same key
    and the same request gets the recorded response replayed; a repeat with a different request
    gets 409 (or 422); a repeat while the first still runs gets 409 with ``Retry-After``.
    Every answer below 500 of an endpoint that began is recorded; a route's door tells where
    it begins (see :mod:`idempotency_mw.door`: ``@idempotent`` gives an endpoint its own,
    after FastAPI's validation and the route's dependencies; the lifespan's start-up and
    :func:`install` give the others theirs). The route settings given here by name
    (:class:`~idempotency_mw.RouteOptions`: ``ttl``, ``lease``, ``required``, ``wait``,
    ``fingerprint``, ``release_statuses``, ``fenced``, ``max_request_bytes``) are every
    route's defaults; ``@idempotent`` and the ``routes`` mapping override them per route. An
    app whose routes the middleware cannot read (Litestar, a bare ASGI callable) is guarded by
    method and path. During the app's lifespan the store is checked (``server_checks=False``
    leaves out the warnings about its server's settings: see ``idempotency-mw check``), expired
    records are purged on the ``purge`` schedule (``None`` turns that off, e.g. when a cron job runs
    ``idempotency-mw purge``) and the store is closed at shutdown; ``lifespan=False`` leaves
    all of that to :func:`~idempotency_mw.lifespan.store_lifespan` in the app's own lifespan.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store,
        methods: Iterable[str] = DEFAULT_METHODS,
        header_name: str = "Idempotency-Key",
        request_id_header: str | None = REQUEST_ID_HEADER,
        first_sent_header: str = FIRST_SENT_HEADER,
        lookup_path: str | None = None,
        routes: Mapping[str, RouteOptions] | None = None,
        scope: CallerScope | None = None,
        credential_headers: Iterable[str] = ("authorization",),
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
        self._documented: set[int] = set()

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
        options = self.options
        if scope["method"] not in options.methods:
            if options.lookup_path is not None and scope["method"] == "GET":
                raw = looked_up_key(scope, options.lookup_path)
                if raw is not None:
                    await answer_lookup(options, scope, send, raw)
                    return
            await self.app(scope, receive, send)
            return
        resolved = self.routes.resolve(app, scope)
        if resolved is None:
            # The app answers 404 or 405: nothing runs, so there is nothing to guard or record.
            await self.app(scope, receive, send)
            return
        settings = options.defaults.merge(resolved.policy)
        headers = request_headers(scope, options.read_headers)
        raw_keys = headers.get(options.header_name.lower(), [])
        # An OASIS caller sends its key as the request id: the same key, or a second one.
        ids = headers.get(options.request_id_header or "", [])
        if ids:
            raw_keys = ids if raw_keys in ([], ids) else raw_keys + ids
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
        answers = KeyAnswers(send, oasis=bool(ids))
        sent = headers.get(options.first_sent_header)
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
        await exchange.run(doors=resolved.doors)

    def _document(self, app: object) -> None:
        """Once per app, at its start-up or first request: its routes' settings are checked
        and the OpenAPI schema documents them."""
        self._documented.add(id(app))
        routes = app_routes(app)
        if routes is not None:
            self.routes.check(routes, self.options.defaults)
        document_openapi(app, self.options, self.routes)

    @asynccontextmanager
    async def _lifespan(self, scope: Scope) -> AsyncIterator[None]:
        app = scope.get("app", self.app)
        self._document(app)
        _give_doors(app)
        self.routes.forget()
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
    that two things the middleware does at start-up are done at once, before the first request
    or the lifespan (a schema-export script, a ``TestClient`` used without ``with``): the
    OpenAPI schema shows the key header and the problem answers, and the routes the app has
    now get their doors (:mod:`idempotency_mw.door`).
    """
    # The options validated as the middleware will take them, defaults from its signature.
    given = inspect.signature(IdempotencyMiddleware).bind(app, store=store, **options)
    given.apply_defaults()
    built = build_options(**{name: v for name, v in given.arguments.items() if name != "app"})
    document_openapi(app, built, RouteTable(built.routes))
    _give_doors(app)
    app.add_middleware(IdempotencyMiddleware, store=store, **options)


def _give_doors(app: object) -> None:
    """Give each route of ``app`` that has no door the route's door (see
    :mod:`idempotency_mw.door`): once, at start-up, never while requests run."""
    for route in routes_within(app):
        give_door(route)
