"""Route resolution in the shapes real services take: routers, sub-apps, hosts, converters."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
from asgi_lifespan import LifespanManager
from fastapi import APIRouter, Depends, FastAPI, Header
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Route

from idempotency_mw import IdempotencyMiddleware, Store, idempotent, install
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for
from tests.support.client_support import FakeTime

pytestmark = pytest.mark.anyio


async def record_count(store: MemoryStore) -> int:
    return sum((await store.record_stats()).by_status.values())


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


async def caller_id(x_caller: str = Header("anon")) -> str:
    return x_caller


def service(store: Store, **options: Any) -> FastAPI:
    """A service built the usual way: nested routers with prefixes and dependencies, a mounted
    FastAPI sub-app, a mounted Starlette app, a host route and path converters."""
    calls: Counter[str] = Counter()

    orders = APIRouter(prefix="/orders", dependencies=[Depends(caller_id)])

    @orders.post("", status_code=201)
    @idempotent(required=True, ttl=0.4, lease=0.2)
    async def create_order() -> dict[str, int]:
        calls["create"] += 1
        return {"run": calls["create"]}

    @orders.put("/{order_id:int}")
    async def replace_order(order_id: int) -> dict[str, int]:
        calls["replace"] += 1
        return {"order": order_id, "run": calls["replace"]}

    @orders.delete("/{order_id:int}")
    async def delete_order(order_id: int) -> dict[str, int]:
        calls["delete"] += 1
        return {"order": order_id, "run": calls["delete"]}

    items = APIRouter()

    @items.post("/items/{item_id}/notes")
    async def add_note(item_id: str) -> dict[str, Any]:
        calls["note"] += 1
        return {"item": item_id, "run": calls["note"]}

    orders.include_router(items, prefix="/{order_id:int}")
    api = APIRouter(prefix="/api")
    api.include_router(orders)

    app = FastAPI()
    app.include_router(api, prefix="/v1")

    sub = FastAPI()

    @sub.post("/refunds")
    @idempotent(required=True)
    async def refund() -> dict[str, int]:
        calls["refund"] += 1
        return {"run": calls["refund"]}

    async def legacy(request: Request) -> JSONResponse:
        calls["legacy"] += 1
        return JSONResponse({"run": calls["legacy"]})

    async def tenant(request: Request) -> JSONResponse:
        calls["tenant"] += 1
        return JSONResponse({"run": calls["tenant"]})

    app.mount("/billing", sub)
    app.mount("/legacy", Starlette(routes=[Route("/jobs", legacy, methods=["POST"])]))
    app.router.routes.append(
        Host("admin.example", Starlette(routes=[Route("/tenants", tenant, methods=["POST"])]))
    )
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    app.state.calls = calls
    return app


async def test_routes_of_included_routers_are_guarded_as_decorated(
    store: Store, fake_time: FakeTime
) -> None:
    app = service(store)
    async with client_for(app) as client:
        missing = await client.post("/v1/api/orders")
        first = await client.post("/v1/api/orders", headers=key("o-1"))
        again = await client.post("/v1/api/orders", headers=key("o-1"))
        fake_time.now += 0.5  # the route's TTL (0.4 s), not the middleware's 24 h
        after_ttl = await client.post("/v1/api/orders", headers=key("o-1"))
    assert missing.status_code == 400
    assert missing.json()["type"].endswith("missing-key")
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in after_ttl.headers
    assert app.state.calls["create"] == 2


async def test_nested_router_template_keeps_every_prefix(store: Store) -> None:
    app = service(
        store, routes={"/v1/api/orders/{order_id}/items/{item_id}/notes": {"required": True}}
    )
    async with client_for(app) as client:
        missing = await client.post("/v1/api/orders/7/items/a/notes")
        first = await client.post("/v1/api/orders/7/items/a/notes", headers=key("n"))
        # Same key, another item: another path under the same template is a mismatch.
        other = await client.post("/v1/api/orders/7/items/b/notes", headers=key("n"))
    assert missing.status_code == 400
    assert first.status_code == 200
    assert other.status_code == 409
    assert app.state.calls["note"] == 1


async def test_mounted_sub_apps_and_host_routes_are_guarded(store: Store) -> None:
    app = service(store, routes={"/legacy/jobs": {"required": True}})
    async with client_for(app) as client:
        refund_missing = await client.post("/billing/refunds")
        refunds = [await client.post("/billing/refunds", headers=key("r")) for _ in range(2)]
        legacy_missing = await client.post("/legacy/jobs")
        jobs = [await client.post("/legacy/jobs", headers=key("j")) for _ in range(2)]
        host = {"host": "admin.example"}
        tenants = [await client.post("/tenants", headers={**key("t"), **host}) for _ in range(2)]
    assert refund_missing.status_code == 400
    assert refunds[1].headers["idempotent-replayed"] == "true"
    assert legacy_missing.status_code == 400
    assert jobs[1].headers["idempotent-replayed"] == "true"
    assert tenants[1].headers["idempotent-replayed"] == "true"
    assert app.state.calls == Counter(refund=1, legacy=1, tenant=1)


async def test_no_route_and_wrong_method_pass_through_unrecorded(store: MemoryStore) -> None:
    app = service(store, required=True)
    async with client_for(app) as client:
        nope = [await client.post("/nope", headers=key("x")) for _ in range(2)]
        # A path converter that does not match (int) is no route either.
        not_int = await client.put("/v1/api/orders/abc", headers=key("y"))
        wrong_method = [await client.patch("/v1/api/orders/1", headers=key("z")) for _ in range(2)]
        unknown_in_mount = await client.post("/billing/nope", headers=key("w"))
        # Required everywhere, but a request that reaches no route is not asked for a key.
        keyless = await client.post("/nope")
    assert [r.status_code for r in nope] == [404, 404]
    assert not any("idempotent-replayed" in r.headers for r in [*nope, *wrong_method])
    assert not_int.status_code == 404
    assert [r.status_code for r in wrong_method] == [405, 405]
    assert unknown_in_mount.status_code == 404
    assert keyless.status_code == 404
    assert await record_count(store) == 0


async def test_routes_mapping_per_method(store: Store, fake_time: FakeTime) -> None:
    app = service(
        store,
        routes={
            "DELETE /v1/api/orders/{order_id}": {"required": True},
            "/v1/api/orders/{order_id}": {"ttl": 0.3, "lease": 0.2},
        },
    )
    async with client_for(app) as client:
        delete_missing = await client.delete("/v1/api/orders/1")
        put_keyless = await client.put("/v1/api/orders/1")
        await client.put("/v1/api/orders/1", headers=key("p"))
        fake_time.now += 0.4
        put_after_ttl = await client.put("/v1/api/orders/1", headers=key("p"))
        deleted = [await client.delete("/v1/api/orders/1", headers=key("d")) for _ in range(2)]
    assert delete_missing.status_code == 400
    assert put_keyless.status_code == 200
    assert "idempotent-replayed" not in put_after_ttl.headers  # the template entry's TTL
    assert deleted[1].headers["idempotent-replayed"] == "true"


async def test_routes_entry_matching_no_route_is_reported_at_startup(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    app = service(
        store,
        routes={"/v1/api/orders": {"ttl": 120}, "/v1/api/typo": {"ttl": 120}, "GET /v1/*": {}},
    )
    with caplog.at_level(logging.WARNING, "idempotency_mw"):
        async with LifespanManager(app):
            pass
    warning = next(r.getMessage() for r in caplog.records if "match no route" in r.getMessage())
    assert "/v1/api/typo" in warning
    assert "GET /v1/*" in warning
    assert "'/v1/api/orders'" not in warning


async def test_routes_added_after_the_first_request_are_resolved(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        before = await client.post("/late", headers=key("l"))

        @app.post("/late")
        @idempotent(required=True)
        async def late() -> dict[str, bool]:
            return {"late": True}

        missing = await client.post("/late")
        first = await client.post("/late", headers=key("l"))
        again = await client.post("/late", headers=key("l"))
    assert before.status_code == 404
    assert missing.status_code == 400
    assert first.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"


async def test_openapi_documents_router_routes(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/v1/api/orders"]["post"]
    header = next(p for p in operation["parameters"] if p["name"] == "Idempotency-Key")
    assert header["required"] is True
    put = schema["paths"]["/v1/api/orders/{order_id}"]["put"]
    assert any(p["name"] == "Idempotency-Key" and not p["required"] for p in put["parameters"])


async def test_resolution_is_cached_per_method_and_path(store: Store) -> None:
    app = service(store)
    middleware = IdempotencyMiddleware(app.router, store=store)
    table = middleware.routes
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/api/orders",
        "root_path": "",
        "headers": [],
    }
    first = table.resolve(app, scope)
    assert first is not None
    assert first.template == "/v1/api/orders"
    assert table.resolve(app, dict(scope)) is first


async def test_settings_merge_field_by_field_across_the_decorator_and_the_mapping() -> None:
    app = FastAPI()
    runs: list[str] = []

    @app.post("/v1/jobs")
    @idempotent(ttl=60)  # sets the TTL only: the mapping still requires the key
    async def start_job() -> dict[str, bool]:
        runs.append("job")
        return {"ok": True}

    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        routes={"/v1/*": {"required": True, "ttl": 5}, "POST /v1/jobs": {"lease": 7}},
    )
    async with client_for(app) as client:
        keyless = await client.post("/v1/jobs")
    assert keyless.status_code == 400
    assert runs == []
    policy = IdempotencyMiddleware(
        app,
        store=MemoryStore(),
        routes={"/v1/*": {"required": True, "ttl": 5}, "POST /v1/jobs": {"lease": 7}},
    ).routes.policy_for("POST", "/v1/jobs", start_job)
    assert policy is not None
    assert (policy["ttl"], policy["required"], policy["lease"]) == (60, True, 7)


def test_a_mounted_fastapi_sub_app_documents_the_key_it_requires() -> None:
    app = FastAPI()
    admin = FastAPI()

    @admin.post("/jobs")
    async def start_job() -> dict[str, bool]:
        return {"ok": True}

    app.mount("/admin", admin)
    install(app, store=MemoryStore(), routes={"/admin/jobs": {"required": True}})
    operation = admin.openapi()["paths"]["/jobs"]["post"]
    headers = {p["name"]: p["required"] for p in operation["parameters"]}
    assert headers["Idempotency-Key"] is True
    assert "application/problem+json" in operation["responses"]["400"]["content"]
