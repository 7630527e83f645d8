"""The doors of a route: where a keyed request's endpoint begins.

The middleware claims a key before the app runs (so a replay or a refusal never runs it); a
door tells it whether the endpoint began, and so whether an answer is recorded or its key
released. Each door is put in place once, before any request, through what the frameworks
publish:

- the *endpoint's door*: ``@idempotent`` wraps the endpoint function it decorates, before the
  route is made of it. FastAPI calls it after its request validation and the route's
  dependencies, Starlette after every layer inside the middleware. One refused before it (a
  validation error, a dependency's ``HTTPException``, an inner layer's 401) releases its key,
  unless ``fence()`` marked an effect in a dependency. A route whose caller scope comes from a
  dependency (``@idempotent(scope=Depends(...))``) is claimed at this door, where the scope is
  known; a replay or a refusal found there is answered by the middleware, and the endpoint does
  not run. A generator endpoint gets none (its body runs after the response began), nor does
  a class (Starlette's ``HTTPEndpoint``).
- the *route's door*: every other route the app holds in its route lists (its own, its mounted
  sub-apps' and host routes') gets its ASGI app wrapped, as Starlette's own per-route
  middleware is, by :func:`give_door`, once, before the app's first request is dispatched (at
  the lifespan's start-up, or at the first request of an app run without one: an
  ``httpx.ASGITransport``, a ``TestClient`` used without ``with``). It is passed after every
  layer inside the middleware, before FastAPI's validation and dependencies: on a FastAPI
  route without ``@idempotent``, what they refuse counts as the endpoint's answer (nothing
  FastAPI publishes tells that they passed).
- none: a route added after the first request, a route FastAPI makes itself at dispatch (those
  of included routers, from FastAPI 0.137), unless ``@idempotent`` gave it the endpoint's
  door. Whatever such a route answers counts as its endpoint's: every answer below 500 is
  recorded, except a framework's answer to a request that failed validation, known by its
  body (FastAPI's 422).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio.from_thread
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw.engine.fence import current_entrance
from idempotency_mw.values.exceptions import ConfigurationError
from idempotency_mw.wire.keys import current_claim

#: The name of the parameter through which ``@idempotent(scope=Depends(...))`` hands the door
#: the caller's scope (FastAPI resolves it with the endpoint's other dependencies).
SCOPE_PARAMETER = "idempotency_caller_scope__"
#: Set on an endpoint's door, so that a route knows it has one.
_DOOR = "__idempotency_door__"

#: How far the app shows a request's way: the route's door only, or the endpoint's.
ROUTE = "route"
ENDPOINT = "endpoint"


def doors_of(route: object) -> str | None:
    """Which door ``route`` has: :data:`ENDPOINT`, :data:`ROUTE`, or ``None`` for none."""
    if getattr(getattr(route, "endpoint", None), _DOOR, False):
        return ENDPOINT
    return ROUTE if isinstance(getattr(route, "app", None), RouteDoor) else None


def give_door(route: object) -> None:
    """Give ``route`` the route's door, unless it has a door or is no route of an endpoint."""
    if isinstance(route, Route) and doors_of(route) is None:
        route.app = RouteDoor(route.app)


class RouteDoor:
    """A route's ASGI app behind the route's door."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        entrance = current_entrance.get()
        if entrance is not None:
            # The route began (its key was claimed before the app ran, and fence() handed it).
            entrance.passed(endpoint=False)
        await self.app(scope, receive, send)


def endpoint_door(endpoint: Callable[..., Any], scope: object) -> Callable[..., Any]:
    """``endpoint`` behind the endpoint's door (a generator or a class as it is); with
    ``scope``, a ``Depends``, the door takes that dependency's value as the caller's scope."""
    if scope is not None:
        endpoint = _with_scope_dependency(endpoint, scope)
    if (
        inspect.isasyncgenfunction(endpoint)
        or inspect.isgeneratorfunction(endpoint)
        or inspect.isclass(endpoint)  # Starlette's HTTPEndpoint: an ASGI app of its own
    ):
        return endpoint
    if inspect.iscoroutinefunction(endpoint) or inspect.iscoroutinefunction(
        getattr(endpoint, "__call__", None)  # noqa: B004  (a callable object's async __call__)
    ):

        @functools.wraps(endpoint)
        async def async_door(*args: Any, **values: Any) -> Any:
            entrance = current_entrance.get()
            if entrance is None or entrance.passed(endpoint=True):
                return await endpoint(*args, **values)
            entry = await entrance.enter(values.get(SCOPE_PARAMETER), endpoint=True)
            if entry is None:
                return _Answered()
            reset = current_claim.set(entry)
            try:
                return await endpoint(*args, **values)
            finally:
                current_claim.reset(reset)

        door: Callable[..., Any] = async_door
    else:

        @functools.wraps(endpoint)
        def sync_door(*args: Any, **values: Any) -> Any:
            entrance = current_entrance.get()
            if entrance is None or entrance.passed(endpoint=True):
                return endpoint(*args, **values)
            # A sync endpoint runs in a worker thread: the claim is made in the event loop.
            entry = anyio.from_thread.run(
                functools.partial(entrance.enter, values.get(SCOPE_PARAMETER), endpoint=True)
            )
            if entry is None:
                return _Answered()
            reset = current_claim.set(entry)
            try:
                return endpoint(*args, **values)
            finally:
                current_claim.reset(reset)

        door = sync_door
    door.__signature__ = _signature_of(endpoint)  # type: ignore[attr-defined]
    setattr(door, _DOOR, True)
    return door


def _signature_of(endpoint: Callable[..., Any]) -> inspect.Signature:
    """``endpoint``'s signature, its string annotations (``from __future__ import annotations``)
    evaluated in the endpoint's own module where they can be: older FastAPI releases (0.115)
    evaluate them in the globals of the function they are given, for a door this module's."""
    try:
        return inspect.signature(endpoint, eval_str=True)
    except NameError:  # a name defined later in its module: left to FastAPI, as written
        return inspect.signature(endpoint)


class _Answered(Response):
    """The endpoint's return value when the middleware answered instead: layers inside the
    middleware see a complete (empty) response, which the middleware drops."""

    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _with_scope_dependency(endpoint: Callable[..., Any], dependency: object) -> Callable[..., Any]:
    """``endpoint`` with one more keyword parameter, resolved by FastAPI as ``dependency``
    (a ``Depends``), whose value the door takes as the caller's scope."""
    if inspect.isasyncgenfunction(endpoint) or inspect.isgeneratorfunction(endpoint):
        raise ConfigurationError(
            "@idempotent(scope=Depends(...)) needs an endpoint that returns its response; a "
            "generator's body runs after the response began"
        )
    signature = _signature_of(endpoint)
    if SCOPE_PARAMETER in signature.parameters:
        return endpoint
    parameters = list(signature.parameters.values())
    added = inspect.Parameter(SCOPE_PARAMETER, inspect.Parameter.KEYWORD_ONLY, default=dependency)
    at = next(
        (i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD),
        len(parameters),
    )
    parameters.insert(at, added)

    if inspect.iscoroutinefunction(endpoint):

        @functools.wraps(endpoint)
        async def scoped(*args: Any, **values: Any) -> Any:
            values.pop(SCOPE_PARAMETER, None)
            return await endpoint(*args, **values)

    else:

        @functools.wraps(endpoint)
        def scoped(*args: Any, **values: Any) -> Any:
            values.pop(SCOPE_PARAMETER, None)
            return endpoint(*args, **values)

    scoped.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return scoped
