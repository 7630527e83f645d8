"""Start-up and shutdown: a store that is down, the lifespan context, OpenAPI without one."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from idempotency_mw import ConfigurationError, IdempotencyMiddleware, SQLStore, idempotent, install
from idempotency_mw.http.lifespan import store_lifespan
from idempotency_mw.testing import MemoryStore
from tests.conftest import fresh_sql_store
from tests.support.apps import PausableStore, client_for, make_app

pytestmark = pytest.mark.anyio

DEAD_URL = "postgresql://postgres@127.0.0.1:1/test"


async def test_service_starts_while_its_store_is_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = SQLStore(DEAD_URL, operation_timeout=2)
    app = make_app(dead)
    with caplog.at_level(logging.WARNING, "idempotency_mw"):
        async with LifespanManager(app, startup_timeout=10), client_for(app) as client:
            listed = await client.get("/tickets")
            keyless = await client.put("/optional")
            keyed = await client.post("/tickets", json={}, headers={"Idempotency-Key": "k"})
    assert listed.status_code == 200
    assert keyless.status_code == 200
    assert keyed.status_code == 503
    assert keyed.json()["type"].endswith("store-unavailable")
    assert app.state.calls["tickets"] == 0
    assert "unreachable at start-up" in caplog.text


async def test_the_store_is_closed_even_when_the_apps_shutdown_fails(tmp_path: Path) -> None:
    store = PausableStore(await fresh_sql_store(f"sqlite:///{tmp_path / 'i.db'}"))

    @asynccontextmanager
    async def failing_shutdown(app: FastAPI) -> AsyncIterator[None]:
        yield
        raise RuntimeError("the app's own shutdown failed")

    app = FastAPI(lifespan=failing_shutdown)
    app.add_middleware(IdempotencyMiddleware, store=store)
    manager = LifespanManager(app)
    await manager.__aenter__()
    assert store.closed == 0
    with pytest.raises(RuntimeError, match="own shutdown failed"):
        await manager.__aexit__(None, None, None)
    assert store.closed == 1


async def test_store_lifespan_in_the_apps_own_lifespan(tmp_path: Path) -> None:
    store = PausableStore(await fresh_sql_store(f"sqlite:///{tmp_path / 'i.db'}"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with store_lifespan(store, purge=None):
            yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=store, lifespan=False)

    @app.post("/jobs")
    async def job() -> dict[str, bool]:
        return {"ok": True}

    async with LifespanManager(app), client_for(app) as client:
        answers = [await client.post("/jobs", headers={"Idempotency-Key": "j"}) for _ in range(2)]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert store.closed == 1  # once: by the app's lifespan, not again by the middleware


def guarded_app(store: Any, *, use_install: bool) -> FastAPI:
    app = FastAPI()
    if use_install:
        install(app, store=store, mismatch_status=422)
    else:
        app.add_middleware(IdempotencyMiddleware, store=store, mismatch_status=422)

    @app.post("/tickets", status_code=201)
    @idempotent(required=True)
    async def create_ticket() -> dict[str, int]:
        return {"id": 1}

    return app


def assert_documented(schema: dict[str, Any]) -> None:
    operation = schema["paths"]["/tickets"]["post"]
    header = next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")
    assert header["required"] is True
    responses = operation["responses"]
    for status in ("400", "409", "413", "422", "503"):
        assert "application/problem+json" in responses[status]["content"], status
    assert "Idempotent-Replayed" in responses["201"]["headers"]
    assert "IdempotencyProblem" in schema["components"]["schemas"]


def test_install_documents_the_schema_before_any_request(tmp_path: Path) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'i.db'}")
    assert_documented(guarded_app(store, use_install=True).openapi())


async def test_a_client_without_lifespan_sees_the_documented_schema(tmp_path: Path) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'i.db'}")
    # As a TestClient used without `with`: requests, but no lifespan.
    async with client_for(guarded_app(store, use_install=False)) as client:
        assert_documented((await client.get("/openapi.json")).json())


def test_install_refuses_wrong_options_and_adds_nothing() -> None:
    app = FastAPI()
    with pytest.raises(ConfigurationError, match="mismatch_status"):
        install(app, store=MemoryStore(), mismatch_status=418)
    with pytest.raises(ConfigurationError, match=r"unknown settings: \['unknown'\]"):
        install(app, store=MemoryStore(), unknown=1)
    assert app.user_middleware == []
