"""The middleware's behaviour end to end, on every store."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from starlette.types import Message

from idempotency_mw import ConfigurationError, IdempotencyMiddleware, SchemaError, SQLStore, Store
from idempotency_mw.engine.fingerprint import request_fingerprint
from idempotency_mw.http._asgi import parse_key
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for, http_scope, make_app
from tests.support.client_support import FakeTime
from tests.support.garbage import garbage_of_ours

pytestmark = pytest.mark.anyio

PROBLEM = "application/problem+json"


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value}


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == response.status_code
    assert body["title"]
    assert body["detail"]
    return str(body["type"])


async def test_first_request_runs_and_repeat_replays_byte_for_byte(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        first = await client.post("/tickets", json={"t": 1}, headers=key("abc"))
        again = await client.post("/tickets", json={"t": 1}, headers=key("abc"))
    assert first.status_code == 201
    assert app.state.calls["tickets"] == 1
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert again.headers["x-ticket"] == first.headers["x-ticket"] == "1"
    assert again.headers["content-type"] == first.headers["content-type"]
    # Credentials are not part of the record.
    assert "set-cookie" in first.headers
    assert "set-cookie" not in again.headers


async def test_header_deny_and_allow_lists(store: Store) -> None:
    keep_all = make_app(store, replay_headers_deny=())
    async with client_for(keep_all) as client:
        await client.post("/tickets", json={}, headers=key("deny"))
        again = await client.post("/tickets", json={}, headers=key("deny"))
    assert "set-cookie" in again.headers

    only_ticket = make_app(store, replay_headers_allow=["x-ticket"])
    async with client_for(only_ticket) as client:
        await client.post("/tickets", json={}, headers=key("allow"))
        again = await client.post("/tickets", json={}, headers=key("allow"))
    assert again.headers["x-ticket"] == "1"
    assert "set-cookie" not in again.headers
    assert "content-type" not in again.headers


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
async def test_safe_methods_pass_through_with_a_key(store: Store, method: str) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        for _ in range(2):
            response = await client.request(method, "/tickets", headers=key("abc"))
            assert "idempotent-replayed" not in response.headers
    if method == "GET":
        assert app.state.calls["list"] == 2


async def test_optional_route_without_key_runs_every_time(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        for _ in range(2):
            assert (await client.put("/optional")).status_code == 200
    assert app.state.calls["optional"] == 2


async def test_websocket_passes_through(store: Store) -> None:
    app = make_app(store)
    incoming: list[Message] = [
        {"type": "websocket.connect"},
        {"type": "websocket.disconnect", "code": 1000},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "websocket",
        "asgi": {"version": "3.0"},
        "path": "/ws",
        "raw_path": b"/ws",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k")],
        "scheme": "ws",
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
        "subprotocols": [],
    }
    await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["websocket.accept", "websocket.send", "websocket.close"]
    assert sent[1]["text"] == "hello"


async def test_lifespan_passes_through_to_the_app(store: Store) -> None:
    app = make_app(store)
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        events.append("startup")
        yield
        events.append("shutdown")

    app.router.lifespan_context = lifespan
    async with LifespanManager(app):
        assert events == ["startup"]
    assert events == ["startup", "shutdown"]


@pytest.mark.parametrize(
    "raw",
    [
        "",
        " ",
        "a b",
        "\u00e9t\u00e9",
        "x" * 256,
        "tab\there",
        '"unterminated',
        '"bad\\escape"',
        '""',
    ],
)
async def test_invalid_keys_are_400_problems(store: Store, raw: str) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        headers = [(b"Idempotency-Key", raw.encode("latin-1", "replace"))]
        response = await client.post("/tickets", json={}, headers=headers)
    assert response.status_code == 400
    assert problem_type(response).endswith("invalid-key")
    assert app.state.calls["tickets"] == 0


async def test_two_key_headers_are_rejected(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
        response = await client.post("/tickets", json={}, headers=headers)
    assert response.status_code == 400
    assert problem_type(response).endswith("invalid-key")


def test_the_request_fingerprint_stays_the_one_stored_records_hold() -> None:
    # Records stored before an upgrade hold this digest: another would make their repeats
    # mismatches.
    fingerprint = request_fingerprint(
        "POST",
        "/orders/{id}",
        "/orders/7",
        b"a=1&b=2",
        [("x-tenant", "acme"), ("x-tenant", "beta")],
        b'{"sku": "A-1"}',
    )
    assert fingerprint == "697d7ffa7014251105f92cdb2d2c112d3901085ffd0aa06c7820d4d3b109a7cc"


def test_key_parsing() -> None:
    assert parse_key("abc") == "abc"
    assert parse_key("x" * 255) == "x" * 255
    assert parse_key('"abc"') == "abc"
    assert parse_key('"a b\\"c\\\\"') == 'a b"c\\'
    assert parse_key("x" * 256) is None
    assert parse_key("a b") is None


async def test_quoted_key_is_the_same_key(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        await client.post("/tickets", json={}, headers=key("same"))
        again = await client.post("/tickets", json={}, headers=key('"same"'))
    assert again.headers["idempotent-replayed"] == "true"


async def test_missing_key_where_required(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        response = await client.post("/tickets", json={})
    assert response.status_code == 400
    assert problem_type(response).endswith("missing-key")
    assert app.state.calls["tickets"] == 0


async def test_required_by_the_middleware_and_by_the_routes_mapping(store: Store) -> None:
    everywhere = make_app(store, required=True)
    mapped = make_app(store, routes={"/optional": {"required": True}})
    for app in (everywhere, mapped):
        async with client_for(app) as client:
            assert (await client.put("/optional")).status_code == 400
        assert app.state.calls["optional"] == 0


async def test_same_key_other_body_is_mismatch(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        await client.post("/tickets", json={"t": 1}, headers=key("k"))
        response = await client.post("/tickets", json={"t": 2}, headers=key("k"))
    assert response.status_code == 409
    assert problem_type(response).endswith("mismatch")
    assert app.state.calls["tickets"] == 1


async def test_mismatch_status_can_be_422(store: Store) -> None:
    app = make_app(store, mismatch_status=422)
    async with client_for(app) as client:
        await client.post("/tickets", json={"t": 1}, headers=key("k"))
        response = await client.post("/tickets", json={"t": 2}, headers=key("k"))
    assert response.status_code == 422
    assert problem_type(response).endswith("mismatch")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("/tickets/1/close", "/tickets/2/close"),
        ("/tickets/1/close?x=1", "/tickets/1/close?x=2"),
    ],
)
async def test_path_and_query_enter_the_fingerprint(store: Store, first: str, second: str) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        await client.post(first, headers=key("k"))
        response = await client.post(second, headers=key("k"))
    assert response.status_code == 409
    assert problem_type(response).endswith("mismatch")
    assert app.state.calls["close"] == 1


async def test_route_template_enters_the_fingerprint(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        await client.put("/optional", headers=key("k"))
        response = await client.post("/tickets", json={}, headers=key("k"))
    assert response.status_code == 409
    assert app.state.calls["tickets"] == 0


async def test_configured_headers_enter_the_fingerprint(store: Store) -> None:
    app = make_app(store, fingerprint_headers=["X-Tenant"])
    async with client_for(app) as client:
        await client.post(
            "/tickets", json={}, headers={**key("k"), "X-Tenant": "a", "X-Other": "1"}
        )
        other_untracked = await client.post(
            "/tickets", json={}, headers={**key("k"), "X-Tenant": "a", "X-Other": "2"}
        )
        other_tracked = await client.post(
            "/tickets", json={}, headers={**key("k"), "X-Tenant": "b"}
        )
    assert other_untracked.headers["idempotent-replayed"] == "true"
    assert other_tracked.status_code == 409


async def test_repeat_while_running_is_409_in_progress(store: Store) -> None:
    app = make_app(store, retry_after=2)
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(partial(client.post, "/held", headers=key("k")))
        await app.state.gate.entered.wait()
        response = await client.post("/held", headers=key("k"))
        app.state.gate.opened.set()
    assert response.status_code == 409
    assert problem_type(response).endswith("in-progress")
    assert response.headers["retry-after"] == "2"
    assert app.state.calls["held"] == 1


async def test_concurrent_requests_run_the_handler_once(store: Store) -> None:
    app = make_app(store)
    app.state.hold_seconds = 0.2
    responses: list[httpx.Response] = []

    async def post(client: httpx.AsyncClient) -> None:
        responses.append(await client.post("/slow", headers=key("burst")))

    async with client_for(app) as client, anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(post, client)
    assert app.state.calls["slow"] == 1
    answered = [r for r in responses if r.status_code == 200]
    # Requests that arrived after the first completed get its replay; the others, 409.
    assert sum("idempotent-replayed" not in r.headers for r in answered) == 1
    assert {r.content for r in answered} == {b'{"run":1}'}
    assert all(r.status_code in (200, 409) for r in responses)


async def test_exception_releases_the_key(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        assert (await client.post("/boom", headers=key("k"))).status_code == 500
        assert (await client.post("/boom", headers=key("k"))).status_code == 500
    assert app.state.calls["boom"] == 2


async def test_server_error_releases_unless_stored(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        for _ in range(2):
            assert (await client.post("/server-error", headers=key("k"))).status_code == 503
    assert app.state.calls["server-error"] == 2

    storing = make_app(store, store_server_errors=True)
    async with client_for(storing) as client:
        await client.post("/server-error", headers=key("k2"))
        again = await client.post("/server-error", headers=key("k2"))
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == b"try again"
    assert storing.state.calls["server-error"] == 1


async def test_cancelled_request_releases_the_key(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        with anyio.move_on_after(0.2):
            await client.post("/held", headers=key("k"))
        assert app.state.gate.entered.is_set()
        app.state.gate = type(app.state.gate)()
        app.state.gate.opened.set()
        response = await client.post("/held", headers=key("k"))
    assert response.status_code == 200
    assert app.state.calls["held"] == 2


async def test_crashed_worker_lease_lapses_then_retry_takes_over(
    store: Store, fake_time: FakeTime
) -> None:
    app = make_app(store, lease=0.3)
    async with client_for(app) as client:
        # A worker that died mid-request: its claim stays, nobody completes it.
        fingerprint = request_fingerprint("POST", "/slow", "/slow", b"", [], b"")
        claim = await store.claim("", "k", fingerprint, ttl=60, lease=0.3)
        assert claim.token
        during = await client.post("/slow", headers=key("k"))
        fake_time.now += 0.5
        after = await client.post("/slow", headers=key("k"))
    assert during.status_code == 409
    assert after.status_code == 200
    assert app.state.calls["slow"] == 1
    assert not await store.complete("", "k", claim.token, None, ttl=60)


async def test_long_handler_keeps_its_lease() -> None:
    # Renewals run on the worker's real clock, so the store's leases do too.
    app = make_app(MemoryStore(), lease=0.6)
    app.state.hold_seconds = 2.0
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(partial(client.post, "/slow", headers=key("k")))
        # Well past the first lease: only renewals keep the key.
        await anyio.sleep(1.4)
        during = await client.post("/slow", headers=key("k"))
    assert during.status_code == 409
    assert app.state.calls["slow"] == 1


async def test_streamed_response_replays_byte_for_byte(store: Store) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        first = await client.post("/stream?size=5", headers=key("k"))
        again = await client.post("/stream?size=5", headers=key("k"))
    assert len(first.content) == 5000
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.calls["stream"] == 1


async def test_response_over_the_limit_is_delivered_but_not_replayable(store: Store) -> None:
    app = make_app(store, max_response_bytes=2500)
    async with client_for(app) as client:
        first = await client.post("/stream?size=5", headers=key("k"))
        again = await client.post("/stream?size=5", headers=key("k"))
    assert len(first.content) == 5000
    assert again.status_code == 409
    assert problem_type(again).endswith("not-replayable")
    assert app.state.calls["stream"] == 1


async def test_request_over_the_limit_is_413(store: Store) -> None:
    app = make_app(store, max_request_bytes=100)
    async with client_for(app) as client:
        declared = await client.post("/tickets", content=b"x" * 101, headers=key("a"))

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * 50

        chunked = await client.post("/tickets", content=chunks(), headers=key("b"))
        fits = await client.post("/tickets", content=b"z" * 100, headers=key("c"))
    assert declared.status_code == 413
    assert problem_type(declared).endswith("request-too-large")
    assert chunked.status_code == 413
    assert fits.status_code == 201
    assert app.state.calls["tickets"] == 1


async def test_chunked_request_body_reaches_the_handler_whole(store: Store) -> None:
    app = make_app(store)

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"ab", b"cd", b"ef"):
            yield part

    async with client_for(app) as client:
        response = await client.post("/tickets", content=chunks(), headers=key("k"))
    assert response.json()["body"] == "abcdef"


async def test_expired_record_runs_again(store: Store, fake_time: FakeTime) -> None:
    app = make_app(store)
    async with client_for(app) as client:
        await client.post("/short-ttl", headers=key("k"))
        replay = await client.post("/short-ttl", headers=key("k"))
        fake_time.now += 0.5
        after = await client.post("/short-ttl", headers=key("k"))
    assert replay.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in after.headers
    assert app.state.calls["short-ttl"] == 2


async def test_per_route_ttl_from_the_routes_mapping_and_decorator_precedence(
    store: Store, fake_time: FakeTime
) -> None:
    app = make_app(
        store,
        routes={
            "/tickets/{ticket_id}/close": {"ttl": 0.3, "lease": 0.2},
            "/short-ttl": {"ttl": 60},
        },
    )
    async with client_for(app) as client:
        await client.post("/tickets/1/close", headers=key("k"))
        await client.post("/short-ttl", headers=key("k2"))
        fake_time.now += 0.5
        close_again = await client.post("/tickets/1/close", headers=key("k"))
        short_again = await client.post("/short-ttl", headers=key("k2"))
    assert app.state.calls["close"] == 2
    # The decorator's 0.3 s wins over the mapping's 60 s.
    assert app.state.calls["short-ttl"] == 2
    assert "idempotent-replayed" not in close_again.headers
    assert "idempotent-replayed" not in short_again.headers


async def test_callers_never_see_each_others_responses(store: Store) -> None:
    app = make_app(store, scope=lambda connection: connection.headers.get("x-caller", "anonymous"))
    async with client_for(app) as client:
        alice = await client.post("/tickets", json={}, headers={**key("k"), "X-Caller": "alice"})
        bob = await client.post("/tickets", json={}, headers={**key("k"), "X-Caller": "bob"})
        alice_again = await client.post(
            "/tickets", json={}, headers={**key("k"), "X-Caller": "alice"}
        )
    assert "idempotent-replayed" not in bob.headers
    assert bob.json()["id"] == 2
    assert alice_again.json() == alice.json() == {"id": 1, "body": "{}"}


async def test_async_scope_callable(store: Store) -> None:
    async def caller(connection: Any) -> str:
        return str(connection.headers.get("x-caller", ""))

    app = make_app(store, scope=caller)
    async with client_for(app) as client:
        await client.post("/tickets", json={}, headers={**key("k"), "X-Caller": "a"})
        other = await client.post("/tickets", json={}, headers={**key("k"), "X-Caller": "b"})
    assert app.state.calls["tickets"] == 2
    assert "idempotent-replayed" not in other.headers


async def test_unreachable_store_is_503_and_the_handler_does_not_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = SQLStore("postgresql://postgres@127.0.0.1:1/test", operation_timeout=5)
    app = make_app(dead, retry_after=3)
    async with client_for(app) as client:
        response = await client.post("/tickets", json={}, headers=key("secret-key-value"))
    assert response.status_code == 503
    assert problem_type(response).endswith("store-unavailable")
    assert response.headers["retry-after"] == "3"
    assert app.state.calls["tickets"] == 0
    assert "secret-key-value" not in caplog.text
    await dead.aclose()


async def test_fail_open_runs_the_handler_without_protection() -> None:
    dead = SQLStore("postgresql://postgres@127.0.0.1:1/test")
    app = make_app(dead, fail_open=True)
    async with client_for(app) as client:
        response = await client.post("/tickets", json={"a": 1}, headers=key("k"))
    assert response.status_code == 201
    assert response.json()["body"] == '{"a":1}'
    await dead.aclose()


async def test_startup_fails_with_the_command_to_run_when_the_table_is_missing(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'empty.db'}")
    app = make_app(store)
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(SchemaError, match="idempotency-mw migrate"),
    ):
        async with LifespanManager(app):
            pass
    assert "idempotency-mw migrate" in caplog.text


async def test_startup_fails_when_the_table_is_out_of_date(tmp_path: Any) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE idempotency_records (scope TEXT, key TEXT)")
    conn.close()
    store = SQLStore(f"sqlite:///{path}")
    app = make_app(store)
    with pytest.raises(SchemaError, match="out of date"):
        async with LifespanManager(app):
            pass


async def test_openapi_documents_the_key_header(store: Store) -> None:
    app = make_app(store, routes={"/optional": {"required": True}})
    async with LifespanManager(app), client_for(app) as client:
        schema = (await client.get("/openapi.json")).json()

    def header(path: str, method: str) -> dict[str, Any] | None:
        parameters = schema["paths"][path][method].get("parameters", [])
        found = [p for p in parameters if p["in"] == "header" and p["name"] == "Idempotency-Key"]
        assert len(found) <= 1
        return found[0] if found else None

    tickets = header("/tickets", "post")
    assert tickets is not None
    assert tickets["required"] is True
    slow = header("/slow", "post")
    assert slow is not None
    assert slow["required"] is False
    optional = header("/optional", "put")
    assert optional is not None
    assert optional["required"] is True
    assert header("/tickets", "get") is None


def test_a_store_without_binding_is_a_configuration_error(tmp_path: Any) -> None:
    class OldStore(SQLStore):
        async def claim(  # type: ignore[override]
            self, scope: str, key: str, fingerprint: str, *, ttl: float, lease: float
        ) -> Any:
            return await super().claim(scope, key, fingerprint, ttl=ttl, lease=lease)

    old = OldStore(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(ConfigurationError, match="binding="):
        IdempotencyMiddleware(FastAPI(), store=old)  # type: ignore[arg-type]  # the point


def test_invalid_options_are_configuration_errors(tmp_path: Any) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'x.db'}")
    app = make_app(store)
    for options in (
        {"mismatch_status": 400},
        {"ttl": 0},
        {"lease": -1},
        {"routes": {"/x": {"ttl": 1, "bogus": 1}}},
    ):
        with pytest.raises(ConfigurationError):
            IdempotencyMiddleware(app, store=store, **options)
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, store=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        SQLStore("oracle://scott@localhost/db")


async def test_a_retry_sent_as_the_answer_arrives_is_replayed(store: Store) -> None:
    app = make_app(store)
    request: Message = {"type": "http.request", "body": b"{}", "more_body": False}
    scope = http_scope(
        "/tickets", [(b"content-type", b"application/json"), (b"idempotency-key", b"k")]
    )
    retry: list[Message] = []

    async def receive() -> Message:
        return request

    async def record_retry(message: Message) -> None:
        retry.append(message)

    async def send(message: Message) -> None:
        # The client retries the moment the end of the answer reaches it.
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await app(dict(scope), receive, record_retry)

    await app(dict(scope), receive, send)
    assert retry[0]["status"] == 201
    assert (b"idempotent-replayed", b"true") in retry[0]["headers"]
    assert app.state.calls["tickets"] == 1


async def test_a_keyed_request_leaves_no_garbage_for_the_collector(store: Store) -> None:
    """A request's objects are freed with it, none left in a reference cycle."""
    app = make_app(store)
    async with client_for(app) as client:
        await client.post("/tickets", json={"t": 0}, headers=key("warm-up"))
        with garbage_of_ours() as garbage:
            first = await client.post("/tickets", json={"t": 1}, headers=key("k"))
            again = await client.post("/tickets", json={"t": 1}, headers=key("k"))
            other = await client.post("/tickets", json={"t": 2}, headers=key("k"))
    assert (first.status_code, again.status_code, other.status_code) == (201, 201, 409)
    assert garbage == []
