"""Where the endpoint begins: the doors ``@idempotent`` and the middleware (before the app's
first request) give routes, the same answers whichever way the app is run (its lifespan or
none: a ``TestClient`` with or without ``with``, an ``httpx.ASGITransport``, uvicorn), and
what a route without a door records."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, Store, idempotent, install
from idempotency_mw.http.door import RouteDoor
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for, started
from tests.support.faults import serve

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
    """A layer inside the middleware that answers 401 by itself, unless the request has a pass
    (the header ``needed``)."""

    def __init__(self, app: ASGIApp, needed: tuple[bytes, bytes] = (b"x-pass", b"yes")) -> None:
        self.app = app
        self.needed = needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.needed not in scope["headers"]:
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
@pytest.mark.parametrize("start", ["lifespan", "install", "first-request"])
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


def signed_service(store: Store) -> FastAPI:
    """FastAPI's tutorial shape: ``/orders`` undecorated behind a layer that signs callers in,
    ``/v1/orders`` marked ``@idempotent`` behind an auth dependency."""
    runs: Counter[str] = Counter()
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @app.post("/orders", status_code=201)
    async def orders() -> dict[str, int]:
        runs["/orders"] += 1
        return {"run": runs["/orders"]}

    @router.post("/orders", status_code=201)
    @idempotent()
    async def doored_orders(user: str = Depends(signed_in)) -> dict[str, int]:
        runs["/v1/orders"] += 1
        return {"run": runs["/v1/orders"]}

    app.include_router(router)
    app.add_middleware(Guard, needed=(b"authorization", b"Bearer good"))
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.state.runs = runs
    return app


SIGNED_PATHS = ["/orders", "/v1/orders"]


class Answer(Protocol):
    """A response of httpx's or of the one ``TestClient`` is built on."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def text(self) -> str: ...


def assert_the_signed_retry_ran(
    app: FastAPI, path: str, refused: Answer, answers: Sequence[Answer]
) -> None:
    """The refusal before the endpoint released its key: the signed retry ran, once."""
    assert refused.status_code == 401
    assert [a.status_code for a in answers] == [201, 201], answers[0].text
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true"]
    assert app.state.runs[path] == 1


@pytest.mark.parametrize("path", SIGNED_PATHS)
@pytest.mark.parametrize("entered", [True, False], ids=["with", "without-with"])
def test_a_refusal_before_the_endpoint_is_released_under_testclient(
    path: str, entered: bool
) -> None:
    # FastAPI's testing tutorial writes `client = TestClient(app)`: no `with`, no lifespan.
    app = signed_service(MemoryStore())
    client = TestClient(app)
    with client if entered else contextlib.nullcontext(client):
        refused = client.post(path, headers=KEY)
        answers = [client.post(path, headers=GOOD) for _ in range(2)]
    assert_the_signed_retry_ran(app, path, refused, answers)


@pytest.mark.parametrize("path", SIGNED_PATHS)
@pytest.mark.parametrize("server", ["asgi-transport", "uvicorn"])
async def test_a_refusal_before_the_endpoint_is_released_in_process_and_served(
    store: Store, path: str, server: str
) -> None:
    app = signed_service(store)
    async with contextlib.AsyncExitStack() as stack:
        if server == "uvicorn":
            url = await stack.enter_async_context(serve(app))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
        else:
            client = await stack.enter_async_context(client_for(app))
        refused = await client.post(path, headers=KEY)
        answers = [await client.post(path, headers=GOOD) for _ in range(2)]
    assert_the_signed_retry_ran(app, path, refused, answers)


async def test_doors_are_placed_once_before_the_first_request_and_never_after(
    store: Store,
) -> None:
    app = fastapi_service(store)
    direct = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/direct")
    plain = starlette_service(store)
    jobs = next(r for r in plain.routes if isinstance(r, Route))
    async with started(app, lifespan=False) as client, started(plain, False) as plain_client:
        await client.post("/direct", headers=GOOD)
        await plain_client.post("/jobs", headers={**KEY, "x-pass": "yes"})
        placed = (direct.app, direct.dependant.call, jobs.app)
        for path in ("/direct", "/v1/plain", "/v1/doored"):
            await client.post(path, headers={**GOOD, "Idempotency-Key": path})
        await plain_client.post("/jobs", headers={"Idempotency-Key": "again", "x-pass": "yes"})
    assert isinstance(direct.app, RouteDoor)
    assert isinstance(jobs.app, RouteDoor)
    assert (direct.app, direct.dependant.call, jobs.app) == placed
    assert direct.dependant.call is direct.endpoint  # FastAPI's own call, never rewritten


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
