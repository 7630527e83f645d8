"""A FastAPI app with one route per behaviour under test, and a client for it."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from starlette.applications import Starlette

from idempotency_mw import IdempotencyMiddleware, Store, StoreError, idempotent


class Gate:
    """Holds a handler until the test opens it."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.opened = anyio.Event()


def make_app(store: Store, **options: Any) -> FastAPI:
    """An app whose handlers count their runs in ``app.state.calls``."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    calls: Counter[str] = Counter()
    app.state.calls = calls
    app.state.gate = Gate()
    app.state.hold_seconds = 0.0

    @app.post("/tickets", status_code=201)
    @idempotent(required=True)
    async def create_ticket(request: Request, response: Response) -> dict[str, Any]:
        calls["tickets"] += 1
        response.headers["x-ticket"] = str(calls["tickets"])
        response.set_cookie("session", "secret")
        return {"id": calls["tickets"], "body": (await request.body()).decode()}

    @app.post("/tickets/{ticket_id}/close")
    async def close_ticket(ticket_id: int) -> dict[str, int]:
        calls["close"] += 1
        return {"closed": ticket_id, "run": calls["close"]}

    @app.put("/optional")
    async def optional_key() -> dict[str, int]:
        calls["optional"] += 1
        return {"run": calls["optional"]}

    @app.get("/tickets")
    async def list_tickets() -> dict[str, int]:
        calls["list"] += 1
        return {"run": calls["list"]}

    @app.post("/short-ttl")
    @idempotent(ttl=0.3, lease=0.2)
    async def short_ttl() -> dict[str, int]:
        calls["short-ttl"] += 1
        return {"run": calls["short-ttl"]}

    @app.post("/held")
    async def held() -> dict[str, int]:
        calls["held"] += 1
        gate: Gate = app.state.gate
        gate.entered.set()
        await gate.opened.wait()
        return {"run": calls["held"]}

    @app.post("/slow")
    async def slow() -> dict[str, int]:
        calls["slow"] += 1
        await anyio.sleep(app.state.hold_seconds)
        return {"run": calls["slow"]}

    @app.post("/boom")
    async def boom() -> None:
        calls["boom"] += 1
        raise RuntimeError("handler failed")

    @app.post("/server-error")
    async def server_error() -> Response:
        calls["server-error"] += 1
        return Response(b"try again", status_code=503)

    @app.post("/stream")
    async def stream(request: Request) -> StreamingResponse:
        calls["stream"] += 1
        size = int(request.query_params.get("size", "3"))

        async def chunks() -> AsyncIterator[bytes]:
            for index in range(size):
                yield bytes([index % 256]) * 1000

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    @app.websocket("/ws")
    async def websocket(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("hello")
        await socket.close()

    return app


def http_scope(
    path: str, headers: list[tuple[bytes, bytes]], extensions: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The scope of a POST to ``path`` as an HTTP/1.1 server makes it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), *headers],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
        "extensions": extensions or {},
    }


def client_for(app: Starlette) -> httpx.AsyncClient:
    """An httpx client that calls the app in process."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


@asynccontextmanager
async def started(app: Any, lifespan: bool) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app``, run with its lifespan or, as many test clients do, without."""
    if lifespan:
        async with LifespanManager(app), client_for(app) as client:
            yield client
    else:
        async with client_for(app) as client:
            yield client


class PausableStore:
    """A real store behind switches: a paused operation waits, as on a stopped server; a failing
    one raises StoreError, as on a broken one. Without arguments, pause and fail take every
    operation.

    It also counts ``aclose`` calls, so tests can see that the store was closed, and passes
    whatever else is asked of it (``fence_statement``, ``url``) to the real store.
    """

    OPERATIONS = frozenset({"claim", "renew", "complete", "release", "purge", "startup"})

    def __init__(self, store: Store) -> None:
        self.inner = store
        self.closed = 0
        self.reached: Counter[str] = Counter()
        self.failing: frozenset[str] = frozenset()
        self._paused: frozenset[str] = frozenset()
        self._resumed = anyio.Event()
        #: Set once a claim has answered (its lease runs from before then).
        self.claimed = anyio.Event()
        #: Each operation's, set once a call of it waits at the pause.
        self.blocked: dict[str, anyio.Event] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def pause(self, *operations: str) -> None:
        self._paused = frozenset(operations) or self.OPERATIONS
        self._resumed = anyio.Event()

    def resume(self) -> None:
        self._paused = frozenset()
        self._resumed.set()

    def fail(self, *operations: str) -> None:
        self.failing = frozenset(operations) or self.OPERATIONS

    def blocked_at(self, operation: str) -> anyio.Event:
        """Set once a call of ``operation`` waits at the pause."""
        return self.blocked.setdefault(operation, anyio.Event())

    async def _gate(self, operation: str) -> None:
        while operation in self._paused:
            self.blocked_at(operation).set()
            await self._resumed.wait()
        if operation in self.failing:
            raise StoreError(f"{operation} failed: the test broke the store")
        self.reached[operation] += 1

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        await self._gate("claim")
        claim = await self.inner.claim(*args, **kwargs)
        self.claimed.set()
        return claim

    async def renew(self, *args: Any, **kwargs: Any) -> Any:
        await self._gate("renew")
        return await self.inner.renew(*args, **kwargs)

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        await self._gate("complete")
        return await self.inner.complete(*args, **kwargs)

    async def release(self, *args: Any, **kwargs: Any) -> Any:
        await self._gate("release")
        return await self.inner.release(*args, **kwargs)

    async def purge_expired(self, *, batch_size: int) -> int | None:
        await self._gate("purge")
        return await self.inner.purge_expired(batch_size=batch_size)

    async def startup(self) -> None:
        await self._gate("startup")
        await self.inner.startup()

    async def aclose(self) -> None:
        self.closed += 1
        await self.inner.aclose()


async def taken_over(
    app: FastAPI,
    store: PausableStore,
    send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]],
) -> tuple[httpx.Response, httpx.Response]:
    """The first and the retry's answers, when the first request (its handler delayed by
    ``app.state.delay``) has its renewals stall past its lease, and a retry sent meanwhile,
    without the delay, takes its key over."""
    answers: dict[str, httpx.Response] = {}
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def first() -> None:
            answers["first"] = await send(client)

        group.start_soon(first)
        # Its renewals stall from its claim on (a claim slow enough to need a renewal before
        # the work starts gets it), and its lease runs from then, however late a busy machine
        # sent it.
        with anyio.fail_after(10):
            await store.claimed.wait()
        store.pause("renew")
        await anyio.sleep(0.6)
        app.state.delay = 0.0
        answers["retry"] = await send(client)
        # Before the first request's end is awaited: whatever it still asks the store answers.
        store.resume()
    return answers["first"], answers["retry"]
