"""The doors of a route: where a keyed request's endpoint begins.

The middleware claims a key before the app runs (so a replay or a refusal never runs it), and
gives each route it guards one door, once, that tells when the endpoint began: a FastAPI
route's on its endpoint function, passed after FastAPI's validation and the route's
dependencies; a Starlette route's on its ASGI app, passed after every layer inside the
middleware. Only a request that passed its door has begun, so only its answers are recorded;
one refused before it (a validation error, a dependency's ``HTTPException``, an inner layer's
401) releases its key, unless ``fence()`` marked an effect in a dependency. A route whose
caller scope comes from a dependency (``@idempotent(scope=Depends(...))``) is claimed at its
endpoint's door instead, where the scope is known; a replay or a refusal found there is
answered by the middleware, and the endpoint does not run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.from_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from idempotency_mw.exceptions import ConfigurationError
from idempotency_mw.fence import current_claim, current_entrance

#: The name of the parameter through which ``@idempotent(scope=Depends(...))`` hands the door
#: the caller's scope (FastAPI resolves it with the endpoint's other dependencies).
SCOPE_PARAMETER = "idempotency_caller_scope__"
_DOOR = "__idempotency_door__"


#: How far the app shows a request's way: the route's door only, or the endpoint's too.
ROUTE = "route"
ENDPOINT = "endpoint"


def doors_of(route: object) -> str | None:
    """Give ``route`` its doors, unless it has them or cannot have them: :data:`ENDPOINT` when
    it has the endpoint's door too, :data:`ROUTE` when only the route's, ``None`` for none.

    A FastAPI endpoint that is a generator gets no endpoint's door: its body runs after the
    response began.
    """
    doors: str | None = getattr(route, _DOOR, None)
    if doors is not None:
        return doors
    if not (hasattr(route, "endpoint") and callable(getattr(route, "app", None))):
        return None
    dependant: Any = getattr(route, "dependant", None)
    call = None if dependant is None else dependant.call
    if call is not None and not (
        inspect.isasyncgenfunction(call) or inspect.isgeneratorfunction(call)
    ):
        dependant.call = _endpoint_door(call)
        doors = ENDPOINT
    else:
        route.app = _route_door(route.app)  # type: ignore[attr-defined]
        doors = ROUTE
    setattr(route, _DOOR, doors)
    return doors


class _Answered(Response):
    """The endpoint's return value when the middleware answered instead: layers inside the
    middleware see a complete (empty) response, which the middleware drops."""

    def __init__(self) -> None:
        super().__init__(status_code=204)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_placeholder(send)


async def _send_placeholder(send: Send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _endpoint_door(call: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(call) or inspect.iscoroutinefunction(
        getattr(call, "__call__", None)  # noqa: B004  (a callable object's async __call__)
    ):

        @functools.wraps(call)
        async def async_door(*args: Any, **values: Any) -> Any:
            entrance = current_entrance.get()
            if entrance is None or entrance.passed(endpoint=True):
                return await call(*args, **values)
            entry = await entrance.enter(values.get(SCOPE_PARAMETER), endpoint=True)
            if entry is None:
                return _Answered()
            reset = current_claim.set(entry)
            try:
                return await call(*args, **values)
            finally:
                current_claim.reset(reset)

        return async_door

    @functools.wraps(call)
    def sync_door(*args: Any, **values: Any) -> Any:
        entrance = current_entrance.get()
        if entrance is None or entrance.passed(endpoint=True):
            return call(*args, **values)
        # A sync endpoint runs in a worker thread: the claim is made in the event loop.
        entry = anyio.from_thread.run(
            functools.partial(entrance.enter, values.get(SCOPE_PARAMETER), endpoint=True)
        )
        if entry is None:
            return _Answered()
        reset = current_claim.set(entry)
        try:
            return call(*args, **values)
        finally:
            current_claim.reset(reset)

    return sync_door


def _route_door(
    app: Callable[[Scope, Receive, Send], Awaitable[None]],
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def door(scope: Scope, receive: Receive, send: Send) -> None:
        entrance = current_entrance.get()
        if entrance is not None:
            # The route began (its key was claimed before the app ran, and fence() handed it).
            entrance.passed(endpoint=False)
        await app(scope, receive, send)

    return door


def with_scope_dependency(endpoint: Callable[..., Any], dependency: object) -> Callable[..., Any]:
    """``endpoint`` with one more keyword parameter, resolved by FastAPI as ``dependency``
    (a ``Depends``), whose value the door takes as the caller's scope."""
    if inspect.isasyncgenfunction(endpoint) or inspect.isgeneratorfunction(endpoint):
        raise ConfigurationError(
            "@idempotent(scope=Depends(...)) needs an endpoint that returns its response; a "
            "generator's body runs after the response began"
        )
    signature = inspect.signature(endpoint)
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
