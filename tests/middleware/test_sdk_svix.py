"""The svix SDK against a svix-shaped service behind the middleware, over uvicorn.

svix sends one ``idempotency-key`` per call and retries a timeout, 423 and 5xx, never a 409:
its retry of a call whose first run outlasted its timeout gets 409 ``in-progress`` and raises,
although the message was created. With ``wait=`` the retry waits for the first run's outcome
and gets its replay (docs/client/sdks.md).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from svix.api import MessageIn, SvixAsync, SvixOptions
from svix.exceptions import HttpError

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from tests.support.faults import serve

pytestmark = pytest.mark.anyio


class Messages:
    """``POST /api/v1/app/{app_id}/msg``: the first run is held until the SDK's retry
    arrives (so that it outlasts the SDK's timeout), then creates the message."""

    def __init__(self, **options: Any) -> None:
        self.created: list[dict[str, Any]] = []
        self.attempts = 0
        self.retried = anyio.Event()
        app = FastAPI()
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)

        @app.post("/api/v1/app/{app_id}/msg", status_code=202)
        async def create(app_id: str, message: dict[str, Any]) -> dict[str, Any]:
            if not self.created:
                await self.retried.wait()
            self.created.append(message)
            return {
                "id": f"msg_{len(self.created)}",
                "eventType": message["eventType"],
                "payload": message["payload"],
                "timestamp": datetime.now(UTC).isoformat(),
            }

        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.attempts += 1
            if self.attempts == 2:
                self.retried.set()
        await self.app(scope, receive, send)


async def send_message(url: str) -> Any:
    svix = SvixAsync("testsk_local", SvixOptions(server_url=url, timeout=1.0))
    return await svix.message.create(
        "app_1", MessageIn(event_type="invoice.paid", payload={"invoice": 7})
    )


async def test_without_wait_the_sdks_retry_raises_for_a_message_it_created() -> None:
    service = Messages()
    async with serve(service) as url:
        with pytest.raises(HttpError) as refused:
            await send_message(url)
    assert refused.value.status_code == 409
    assert len(service.created) == 1


async def test_with_wait_the_sdks_retry_gets_the_message() -> None:
    service = Messages(wait=10)
    async with serve(service) as url:
        message = await send_message(url)
    assert (message.id, message.event_type) == ("msg_1", "invoice.paid")
    assert len(service.created) == 1
    assert service.attempts == 2
