"""Apps as users write them, each behind the middleware, for ``tests/middleware/test_real_apps.py``.

Each factory is run by uvicorn (``uvicorn --factory tests.support.real_apps:<name>``) with
``REAL_APPS_STORE``, the URL of a SQLite file that every worker shares, and
``REAL_APPS_EFFECTS``, the file handlers log their runs to
(:class:`~tests.support.reliability_app.Effects`, one row per run, by route and key). Every app
answers ``GET /health``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from litestar import Litestar, get, post
from litestar import Request as LitestarRequest
from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp as LitestarASGIApp
from pydantic import BaseModel
from sqlalchemy import Column, Integer, MetaData, String, Table
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from starlette.types import ASGIApp, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, SQLStore, fence, idempotent
from tests.support.reliability_app import Effects

KEY = "idempotency-key"
#: The bearer tokens the apps know, and whose they are.
USERS = {"alice-token": "alice", "bob-token": "bob"}


def _store() -> SQLStore:
    return SQLStore(os.environ["REAL_APPS_STORE"], operation_timeout=2)


def _effects() -> Effects:
    return Effects(os.environ["REAL_APPS_EFFECTS"])


def _health(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}


class Order(BaseModel):
    amount: int


async def authenticated(authorization: str | None = Header(None)) -> str:
    """An auth dependency: the caller's name, or FastAPI's own 401."""
    user = USERS.get((authorization or "").removeprefix("Bearer "))
    if user is None:
        raise HTTPException(401, "bad token", headers={"WWW-Authenticate": "Bearer"})
    return user


def fastapi_refusals() -> Any:
    """Handlers that act and then refuse, refusals that come before the endpoint, on an
    APIRouter included with prefixes and on a mounted sub-app."""
    effects = _effects()
    router = APIRouter(prefix="/v1")

    @router.post("/rows")
    async def add_row(request: Request) -> JSONResponse:
        await effects.alog("rows", request.headers[KEY], "done")
        return JSONResponse({"detail": "limit exceeded"}, status_code=403)

    @router.post("/charges")
    async def charge(request: Request) -> JSONResponse:
        await effects.alog("charges", request.headers[KEY], "done")
        return JSONResponse({"error": "card declined"}, status_code=422)

    @router.post("/sync-rows")
    def add_row_sync(request: Request) -> JSONResponse:
        effects.log("sync-rows", request.headers[KEY], "done")
        return JSONResponse({"detail": "limit exceeded"}, status_code=403)

    @router.post("/orders", status_code=201)
    async def create_order(order: Order, request: Request) -> dict[str, int]:
        await effects.alog("orders", request.headers[KEY], "done")
        return {"amount": order.amount}

    @router.post("/authed", status_code=201)
    @idempotent()  # its endpoint's door: the dependency's refusal comes before it
    async def authed(request: Request, user: str = Depends(authenticated)) -> dict[str, str]:
        await effects.alog("authed", request.headers[KEY], "done")
        return {"user": user}

    @router.post("/released")
    @idempotent(release_statuses=[403])
    async def released(request: Request) -> JSONResponse:
        await effects.alog("released", request.headers[KEY], "done")
        return JSONResponse({"detail": "not yet"}, status_code=403)

    sub = FastAPI()

    @sub.post("/rows")
    async def sub_row(request: Request) -> JSONResponse:
        await effects.alog("sub-rows", request.headers[KEY], "done")
        return JSONResponse({"detail": "limit exceeded"}, status_code=403)

    app = FastAPI()
    app.include_router(router, prefix="/api")
    app.mount("/sub", sub)
    _health(app)
    app.add_middleware(IdempotencyMiddleware, store=_store())
    return app


def fastapi_scoped() -> Any:
    """``@idempotent(scope=Depends(authenticated))``: the app's own auth is the keys' scope."""
    effects = _effects()
    app = FastAPI()

    @app.post("/notes", status_code=201)
    @idempotent(scope=Depends(authenticated))
    async def create_note(request: Request) -> dict[str, int]:
        run = await effects.alog("notes", request.headers.get(KEY, ""), "done")
        return {"run": run}

    @app.post("/whoami")
    async def whoami(user: str = Depends(authenticated)) -> dict[str, str]:
        return {"user": user}

    _health(app)
    app.add_middleware(IdempotencyMiddleware, store=_store())
    return app


fenced_rows = Table(
    "fenced_rows",
    MetaData(),
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idem_key", String(100), nullable=False),
)


def fastapi_fail_open() -> Any:
    """``fail_open=True`` with a store nobody listens for, and a route that calls fence()."""
    effects = _effects()
    engine = create_async_engine(os.environ["REAL_APPS_EFFECTS_URL"])
    app = FastAPI()

    @app.post("/fenced", status_code=201)
    async def fenced(request: Request) -> dict[str, str]:
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(fenced_rows.insert().values(idem_key=request.headers[KEY]))
            await fence(session)
        await effects.alog("fenced", request.headers[KEY], "done")
        return {"ran": "unprotected"}

    _health(app)
    dead = SQLStore(os.environ["REAL_APPS_DEAD_STORE"], operation_timeout=1)
    app.add_middleware(IdempotencyMiddleware, store=dead, fail_open=True)
    return app


def _litestar_handlers() -> list[Any]:
    effects = _effects()

    @post("/orders", status_code=201)
    async def create_order(request: LitestarRequest[Any, Any, Any]) -> dict[str, int]:
        run = await effects.alog("orders", request.headers.get(KEY, ""), "done")
        return {"run": run, "amount": (await request.json())["amount"]}

    @post("/typed-orders", status_code=201)
    async def create_typed_order(
        request: LitestarRequest[Any, Any, Any], data: dict[str, int]
    ) -> dict[str, int]:
        # Litestar validates ``data`` before this runs: a 400 when it is not a dict of ints.
        run = await effects.alog("typed-orders", request.headers.get(KEY, ""), "done")
        return {"run": run, **data}

    @post("/public/ping", status_code=201)
    async def ping() -> dict[str, bool]:
        return {"pong": True}

    @get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return [create_order, create_typed_order, ping, health]


#: Optional keys under /public/, required everywhere else: the routes= globs on paths.
_LITESTAR_ROUTES: dict[str, Any] = {"/public/*": {"required": False}}


def litestar_wrapped() -> Any:
    """``IdempotencyMiddleware(Litestar([...]), ...)``."""
    # Litestar types its ASGI callable with its own scope and event TypedDicts, Starlette's
    # (the middleware's) with mappings: the same protocol, not the same types.
    app = cast(ASGIApp, Litestar(_litestar_handlers()))
    return IdempotencyMiddleware(app, store=_store(), required=True, routes=_LITESTAR_ROUTES)


def litestar_defined() -> Any:
    """Litestar's own ``DefineMiddleware(IdempotencyMiddleware, ...)``."""
    # The middleware is a Starlette-typed ASGI app, Litestar wants its own types: see above.
    middleware = cast(Callable[..., LitestarASGIApp], IdempotencyMiddleware)
    return Litestar(
        _litestar_handlers(),
        middleware=[
            DefineMiddleware(middleware, store=_store(), required=True, routes=_LITESTAR_ROUTES)
        ],
    )


def bare_asgi() -> Any:
    """A bare ASGI callable: ``POST /orders`` logs a run, ``POST /public/ping`` does nothing."""
    effects = _effects()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, answer = 200, b'{"ok": true}'
        if scope["method"] == "POST" and scope["path"] == "/orders":
            headers = dict(scope["headers"])
            run = await effects.alog("orders", headers.get(KEY.encode(), b"").decode(), "done")
            status, answer = 201, b'{"run": %d}' % run
        elif scope["method"] == "POST" and scope["path"] == "/public/ping":
            status = 201
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    return IdempotencyMiddleware(app, store=_store(), required=True, routes=_LITESTAR_ROUTES)
