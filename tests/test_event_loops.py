"""A store used from one event loop after another, as a ``TestClient`` without ``with`` does."""

from __future__ import annotations

import asyncio
import gc
import uuid
import warnings
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from idempotency_mw import IdempotencyMiddleware, RedisStore, SQLStore, Store
from tests.conftest import REDIS_URL, SERVER_DATABASES, fresh_sql_store, require_server

BACKENDS = ["sqlite", "postgresql", "mariadb", "redis"]


def store_of(backend: str, tmp_path: Path) -> Store:
    if backend == "redis":
        require_server(REDIS_URL)
        return RedisStore(REDIS_URL, prefix=f"test-loops-{uuid.uuid4().hex}:")
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'idempotency.db'}"
    else:
        url = SERVER_DATABASES[backend]
        require_server(url)

    async def emptied() -> None:
        await (await fresh_sql_store(url)).aclose()

    asyncio.run(emptied())
    return SQLStore(url)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_test_client_without_with_gets_every_answer(backend: str, tmp_path: Path) -> None:
    runs: list[str] = []
    app = FastAPI()

    @app.post("/tickets", status_code=201)
    async def create_ticket() -> dict[str, int]:
        runs.append("ran")
        return {"id": len(runs)}

    app.add_middleware(IdempotencyMiddleware, store=store_of(backend, tmp_path))

    async def post(app: FastAPI, key: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/tickets", headers={"Idempotency-Key": key})

    # As FastAPI's own testing example does (a TestClient without `with`): each request in an
    # event loop of its own, closed when the request ends. The connections a closed loop
    # leaves can only be dropped, and Python says so when it collects them (a ResourceWarning,
    # silent unless warnings are turned on).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        answers = [asyncio.run(post(app, key)) for key in ("a", "a", "b", "b")]
        assert [answer.status_code for answer in answers] == [201] * 4
        assert [answer.json()["id"] for answer in answers] == [1, 1, 2, 2]
        assert len(runs) == 2
        del app
        gc.collect()
