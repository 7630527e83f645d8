"""OASIS Repeatable Requests: every answer to a request sent with ``Repeatability-Request-ID``
says ``Repeatability-Result`` (3.2.1): ``accepted`` only when the key's record holds this very
request's one execution; a method the middleware does not guard is refused (501, 3.1.1)."""

from __future__ import annotations

import subprocess
import time
from email.utils import formatdate
from typing import Any

import anyio
import httpx
import pytest
from fastapi import FastAPI, HTTPException, Response

from idempotency_mw import SQLStore, Store
from idempotency_mw.testing import MemoryStore
from tests.support.apps import client_for, make_app
from tests.support.faults import serve

pytestmark = pytest.mark.anyio

PROBLEM = "urn:idempotency-mw:problem:"


def oasis(request_id: str, **headers: str) -> dict[str, str]:
    """The headers an OASIS client (Azure's SDKs) sends with a repeatable request."""
    return {
        "Repeatability-Request-ID": request_id,
        "Repeatability-First-Sent": formatdate(time.time(), usegmt=True),
        **headers,
    }


def result(answer: httpx.Response) -> str:
    return answer.headers["repeatability-result"]


def problem(answer: httpx.Response) -> str:
    assert answer.headers["content-type"] == "application/problem+json"
    return str(answer.json()["type"]).removeprefix(PROBLEM)


def service(store: Store, **options: Any) -> FastAPI:
    """:func:`make_app`, with a route that fails with the handler's own 500."""
    app = make_app(store, **options)

    @app.post("/failing")
    async def failing() -> None:
        app.state.calls["failing"] += 1
        raise HTTPException(500, "the handler failed")

    @app.post("/refused")
    async def refused() -> Response:
        return Response(status_code=422)

    return app


async def test_a_run_and_its_replay_are_accepted() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        first = await client.post("/tickets", json={}, headers=oasis("r-1"))
        again = await client.post("/tickets", json={}, headers=oasis("r-1"))
    assert (first.status_code, result(first)) == (201, "accepted")
    assert (again.headers["idempotent-replayed"], result(again)) == ("true", "accepted")
    assert app.state.calls["tickets"] == 1


async def test_a_request_id_without_a_first_sent_time_is_a_key() -> None:
    # azure-communication-chat sends the request id alone: lenient on purpose (the docs' table).
    app = service(MemoryStore())
    alone = {"Repeatability-Request-ID": "r-1"}
    async with client_for(app) as client:
        first = await client.post("/tickets", json={}, headers=alone)
        again = await client.post("/tickets", json={}, headers=alone)
    assert (first.status_code, result(first)) == (201, "accepted")
    assert (again.headers["idempotent-replayed"], result(again)) == ("true", "accepted")
    assert app.state.calls["tickets"] == 1


async def test_requests_refused_before_any_claim_are_rejected() -> None:
    def failing_scope(request: object) -> str:
        raise RuntimeError("the token service is down")

    app = service(MemoryStore(), max_request_bytes=10)
    unscoped = service(MemoryStore(), scope=failing_scope)
    async with client_for(app) as client, client_for(unscoped) as other:
        large = await client.post("/tickets", json={"x": "y" * 20}, headers=oasis("r-1"))
        no_scope = await other.post("/tickets", json={}, headers=oasis("r-2"))
    assert (large.status_code, problem(large), result(large)) == (
        413,
        "request-too-large",
        "rejected",
    )
    assert (no_scope.status_code, problem(no_scope), result(no_scope)) == (
        500,
        "scope-failed",
        "rejected",
    )
    assert app.state.calls["tickets"] == unscoped.state.calls["tickets"] == 0


async def test_a_request_id_reused_for_another_request_is_rejected() -> None:
    # 3.2.1.1: accepted means this request was executed once; it never runs under this key.
    app = service(MemoryStore())
    async with client_for(app) as client:
        await client.post("/tickets", json={"n": 1}, headers=oasis("r-1"))
        other = await client.post("/tickets", json={"n": 2}, headers=oasis("r-1"))
    assert (other.status_code, problem(other), result(other)) == (409, "mismatch", "rejected")
    assert "idempotency-key-expires" in other.headers


async def test_a_request_id_of_other_credentials_is_rejected() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        await client.post("/tickets", json={}, headers=oasis("r-1", Authorization="Bearer alice"))
        bob = await client.post(
            "/tickets", json={}, headers=oasis("r-1", Authorization="Bearer bob")
        )
    assert (bob.status_code, problem(bob), result(bob)) == (
        409,
        "credential-mismatch",
        "rejected",
    )
    assert app.state.calls["tickets"] == 1


async def test_an_invalid_request_id_is_rejected() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        answer = await client.post("/tickets", json={}, headers=oasis("not a key"))
    assert (answer.status_code, problem(answer), result(answer)) == (400, "invalid-key", "rejected")
    assert answer.json()["detail"].startswith("Repeatability-Request-ID ")


async def test_two_request_ids_are_named_as_the_header_sent() -> None:
    # curl, over a real server: two headers of the same name, as a broken proxy may make them.
    app = service(MemoryStore())
    async with serve(app) as url:
        completed = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                [
                    "curl",
                    "-s",
                    "-i",
                    "-X",
                    "POST",
                    f"{url}/tickets",
                    "-H",
                    "content-type: application/json",
                    "-H",
                    "Repeatability-Request-ID: r-1",
                    "-H",
                    "Repeatability-Request-ID: r-2",
                    "-d",
                    "{}",
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
        )
    head, _, body = completed.stdout.partition("\n\n")
    assert head.startswith("HTTP/1.1 400")
    assert "repeatability-result: rejected" in head.lower()
    assert '"detail": "Send one Repeatability-Request-ID header."' in body
    assert app.state.calls["tickets"] == 0


async def test_a_key_in_both_headers_names_both() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        both = await client.post(
            "/tickets", json={}, headers=oasis("r-1", **{"Idempotency-Key": "k-2"})
        )
        twice = await client.post(
            "/tickets", json={}, headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
        )
    assert both.json()["detail"] == ("Send one Idempotency-Key or Repeatability-Request-ID header.")
    assert result(both) == "rejected"
    assert twice.json()["detail"] == "Send one Idempotency-Key header."
    assert "repeatability-result" not in twice.headers


async def test_a_handlers_server_error_is_rejected_and_runs_again() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        failed = await client.post("/failing", headers=oasis("r-1"))
        again = await client.post("/failing", headers=oasis("r-1"))
        unavailable = await client.post("/server-error", headers=oasis("r-2"))
    assert (failed.status_code, result(failed)) == (500, "rejected")
    assert (again.status_code, result(again)) == (500, "rejected")
    assert (unavailable.status_code, result(unavailable)) == (503, "rejected")
    # Released, as the header said: the retry ran.
    assert app.state.calls["failing"] == 2


async def test_a_recorded_server_error_is_accepted() -> None:
    app = service(MemoryStore(), store_server_errors=True)
    async with client_for(app) as client:
        failed = await client.post("/failing", headers=oasis("r-1"))
        again = await client.post("/failing", headers=oasis("r-1"))
    assert (failed.status_code, result(failed)) == (500, "accepted")
    assert "idempotency-key-expires" in failed.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert app.state.calls["failing"] == 1


async def test_a_released_status_is_rejected() -> None:
    app = service(MemoryStore(), routes={"/refused": {"release_statuses": [422]}})
    async with client_for(app) as client:
        refused = await client.post("/refused", headers=oasis("r-1"))
    assert (refused.status_code, result(refused)) == (422, "rejected")
    assert "idempotency-key-expires" not in refused.headers


async def test_an_unavailable_store_is_rejected() -> None:
    dead = SQLStore("postgresql://postgres@127.0.0.1:1/test", operation_timeout=5)
    app = service(dead)
    try:
        async with client_for(app) as client:
            answer = await client.post("/tickets", json={}, headers=oasis("r-1"))
    finally:
        await dead.aclose()
    assert (answer.status_code, problem(answer), result(answer)) == (
        503,
        "store-unavailable",
        "rejected",
    )
    assert app.state.calls["tickets"] == 0


async def test_a_request_in_progress_is_accepted() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client, anyio.create_task_group() as group:
        group.start_soon(lambda: client.post("/held", headers=oasis("r-1")))
        await app.state.gate.entered.wait()
        running = await client.post("/held", headers=oasis("r-1"))
        app.state.gate.opened.set()
    assert (running.status_code, problem(running), result(running)) == (
        409,
        "in-progress",
        "accepted",
    )


async def test_a_path_the_app_does_not_have_is_rejected() -> None:
    app = service(MemoryStore())
    async with client_for(app) as client:
        missing = await client.post("/nowhere", headers=oasis("r-1"))
        wrong_method = await client.patch("/tickets", headers=oasis("r-2"))
    assert (missing.status_code, result(missing)) == (404, "rejected")
    assert (wrong_method.status_code, result(wrong_method)) == (405, "rejected")


async def test_a_method_outside_methods_is_refused_as_not_repeatable() -> None:
    # 3.1.1: a request that cannot be made repeatable is refused, and nothing runs.
    app = service(MemoryStore(), methods=["POST"])
    async with client_for(app) as client:
        refused = await client.put("/optional", headers=oasis("r-1"))
        keyed = await client.put("/optional", headers={"Idempotency-Key": "k"})
        safe = await client.get("/tickets", headers=oasis("r-2"))
        missing = await client.put("/nowhere", headers=oasis("r-3"))
    assert (refused.status_code, problem(refused), result(refused)) == (
        501,
        "not-repeatable",
        "rejected",
    )
    assert refused.headers["x-should-retry"] == "false"
    assert "Repeatability-Request-ID" in refused.json()["detail"]
    # Only the OASIS header asks for repeatability; a safe method is repeatable by nature.
    assert keyed.status_code == safe.status_code == 200
    assert "repeatability-result" not in safe.headers
    assert (missing.status_code, result(missing)) == (404, "rejected")
    assert app.state.calls["optional"] == 1


async def test_a_first_sent_time_too_old_is_rejected() -> None:
    app = service(MemoryStore())
    stale = formatdate(time.time() - 7 * 86400, usegmt=True)
    async with client_for(app) as client:
        answer = await client.post(
            "/tickets",
            json={},
            headers={"Repeatability-Request-ID": "r-1", "Repeatability-First-Sent": stale},
        )
        bad = await client.post(
            "/tickets",
            json={},
            headers={"Repeatability-Request-ID": "r-2", "Repeatability-First-Sent": "soon"},
        )
    assert (answer.status_code, result(answer)) == (412, "rejected")
    assert (bad.status_code, problem(bad), result(bad)) == (400, "invalid-first-sent", "rejected")
    assert "Repeatability-First-Sent" in bad.json()["detail"]


async def test_the_openapi_schema_documents_the_oasis_headers_and_a_whole_retention() -> None:
    app = service(MemoryStore(), ttl=600)
    custom = service(
        MemoryStore(), request_id_header=None, first_sent_header="X-First-Sent", ttl=0.5, lease=0.25
    )
    async with client_for(app) as client, client_for(custom) as other:
        schema = (await client.get("/openapi.json")).json()
        raw = (await client.get("/openapi.json")).text
        custom_schema = (await other.get("/openapi.json")).json()
    operation = schema["paths"]["/tickets"]["post"]
    headers = {p["name"]: p for p in operation["parameters"] if p["in"] == "header"}
    assert headers.keys() >= {
        "Idempotency-Key",
        "Repeatability-Request-ID",
        "Repeatability-First-Sent",
    }
    assert headers["Repeatability-Request-ID"]["required"] is False
    assert "Repeatability-Result" in operation["responses"]["201"]["headers"]
    assert "Repeatability-Result" in operation["responses"]["409"]["headers"]
    retention = operation["x-idempotency"]["retention_seconds"]
    assert (retention, type(retention)) == (600, int)
    assert '"retention_seconds":600}' in raw
    theirs = custom_schema["paths"]["/tickets"]["post"]
    names = {p["name"] for p in theirs["parameters"] if p["in"] == "header"}
    assert names >= {"Idempotency-Key", "X-First-Sent"}
    assert not names & {"Repeatability-Request-ID", "Repeatability-First-Sent"}
    assert "Repeatability-Result" not in theirs["responses"]["201"]["headers"]
    assert theirs["x-idempotency"]["retention_seconds"] == 0.5
