"""Where the endpoint begins: the doors ``@idempotent`` and the start-up (the lifespan,
``install()``) give routes, and what a route without one records, as when an app runs without
its lifespan and without ``install()`` (an ``httpx.ASGITransport``, a ``TestClient`` without
``with``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest
from asgi_lifespan import LifespanManager
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from fastapi.routing import APIRoute
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, Store, idempotent, install
from idempotency_mw.door import RouteDoor
from tests.support.apps import started

pytestmark = pytest.mark.anyio

KEY = {"Idempotency-Key": "k"}
GOOD = {**KEY, "Authorization": "Bearer good"}


async def signed_in(authorization: str = Header("")) -> str:
    if authorization != "Bearer good":
        raise HTTPException(401, "sign in")
    return "alice"


def fastapi_service(store: Store) -> FastAPI:
    """Endpoints behind an auth dependency: with ``@idempotent`` (async and ``def``, on an
    included router) and without (on the router, and on the app itself)."""
    runs: Counter[str] = Counter()
    router = APIRouter(prefix="/v1")

    @router.post("/doored", status_code=201)
    @idempotent()
    async def doored(user: str = Depends(signed_in)) -> dict[str, int]:
        runs["/v1/doored"] += 1
        return {"run": runs["/v1/doored"]}

    @router.post("/doored-sync", status_code=201)
    @idempotent()
    def doored_sync(user: str = Depends(signed_in)) -> dict[str, int]:
        runs["/v1/doored-sync"] += 1
        return {"run": runs["/v1/doored-sync"]}

    @router.post("/plain", status_code=201)
    async def plain(user: str = Depends(signed_in)) -> dict[str, int]:
        runs["/v1/plain"] += 1
        return {"run": runs["/v1/plain"]}

    app = FastAPI()
    app.include_router(router)

    @app.post("/direct", status_code=201)
    async def direct(user: str = Depends(signed_in)) -> dict[str, int]:
        runs["/direct"] += 1
        return {"run": runs["/direct"]}

    app.add_middleware(IdempotencyMiddleware, store=store)
    app.state.runs = runs
    return app


class Guard:
    """A layer inside the middleware that answers 401 by itself, unless the request has a pass."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (b"x-pass", b"yes") not in scope["headers"]:
            await PlainTextResponse("no pass", status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def starlette_service(store: Store, *, installed: bool = False) -> Starlette:
    """A plain route and an ``@idempotent`` one behind :class:`Guard`; the middleware added by
    ``install()`` or listed (outside the guard either way)."""
    runs: Counter[str] = Counter()

    async def jobs(request: Request) -> JSONResponse:
        runs["/jobs"] += 1
        return JSONResponse({"run": runs["/jobs"]}, status_code=201)

    @idempotent()
    async def doored(request: Request) -> JSONResponse:
        runs["/doored"] += 1
        return JSONResponse({"run": runs["/doored"]}, status_code=201)

    middleware = [Middleware(Guard)]
    if not installed:
        middleware.insert(0, Middleware(IdempotencyMiddleware, store=store))
    app = Starlette(
        routes=[
            Route("/jobs", jobs, methods=["POST"]),
            Route("/doored", doored, methods=["POST"]),
            Mount("/sub", routes=[Route("/jobs", jobs, methods=["POST"])]),
        ],
        middleware=middleware,
    )
    if installed:
        install(app, store=store)
    app.state.runs = runs
    return app


@pytest.mark.parametrize("lifespan", [True, False], ids=["lifespan", "no-lifespan"])
@pytest.mark.parametrize(
    ("path", "door"),
    [("/v1/doored", True), ("/v1/doored-sync", True), ("/v1/plain", False), ("/direct", False)],
)
async def test_a_dependencys_refusal_is_released_behind_the_endpoints_door_only(
    store: Store, path: str, door: bool, lifespan: bool
) -> None:
    app = fastapi_service(store)
    async with started(app, lifespan) as client:
        refused = [await client.post(path, headers=KEY) for _ in range(2)]
        answers = [await client.post(path, headers=GOOD) for _ in range(2)]
    assert [a.status_code for a in refused] == [401, 401]
    if door:
        # Released: the key is free, and runs once with the token.
        assert [a.status_code for a in answers] == [201, 201]
        assert answers[1].headers["idempotent-replayed"] == "true"
    else:
        # Nothing FastAPI publishes tells that its dependencies passed (the route's door,
        # where there is one, comes before them): the refusal counts as the endpoint's answer,
        # recorded for the credentials it was given.
        assert refused[1].headers["idempotent-replayed"] == "true"
        assert [a.json()["type"].split(":")[-1] for a in answers] == ["credential-mismatch"] * 2
    assert app.state.runs[path] == (1 if door else 0)


@pytest.mark.parametrize("path", ["/jobs", "/sub/jobs"])
@pytest.mark.parametrize("start", ["lifespan", "install"])
async def test_an_inner_layers_refusal_before_the_routes_door_is_released(
    store: Store, path: str, start: str
) -> None:
    app = starlette_service(store, installed=start == "install")
    async with started(app, lifespan=start == "lifespan") as client:
        refused = await client.post(path, headers=KEY)
        answers = [await client.post(path, headers={**KEY, "x-pass": "yes"}) for _ in range(2)]
    assert refused.status_code == 401
    assert [a.status_code for a in answers] == [201, 201]
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true"]
    assert app.state.runs["/jobs"] == 1


async def test_without_lifespan_or_install_only_idempotent_gives_a_door(store: Store) -> None:
    # Started by neither, a plain route has no door: an inner layer's refusal counts as its
    # endpoint's answer and is recorded; the endpoint that @idempotent wrapped has its own.
    app = starlette_service(store)
    async with started(app, lifespan=False) as client:
        plain = [await client.post("/jobs", headers=KEY) for _ in range(2)]
        doored = await client.post("/doored", headers={"Idempotency-Key": "d"})
        doored_passed = await client.post(
            "/doored", headers={"Idempotency-Key": "d", "x-pass": "yes"}
        )
    assert [a.status_code for a in plain] == [401, 401]
    assert plain[1].headers["idempotent-replayed"] == "true"
    assert doored.status_code == 401
    assert doored_passed.status_code == 201
    assert app.state.runs == Counter({"/doored": 1})


async def test_requests_never_change_the_apps_routes(store: Store) -> None:
    app = fastapi_service(store)
    direct = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/direct")
    before = (direct.app, direct.dependant.call)
    plain = starlette_service(store)
    jobs = next(r for r in plain.routes if isinstance(r, Route))
    jobs_app = jobs.app
    async with started(app, lifespan=False) as client:
        for path in ("/direct", "/v1/plain", "/v1/doored"):
            await client.post(path, headers=GOOD)
    async with started(plain, lifespan=False) as client:
        await client.post("/jobs", headers={**KEY, "x-pass": "yes"})
    assert (direct.app, direct.dependant.call) == before
    assert direct.dependant.call is direct.endpoint
    assert jobs.app is jobs_app


async def test_start_up_gives_each_route_one_door_once(store: Store) -> None:
    app = starlette_service(store, installed=True)  # install() gave the doors already
    for _ in range(2):
        async with LifespanManager(app):
            pass
    jobs, doored = (r for r in app.routes if isinstance(r, Route))
    assert isinstance(jobs.app, RouteDoor)
    assert not isinstance(jobs.app.app, RouteDoor)
    assert not isinstance(doored.app, RouteDoor)  # @idempotent gave it the endpoint's


async def test_idempotent_leaves_a_generator_or_a_class_endpoint_as_it_is(store: Store) -> None:
    # A generator's body runs after the response began, a class is an ASGI app of its own:
    # neither gets the endpoint's door, both the route's.
    runs: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/lines")
    @idempotent()
    async def lines() -> AsyncIterator[dict[str, int]]:
        runs["/lines"] += 1
        yield {"run": runs["/lines"]}

    @idempotent()
    class Jobs(HTTPEndpoint):
        async def post(self, request: Request) -> JSONResponse:
            runs["/jobs"] += 1
            return JSONResponse({"run": runs["/jobs"]}, status_code=201)

    app.router.routes.append(Route("/jobs", Jobs))
    app.add_middleware(IdempotencyMiddleware, store=store)
    async with started(app, lifespan=True) as client:
        answers = {
            path: [await client.post(path, headers={"Idempotency-Key": path}) for _ in range(2)]
            for path in ("/lines", "/jobs")
        }
    for first, again in answers.values():
        assert first.status_code < 300, first.text
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
    assert runs == Counter({"/lines": 1, "/jobs": 1})
