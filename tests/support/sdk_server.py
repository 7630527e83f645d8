"""An OpenAI-shaped file upload service, and a layer that notes what the server answered.

For the tests that drive the real openai SDK (its retries, its multipart uploads) against
uvicorn: ``POST /v1/files`` stores each upload it runs in ``runs`` and answers a file object.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Form, UploadFile

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore

#: What an upload runs before it answers, given its run's number (from 1) and its content.
Before = Callable[[int, bytes], Awaitable[None]]


async def _at_once(number: int, content: bytes) -> None:
    return None


def file_service(runs: list[bytes], before: Before = _at_once, **options: Any) -> FastAPI:
    """The service, behind the middleware (on a MemoryStore of its own)."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)

    @app.post("/v1/files")
    async def create_file(file: UploadFile, purpose: str = Form()) -> dict[str, Any]:
        content = await file.read()
        runs.append(content)
        number = len(runs)
        await before(number, content)
        return {
            "id": f"file-{number}",
            "object": "file",
            "bytes": len(content),
            "created_at": 0,
            "filename": file.filename,
            "purpose": purpose,
            "status": "processed",
        }

    return app


class Answers:
    """The statuses the server sent, in order; ``conflict`` is set at the first 409."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.conflict = anyio.Event()

    def around(self, app: FastAPI) -> Callable[..., Awaitable[None]]:
        """``app`` behind a layer that notes the status of each answer."""

        async def outer(scope: Any, receive: Any, send: Any) -> None:
            async def noted(message: Any) -> None:
                if message["type"] == "http.response.start":
                    self.statuses.append(message["status"])
                    if message["status"] == 409:
                        self.conflict.set()
                await send(message)

            await app(scope, receive, noted if scope["type"] == "http" else send)

        return outer
