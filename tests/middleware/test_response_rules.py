"""What is recorded once a response has begun, and what a replay carries."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from idempotency_mw import IdempotencyMiddleware, Store
from tests.support.apps import client_for, http_scope

pytestmark = pytest.mark.anyio


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


class PathSendResponse(Response):
    """A file sent by path, as Starlette's FileResponse does on servers with the extension
    (from Starlette 0.42 on; the oldest Starlette allowed sends the bytes instead)."""

    def __init__(self, path: Path) -> None:
        super().__init__(media_type="text/plain")
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await send({"type": "http.response.pathsend", "path": str(self.path)})


def app_with(store: Store, tmp_path: Path, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    calls: Counter[str] = Counter()
    app.state.calls = calls
    report = tmp_path / "report.txt"
    report.write_bytes(b"x" * 5000)

    @app.post("/cut")
    async def cut(request: Request) -> StreamingResponse:
        calls["cut"] += 1
        status = int(request.query_params.get("status", "200"))

        async def chunks() -> AsyncIterator[bytes]:
            yield b"first chunk"
            raise RuntimeError("the stream broke after its first chunk")

        return StreamingResponse(chunks(), status_code=status)

    @app.post("/file")
    async def file() -> Response:
        calls["file"] += 1
        return PathSendResponse(report)

    @app.post("/echo-credentials")
    async def echo(request: Request, response: Response) -> dict[str, int]:
        calls["echo"] += 1
        for name in ("authorization", "proxy-authorization", "cookie"):
            response.headers[name] = request.headers.get(name, "")
        response.headers["idempotent-replayed"] = "false"
        return {"run": calls["echo"]}

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        calls["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for index in range(3):
                yield bytes([65 + index]) * 100

        return StreamingResponse(chunks())

    @app.post("/empty", status_code=204, response_class=Response, response_model=None)
    async def empty() -> None:
        calls["empty"] += 1

    return app


async def test_a_response_cut_short_is_never_run_again(store: Store, tmp_path: Path) -> None:
    app = app_with(store, tmp_path)
    async with client_for(app) as client:
        cut_short = await client.post("/cut", headers=key("k"))
        retry = await client.post("/cut", headers=key("k"))
    assert cut_short.status_code == 200
    assert app.state.calls["cut"] == 1
    assert retry.status_code == 409
    assert retry.json()["type"].endswith("not-replayable")


async def test_a_server_error_cut_short_releases_the_key(store: Store, tmp_path: Path) -> None:
    app = app_with(store, tmp_path)
    async with client_for(app) as client:
        answers = [await client.post("/cut?status=500", headers=key("k")) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [500, 500]
    assert app.state.calls["cut"] == 2


async def call(app: FastAPI, path: str, extensions: dict[str, Any]) -> list[Message]:
    """One request to the ASGI app as a server with ``extensions`` would make it."""
    sent: list[Message] = []
    scope = http_scope(path, [(b"idempotency-key", b"file-key")], extensions)
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


async def test_a_file_sent_by_path_is_never_run_again(store: Store, tmp_path: Path) -> None:
    app = app_with(store, tmp_path)
    extensions: dict[str, dict[str, Any]] = {"http.response.pathsend": {}}
    first = await call(app, "/file", extensions)
    retries = [await call(app, "/file", extensions) for _ in range(2)]
    assert [m["type"] for m in first] == ["http.response.start", "http.response.pathsend"]
    assert app.state.calls["file"] == 1
    for retry in retries:
        assert retry[0]["status"] == 409
        assert b"not-replayable" in retry[1]["body"]


async def test_a_replay_is_marked_once_and_carries_no_credentials(
    store: Store, tmp_path: Path
) -> None:
    app = app_with(store, tmp_path)
    credentials = {"Authorization": "Bearer s3cret", "Cookie": "sid=1"}
    async with client_for(app) as client:
        first = await client.post("/echo-credentials", headers={**key("k"), **credentials})
        again = await client.post("/echo-credentials", headers={**key("k"), **credentials})
    assert first.headers["authorization"] == "Bearer s3cret"
    assert again.headers.get_list("idempotent-replayed") == ["true"]
    for name in ("authorization", "proxy-authorization", "cookie"):
        assert name not in again.headers
    assert app.state.calls["echo"] == 1


async def test_a_replay_carries_its_content_length(store: Store, tmp_path: Path) -> None:
    app = app_with(store, tmp_path)
    async with client_for(app) as client:
        first = await client.post("/stream", headers=key("s"))
        again = await client.post("/stream", headers=key("s"))
        await client.post("/empty", headers=key("e"))
        empty = await client.post("/empty", headers=key("e"))
    assert "content-length" not in first.headers  # streamed
    assert again.headers["content-length"] == "300"
    assert again.content == first.content
    assert empty.status_code == 204
    assert empty.headers["idempotent-replayed"] == "true"
    assert "content-length" not in empty.headers
