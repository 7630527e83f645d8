"""The anthropic SDK (Stainless-generated, like openai's: it retries every 409 unless told not
to) against a messages service behind the middleware, under uvicorn: a final problem is sent
once, never retried."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI, Request

from idempotency_mw import IdempotencyMiddleware
from idempotency_mw.testing import MemoryStore
from tests.support.faults import serve
from tests.support.sdk_server import Answers

if TYPE_CHECKING:  # imported where used: slow to import, and every worker collects this module
    import anthropic

pytestmark = pytest.mark.anyio

#: Enough for a retry to show (its backoff starts at half a second).
MAX_RETRIES = 2


def message_service(runs: list[str]) -> FastAPI:
    """``POST /v1/messages`` answers a message that echoes the prompt. Records are bound to
    either header the SDK may send its key in (``x-api-key``, or ``Authorization`` when the
    key is given as a token)."""
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        credential_headers=("authorization", "x-api-key"),
    )

    @app.post("/v1/messages")
    async def create_message(request: Request) -> dict[str, Any]:
        prompt = (await request.json())["messages"][0]["content"]
        runs.append(prompt)
        return {
            "id": f"msg_{len(runs)}",
            "type": "message",
            "role": "assistant",
            "model": "test-model",
            "content": [{"type": "text", "text": prompt}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }

    return app


def ask(client: anthropic.AsyncAnthropic, prompt: str, key: str) -> Any:
    return client.messages.create(
        model="test-model",
        max_tokens=16,
        messages=[{"role": "user", "content": prompt}],
        extra_headers={"Idempotency-Key": key},
    )


def sdk(url: str, api_key: str = "key-1") -> anthropic.AsyncAnthropic:
    import anthropic

    return anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=MAX_RETRIES)


async def test_the_anthropic_sdk_replays_and_does_not_retry_a_mismatch() -> None:
    import anthropic

    answers = Answers()
    runs: list[str] = []
    async with serve(answers.around(message_service(runs))) as url, sdk(url) as client:
        first = await ask(client, "hello", "k")
        again = await ask(client, "hello", "k")
        with pytest.raises(anthropic.ConflictError) as raised:
            await ask(client, "another prompt", "k")
    assert first.id == again.id == "msg_1"
    assert answers.statuses == [200, 200, 409]  # the mismatch was sent once
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.body["type"].endswith(":mismatch")  # type: ignore[index]
    assert runs == ["hello"]


async def test_the_anthropic_sdk_does_not_retry_a_credential_mismatch() -> None:
    import anthropic

    answers = Answers()
    runs: list[str] = []
    async with serve(answers.around(message_service(runs))) as url:
        async with sdk(url) as client:
            await ask(client, "hello", "k")
        async with sdk(url, api_key="key-2") as other:
            with pytest.raises(anthropic.ConflictError) as raised:
                await ask(other, "hello", "k")
    assert answers.statuses == [200, 409]
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.body["type"].endswith(":credential-mismatch")  # type: ignore[index]
    assert runs == ["hello"]
