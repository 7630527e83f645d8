"""Safe by default: refusals not recorded, scope errors fail closed, JSON compared by content."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import fastapi
import httpx
import pytest
import starlette.exceptions
from fastapi import FastAPI, Response
from pydantic import BaseModel
from starlette.requests import HTTPConnection

from idempotency_mw import IdempotencyMiddleware, Store, idempotent
from tests.support.apps import client_for

pytestmark = pytest.mark.anyio


class TicketIn(BaseModel):
    title: str
    priority: int


def service(store: Store, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    calls: Counter[str] = Counter()
    app.state.calls = calls

    @app.post("/tickets", status_code=201)
    async def create(ticket: TicketIn) -> dict[str, Any]:
        calls["create"] += 1
        return {"run": calls["create"], "title": ticket.title}

    @app.post("/checked-tickets", status_code=201)
    @idempotent()  # its endpoint's door: FastAPI's validation comes before it
    async def create_checked(ticket: TicketIn) -> dict[str, Any]:
        calls["create"] += 1
        return {"run": calls["create"], "title": ticket.title}

    @app.post("/answer/{status}")
    async def answer(status: int, response: Response) -> dict[str, int]:
        calls[f"answer-{status}"] += 1
        response.status_code = status
        return {"run": calls[f"answer-{status}"]}

    @app.post("/strict/{status}")
    @idempotent(release_statuses=[409])
    async def strict(status: int, response: Response) -> dict[str, int]:
        calls[f"strict-{status}"] += 1
        response.status_code = status
        return {"run": calls[f"strict-{status}"]}

    @app.post("/echo", status_code=201)
    async def echo() -> dict[str, int]:
        calls["echo"] += 1
        return {"run": calls["echo"]}

    return app


def key(value: str) -> dict[str, str]:
    return {"Idempotency-Key": value, "Content-Type": "application/json"}


async def test_a_validation_error_is_not_recorded_so_the_fixed_body_runs(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        invalid = await client.post("/tickets", json={"title": "x"}, headers=key("k"))
        fixed = await client.post("/tickets", json={"title": "x", "priority": 1}, headers=key("k"))
        again = await client.post("/tickets", json={"title": "x", "priority": 1}, headers=key("k"))
    assert invalid.status_code == 422
    assert fixed.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.calls["create"] == 1


@pytest.mark.parametrize("status", [401, 403, 404, 405, 406, 408, 413, 415, 422, 429])
async def test_an_endpoint_that_answers_4xx_itself_ran_and_is_replayed(
    store: Store, status: int
) -> None:
    """A handler that charged a card and answered 422 "card declined" acted: it never runs
    again for the same key, whatever its status (a retry gets the same answer)."""
    app = service(store)
    async with client_for(app) as client:
        answers = [await client.post(f"/answer/{status}", headers=key("k")) for _ in range(3)]
    assert [a.status_code for a in answers] == [status] * 3
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert app.state.calls[f"answer-{status}"] == 1


async def test_other_client_errors_stay_recorded(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        answers = [await client.post("/answer/409", headers=key("k")) for _ in range(2)]
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert app.state.calls["answer-409"] == 1


async def test_release_statuses_per_route_and_validation_errors_always(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        recorded_404 = [await client.post("/answer/404", headers=key("a")) for _ in range(2)]
        strict_409 = [await client.post("/strict/409", headers=key("b")) for _ in range(2)]
        assert [a.status_code for a in strict_409] == [409, 409]
        strict_404 = [await client.post("/strict/404", headers=key("c")) for _ in range(2)]
        invalid = [await client.post("/tickets", json={}, headers=key("d")) for _ in range(2)]
    assert recorded_404[1].headers["idempotent-replayed"] == "true"
    assert app.state.calls["strict-409"] == 2  # the route's own list
    assert strict_404[1].headers["idempotent-replayed"] == "true"
    # FastAPI's request validation proves the endpoint never ran, whatever the lists say.
    assert not any("idempotent-replayed" in a.headers for a in invalid)


async def post_large_invalid(client: httpx.AsyncClient, path: str, key_value: str) -> Any:
    """A ticket without its priority, whose title is 1 MiB: FastAPI's 422 repeats it."""
    body = b'{"title": "' + b"x" * (1 << 20) + b'"}'
    headers = {**key(key_value), "content-type": "application/json"}
    return await client.post(path, content=body, headers=headers)


async def test_large_invalid_bodies_leave_no_records_behind_the_endpoints_door(
    store: Store,
) -> None:
    app = service(store, max_request_bytes=2 << 20)
    async with client_for(app) as client:
        for index in range(5):
            answer = await post_large_invalid(client, "/checked-tickets", f"k{index}")
            assert answer.status_code == 422
        # Nothing was recorded: each key is free and a valid request runs under it.
        for index in range(5):
            fine = await client.post(
                "/checked-tickets", json={"title": "t", "priority": 1}, headers=key(f"k{index}")
            )
            assert fine.status_code == 201
    assert app.state.calls["create"] == 5


async def test_a_validation_answer_too_large_to_read_is_recorded_without_a_door(
    store: Store,
) -> None:
    # Without its endpoint's door, FastAPI's 422 is known by its body, which repeats the input:
    # over max_response_bytes it cannot be read, so it counts as the endpoint's (not replayable).
    app = service(store, max_request_bytes=2 << 20)
    async with client_for(app) as client:
        invalid = await post_large_invalid(client, "/tickets", "k")
        again = await post_large_invalid(client, "/tickets", "k")
    assert invalid.status_code == 422
    assert again.status_code == 409
    assert again.json()["type"].endswith(":not-replayable")
    assert app.state.calls["create"] == 0


@pytest.mark.parametrize("value", ["", None, 42])
async def test_a_scope_without_a_usable_value_fails_closed(
    store: Store, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = service(store, scope=lambda connection: value)
    async with client_for(app) as client:
        answer = await client.post("/echo", headers=key("k"))
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("scope-failed")
    assert app.state.calls["echo"] == 0
    assert "scope= callable" in caplog.text


@pytest.mark.parametrize("exception", [starlette.exceptions.HTTPException, fastapi.HTTPException])
async def test_an_http_exception_in_the_scope_is_its_answer(
    store: Store, exception: type[starlette.exceptions.HTTPException]
) -> None:
    async def caller(connection: HTTPConnection) -> str:
        raise exception(401, "Sign in first", headers={"WWW-Authenticate": "Bearer"})

    app = service(store, scope=caller)
    async with client_for(app) as client:
        answer = await client.post("/echo", headers=key("k"))
    assert answer.status_code == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["www-authenticate"] == "Bearer"
    assert answer.json() == {
        "type": "about:blank",
        "title": "Unauthorized",
        "status": 401,
        "detail": "Sign in first",
    }
    assert app.state.calls["echo"] == 0


async def test_a_failing_scope_callable_is_a_500_problem(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    def caller(connection: HTTPConnection) -> str:
        raise LookupError("no such user")

    app = service(store, scope=caller)
    with caplog.at_level(logging.ERROR, "idempotency_mw"):
        async with client_for(app) as client:
            answer = await client.post("/echo", headers=key("k"))
    assert answer.status_code == 500
    assert answer.json()["type"].endswith("scope-failed")
    assert "no such user" in caplog.text


async def test_json_fingerprint_compares_content_not_bytes(store: Store) -> None:
    app = service(store, fingerprint="json")
    async with client_for(app) as client:
        first = await client.post(
            "/tickets", content=b'{"title": "a", "priority": 1}', headers=key("k")
        )
        reordered = await client.post(
            "/tickets", content=b'{"priority":1,\n "title":"a"}', headers=key("k")
        )
        other = await client.post(
            "/tickets", content=b'{"priority": 2, "title": "a"}', headers=key("k")
        )
    assert first.status_code == 201
    assert reordered.headers["idempotent-replayed"] == "true"
    assert other.status_code == 409
    assert other.json()["type"].endswith("mismatch")


async def test_bytes_fingerprint_is_the_default(store: Store) -> None:
    app = service(store)
    async with client_for(app) as client:
        await client.post("/tickets", content=b'{"title": "a", "priority": 1}', headers=key("k"))
        reordered = await client.post(
            "/tickets", content=b'{"priority": 1, "title": "a"}', headers=key("k")
        )
    assert reordered.status_code == 409
