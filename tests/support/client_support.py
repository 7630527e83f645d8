"""What the client tests share: a real app behind the real middleware, transports that inject
faults, fake time, and clients wired to them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idempotency_mw import IdempotencyMiddleware, SQLStore
from idempotency_mw.client import IdempotentClient, RetryPolicy
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import metadata

BASE_URL = "http://testserver"
SERVER_RETRY_AFTER = 7
#: No jitter, so that the only non-zero waits in a test are the ones a server asked for.
NO_JITTER = RetryPolicy(backoff_base=0.0)


class Crash(BaseException):
    """The caller's process dying mid-request (not an Exception: nothing may handle it)."""


class FakeTime:
    """An injectable clock whose sleeps return at once and move the clock forward."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleep_sync(seconds)

    def sleep_sync(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


# --- A real app behind the real middleware ---------------------------------------------------


class Server:
    """A Starlette app behind IdempotencyMiddleware; ``calls`` counts handler runs."""

    def __init__(self, store: SQLStore, **options: Any) -> None:
        self.calls: Counter[str] = Counter()
        self.created: list[dict[str, Any]] = []
        self.entered = anyio.Event()
        self.opened = anyio.Event()
        self.app = Starlette(
            routes=[
                Route("/tickets", self.tickets, methods=["POST"]),
                Route("/tickets", self.find_tickets, methods=["GET"]),
                Route("/held", self.held, methods=["POST"]),
                Route("/big", self.big, methods=["POST"]),
                Route("/invalid", self.invalid, methods=["POST"]),
            ],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    store=store,
                    retry_after=SERVER_RETRY_AFTER,
                    max_response_bytes=1000,
                    **options,
                )
            ],
        )

    async def tickets(self, request: Request) -> Response:
        self.calls["tickets"] += 1
        ticket = {"id": self.calls["tickets"], **await request.json()}
        self.created.append(ticket)
        return JSONResponse(ticket, 201)

    async def find_tickets(self, request: Request) -> Response:
        ref = request.query_params.get("ref")
        return JSONResponse([ticket for ticket in self.created if ticket.get("ref") == ref])

    async def held(self, request: Request) -> Response:
        self.calls["held"] += 1
        self.entered.set()
        await self.opened.wait()
        return JSONResponse({"id": self.calls["held"]}, 201)

    async def big(self, request: Request) -> Response:
        self.calls["big"] += 1
        return Response(b"x" * 5000, 201)

    async def invalid(self, request: Request) -> Response:
        self.calls["invalid"] += 1
        return JSONResponse({"error": "no"}, 400)


class Faulty(httpx.AsyncBaseTransport):
    """Forwards to the app, applying one planned fault per request (then ``default``).

    ``drop``: fail to connect, so the app never sees the request; ``vanish``: the request is
    lost after it was sent, before the app saw it, and the caller times out; ``lose``: the app
    runs, its response is lost to a read timeout; ``detach``: the response is lost once the
    handler has started (it goes on in ``task_group``, and sets ``handler_entered``); ``crash``:
    the app runs, then the caller dies. Every request moves the fake clock by ``tick`` seconds.
    """

    def __init__(
        self,
        app: Starlette,
        plan: list[str] | None = None,
        *,
        default: str = "ok",
        time: FakeTime | None = None,
        tick: float = 0.0,
    ) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.plan = list(plan or [])
        self.default = default
        self.time = time
        self.tick = tick
        self.requests: list[httpx.Request] = []
        self.task_group: TaskGroup | None = None
        self.handler_entered: anyio.Event | None = None
        self.detached_done = anyio.Event()

    @property
    def keys(self) -> list[str]:
        return [request.headers["idempotency-key"] for request in self.requests]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.time is not None:
            self.time.now += self.tick
        fault = self.plan.pop(0) if self.plan else self.default
        if fault == "drop":
            raise httpx.ConnectError("connection refused", request=request)
        if fault == "vanish":
            raise httpx.ReadTimeout("read timed out", request=request)
        if fault == "detach":
            assert self.task_group is not None
            assert self.handler_entered is not None
            self.task_group.start_soon(self._forward_detached, request)
            await self.handler_entered.wait()
            raise httpx.ReadTimeout("read timed out", request=request)
        response = await self.inner.handle_async_request(request)
        await response.aread()
        if fault == "lose":
            raise httpx.ReadTimeout("read timed out", request=request)
        if fault == "crash":
            raise Crash
        return response

    async def _forward_detached(self, request: httpx.Request) -> None:
        response = await self.inner.handle_async_request(request)
        await response.aread()
        self.detached_done.set()


async def sqlite_store_at(path: Path) -> SQLStore:
    """A SQLStore on a fresh SQLite file at ``path``."""
    url = f"sqlite:///{path}"
    engine = create_async_engine(async_url(url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    await engine.dispose()
    return SQLStore(url)


def make_client(
    transport: httpx.AsyncBaseTransport,
    journal: Any,
    fake_time: FakeTime,
    policy: RetryPolicy = NO_JITTER,
    **options: Any,
) -> IdempotentClient:
    return IdempotentClient(
        http=httpx.AsyncClient(transport=transport, base_url=BASE_URL),
        journal=journal,
        policy=policy,
        sleep=fake_time.sleep,
        clock=fake_time.clock,
        **options,
    )


async def close(client: IdempotentClient) -> None:
    """Close a client made by make_client (its httpx client is the test's to close)."""
    await client.aclose()
    await client._http.aclose()


def scripted(*outcomes: httpx.Response | Exception) -> tuple[httpx.MockTransport, list[str]]:
    """A transport answering with ``outcomes`` in turn, then 201; and the keys it saw."""
    pending = list(outcomes)
    keys: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["idempotency-key"])
        outcome = pending.pop(0) if pending else httpx.Response(201, json={"ok": True})
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return httpx.MockTransport(handle), keys


def problem(status: int, slug: str, **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        headers={"content-type": "application/problem+json", **headers},
        json={"type": f"urn:idempotency-mw:problem:{slug}", "status": status},
    )
