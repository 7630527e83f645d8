"""``max_request_bytes`` per route: an upload route takes keyed bodies over the middleware's
limit, the app's other routes keep it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request

from idempotency_mw import IdempotencyMiddleware, idempotent
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for

pytestmark = pytest.mark.anyio

BIG = b"x" * (2 << 20)  # 2 MiB: over the middleware's default of 1 MiB


def service(**middleware: Any) -> FastAPI:
    app = FastAPI()

    @app.post("/uploads")
    @idempotent(max_request_bytes=4 << 20)
    async def upload(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    @app.post("/imports")
    async def imports(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    @app.post("/notes")
    async def notes(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **middleware)
    return app


async def test_a_route_raises_its_own_limit_and_the_others_keep_the_default() -> None:
    app = service(routes={"/imports": {"max_request_bytes": 3 << 20}})
    async with client_for(app) as client:
        uploaded = await client.post("/uploads", content=BIG, headers={"Idempotency-Key": "u"})
        again = await client.post("/uploads", content=BIG, headers={"Idempotency-Key": "u"})
        imported = await client.post("/imports", content=BIG, headers={"Idempotency-Key": "i"})
        refused = await client.post("/notes", content=BIG, headers={"Idempotency-Key": "n"})
    assert uploaded.status_code == 200
    assert uploaded.json() == {"size": len(BIG)}
    assert again.headers["idempotent-replayed"] == "true"
    assert imported.json() == {"size": len(BIG)}
    assert refused.status_code == 413
    assert "1048576 bytes" in refused.json()["detail"]


async def test_a_route_may_lower_the_limit_below_the_default() -> None:
    app = service(routes={"/notes": {"max_request_bytes": 10}})
    async with client_for(app) as client:
        refused = await client.post("/notes", content=b"x" * 11, headers={"Idempotency-Key": "n"})
        fits = await client.post("/imports", content=b"x" * 11, headers={"Idempotency-Key": "i"})
    assert refused.status_code == 413
    assert "10 bytes" in refused.json()["detail"]
    assert fits.status_code == 200
