"""Problems tell retrying clients whether a retry can help.

Stainless-generated SDKs (openai, anthropic) retry 408, 409, 429 and 5xx unless the answer says
``x-should-retry: false``, and wait as ``retry-after-ms`` (or ``Retry-After``) says. A final
problem says ``x-should-retry: false``; one a retry should follow says when.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.problems import RETRYABLE, Problem, send_problem
from tests.support.apps import Gate, PausableStore, client_for
from tests.support.faults import serve
from tests.support.sdk_server import Answers, Before, file_service

pytestmark = pytest.mark.anyio

FINAL = {
    Problem.MISSING_KEY,
    Problem.INVALID_KEY,
    Problem.MISMATCH,
    Problem.CREDENTIAL_MISMATCH,
    Problem.UNREPLAYABLE,
    Problem.COMMITTED_WITHOUT_RESPONSE,
    Problem.TOO_LARGE,
    Problem.EXPIRED_KEY,
    Problem.INVALID_FIRST_SENT,
    Problem.NOT_REPEATABLE,
    Problem.STORE_NOT_READY,
}
LATER = {Problem.IN_PROGRESS, Problem.STORE_UNAVAILABLE, Problem.LEASE_LOST}


def test_the_table_says_which_problems_are_final() -> None:
    assert {problem for problem, retryable in RETRYABLE.items() if not retryable} == FINAL
    assert {problem for problem, retryable in RETRYABLE.items() if retryable} == LATER
    # A failed scope= callable is the server's fault: the client's own policy for a 500 applies.
    assert set(Problem) - set(RETRYABLE) == {Problem.SCOPE_FAILED}


async def sent_headers(problem: Problem, retry_after: int | None) -> dict[bytes, bytes]:
    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await send_problem(send, problem, 409, "detail", retry_after=retry_after)
    assert [message["type"] for message in messages] == [
        "http.response.start",
        "http.response.body",
    ]
    return dict(messages[0]["headers"])


@pytest.mark.parametrize("problem", list(Problem))
async def test_each_problem_carries_its_retry_headers(problem: Problem) -> None:
    headers = await sent_headers(problem, 3)
    retry = {name: headers.get(name) for name in (b"x-should-retry", b"retry-after")}
    retry[b"retry-after-ms"] = headers.get(b"retry-after-ms")
    if problem in FINAL:
        assert retry == {b"x-should-retry": b"false", b"retry-after": None, b"retry-after-ms": None}
    elif problem in LATER:
        assert retry == {b"x-should-retry": None, b"retry-after": b"3", b"retry-after-ms": b"3000"}
    else:
        assert retry == dict.fromkeys(retry)


async def test_a_retryable_problem_needs_its_delay() -> None:
    with pytest.raises(ValueError, match="retry_after"):
        await sent_headers(Problem.IN_PROGRESS, None)


# ---------------------------------------------------------------- through the middleware


def service(store: Any = None, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store or MemoryStore(), **options)
    app.state.gate = Gate()
    app.state.runs = 0

    @app.post("/orders")
    async def order(request: Request) -> Response:
        app.state.runs += 1
        body = await request.body()
        if body == b"hold":
            app.state.gate.entered.set()
            await app.state.gate.opened.wait()
        return Response(body * (1000 if body == b"big" else 1))

    return app


def assert_final(answer: httpx.Response, slug: str) -> None:
    assert answer.json()["type"] == f"urn:idempotency-mw:problem:{slug}"
    assert answer.headers["x-should-retry"] == "false"
    assert "retry-after" not in answer.headers
    assert "retry-after-ms" not in answer.headers


def assert_later(answer: httpx.Response, slug: str, seconds: int) -> None:
    assert answer.json()["type"] == f"urn:idempotency-mw:problem:{slug}"
    assert "x-should-retry" not in answer.headers
    assert answer.headers["retry-after"] == str(seconds)
    assert answer.headers["retry-after-ms"] == str(seconds * 1000)


def keyed(key: str, **headers: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **headers}


async def test_a_mismatch_is_final() -> None:
    async with client_for(service()) as client:
        await client.post("/orders", content=b"one", headers=keyed("k"))
        answer = await client.post("/orders", content=b"two", headers=keyed("k"))
    assert answer.status_code == 409
    assert_final(answer, "mismatch")


async def test_a_credential_mismatch_is_final() -> None:
    async with client_for(service()) as client:
        await client.post("/orders", content=b"one", headers=keyed("k", Authorization="a"))
        answer = await client.post("/orders", content=b"one", headers=keyed("k", Authorization="b"))
    assert answer.status_code == 409
    assert_final(answer, "credential-mismatch")


async def test_a_response_that_cannot_be_replayed_is_final() -> None:
    async with client_for(service(max_response_bytes=100)) as client:
        first = await client.post("/orders", content=b"big", headers=keyed("k"))
        answer = await client.post("/orders", content=b"big", headers=keyed("k"))
    assert first.status_code == 200
    assert answer.status_code == 409
    assert_final(answer, "not-replayable")


@pytest.mark.parametrize(
    ("headers", "slug"),
    [({}, "missing-key"), (keyed("bad key"), "invalid-key")],
)
async def test_a_missing_or_invalid_key_is_final(headers: dict[str, str], slug: str) -> None:
    async with client_for(service(required=True)) as client:
        answer = await client.post("/orders", content=b"one", headers=headers)
    assert answer.status_code == 400
    assert_final(answer, slug)


async def test_a_request_too_large_is_final() -> None:
    async with client_for(service(max_request_bytes=2)) as client:
        answer = await client.post("/orders", content=b"one", headers=keyed("k"))
    assert answer.status_code == 413
    assert_final(answer, "request-too-large")


async def test_in_progress_says_when_to_retry() -> None:
    app = service(retry_after=2)
    async with client_for(app) as client, anyio.create_task_group() as group:

        async def held() -> None:
            await client.post("/orders", content=b"hold", headers=keyed("k"))

        group.start_soon(held)
        await app.state.gate.entered.wait()
        answer = await client.post("/orders", content=b"hold", headers=keyed("k"))
        app.state.gate.opened.set()
    assert answer.status_code == 409
    assert_later(answer, "in-progress", 2)


async def test_an_unavailable_store_says_when_to_retry() -> None:
    store = PausableStore(MemoryStore())
    store.fail("claim")
    async with client_for(service(store)) as client:
        answer = await client.post("/orders", content=b"one", headers=keyed("k"))
    assert answer.status_code == 503
    assert_later(answer, "store-unavailable", 1)


# ---------------------------------------------------------------- the openai SDK under uvicorn

#: Retries the SDK may make; with its backoff (0.5 s doubling), a few seconds in all.
MAX_RETRIES = 2


def held_when(gate: Gate) -> Before:
    """An upload of ``b"held"`` waits for the gate."""

    async def before(number: int, content: bytes) -> None:
        if content == b"held":
            gate.entered.set()
            await gate.opened.wait()

    return before


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test", max_retries=MAX_RETRIES)


def upload(client: openai.AsyncOpenAI, content: bytes, key: str) -> Any:
    return client.files.with_raw_response.create(
        file=("notes.txt", content, "text/plain"),
        purpose="assistants",
        extra_headers={"Idempotency-Key": key},
    )


async def test_the_openai_sdk_does_not_retry_a_mismatch() -> None:
    answers = Answers()
    runs: list[bytes] = []
    async with serve(answers.around(file_service(runs))) as url, sdk(url) as client:
        await upload(client, b"first", "k")
        with pytest.raises(openai.ConflictError) as raised:
            await upload(client, b"another file", "k")
    assert answers.statuses == [200, 409]  # one request each: the mismatch was not sent again
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert runs == [b"first"]


async def test_the_openai_sdk_follows_an_in_progress_answer_to_the_replay() -> None:
    answers = Answers()
    runs: list[bytes] = []
    gate = Gate()
    app = file_service(runs, held_when(gate))
    async with serve(answers.around(app)) as url, sdk(url) as client:
        first = asyncio.ensure_future(upload(client, b"held", "k"))
        await gate.entered.wait()
        second = asyncio.ensure_future(upload(client, b"held", "k"))
        await answers.conflict.wait()  # the duplicate was told to wait
        gate.opened.set()
        replies = [await first, await second]
    assert [reply.parse().id for reply in replies] == ["file-1", "file-1"]
    assert replies[1].headers["idempotent-replayed"] == "true"
    assert runs == [b"held"]
    assert answers.statuses == [409, 200, 200]
