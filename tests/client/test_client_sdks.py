"""The OpenAI and Anthropic SDKs, given one key per logical operation from the client's
journal (``extra_headers``), against a fake provider behind IdempotencyMiddleware under uvicorn:
the SDK's own retry and a later call after a restart reuse the key, and the handler runs once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from example_app.demo import serve
from idempotency_mw import ConfigurationError, IdempotencyMiddleware
from idempotency_mw.client import IdempotentClient, OperationState
from idempotency_mw.testing import MemoryStore

pytestmark = pytest.mark.anyio

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "gpt-test",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The printer is on fire."},
            "finish_reason": "stop",
        }
    ],
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-test",
    "content": [{"type": "text", "text": "The printer is on fire."}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 1, "output_tokens": 1},
}


class LosesFirstResponses:
    """A proxy in front of the service that lets each path's first request run to its end,
    then answers 503 instead of its response (lost on the way back); it records the keys."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.keys: list[str | None] = []
        self._seen: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        self.keys.append(
            headers[b"idempotency-key"].decode() if b"idempotency-key" in headers else None
        )
        if scope["path"] in self._seen:
            await self.app(scope, receive, send)
            return
        self._seen.add(scope["path"])

        async def lost(message: Message) -> None:
            pass

        await self.app(scope, receive, lost)
        body = json.dumps({"error": {"message": "upstream lost", "type": "overloaded"}}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after-ms", b"10")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def provider() -> tuple[LosesFirstResponses, Counter[str]]:
    runs: Counter[str] = Counter()
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

    @app.post("/v1/chat/completions")
    async def complete(body: dict[str, Any]) -> dict[str, Any]:
        runs["openai"] += 1
        return COMPLETION

    @app.post("/v1/messages")
    async def message(body: dict[str, Any]) -> dict[str, Any]:
        runs["anthropic"] += 1
        return MESSAGE

    return LosesFirstResponses(app), runs


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, LosesFirstResponses, Counter[str]]]:
    proxy, runs = provider()
    async with serve(proxy) as port:
        yield f"http://127.0.0.1:{port}", proxy, runs


async def test_an_openai_call_keeps_its_key_across_the_sdks_retry_and_a_restart(
    service: tuple[str, LosesFirstResponses, Counter[str]], tmp_path: Path
) -> None:
    url, proxy, runs = service
    journal = tmp_path / "journal.sqlite3"
    ai = openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=2)
    messages: Any = [{"role": "user", "content": "Summarise ticket 7"}]
    async with ai, IdempotentClient(journal=journal) as client:
        op = await client.operation("summarise", ref="ticket-7")
        completion = await ai.chat.completions.create(
            model="gpt-test", messages=messages, extra_headers={"Idempotency-Key": op.key}
        )
    assert completion.choices[0].message.content == "The printer is on fire."
    assert proxy.keys == [op.key, op.key]  # the SDK's retry carried the same key
    assert runs["openai"] == 1

    # A restart: the same operation (name and ref) is the same key, answered by the record.
    ai = openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=2)
    async with ai, IdempotentClient(journal=journal) as client:
        again = await client.operation("summarise", ref="ticket-7")
        raw = await ai.chat.completions.with_raw_response.create(
            model="gpt-test", messages=messages, extra_headers={"Idempotency-Key": again.key}
        )
        await client.record(again, OperationState.CONFIRMED)
        entry = client.journal.get(again.key)
    assert again.key == op.key
    assert raw.headers["idempotent-replayed"] == "true"
    assert raw.parse().id == completion.id
    assert runs["openai"] == 1
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED


async def test_without_a_key_the_sdks_retry_runs_the_handler_again(
    service: tuple[str, LosesFirstResponses, Counter[str]],
) -> None:
    url, proxy, runs = service
    async with openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=2) as ai:
        await ai.chat.completions.create(
            model="gpt-test", messages=[{"role": "user", "content": "Summarise ticket 7"}]
        )
    assert proxy.keys == [None, None]  # the SDK mints a key per call but never sends it
    assert runs["openai"] == 2


async def test_an_anthropic_call_keeps_its_key_across_the_sdks_retry(
    service: tuple[str, LosesFirstResponses, Counter[str]], tmp_path: Path
) -> None:
    import anthropic  # here: slow to import, and every worker collects this module

    url, proxy, runs = service
    ai = anthropic.AsyncAnthropic(api_key="sk-test", base_url=url, max_retries=2)
    async with ai, IdempotentClient(journal=tmp_path / "journal.sqlite3") as client:
        op = await client.operation("summarise", ref="ticket-7")
        message = await ai.messages.create(
            model="claude-test",
            max_tokens=100,
            messages=[{"role": "user", "content": "Summarise ticket 7"}],
            extra_headers={"Idempotency-Key": op.key},
        )
    assert message.content[0].type == "text"
    assert proxy.keys == [op.key, op.key]
    assert runs["anthropic"] == 1


async def test_only_an_outcome_can_be_recorded(tmp_path: Path) -> None:
    async with IdempotentClient(journal=tmp_path / "journal.sqlite3") as client:
        op = await client.operation("summarise", ref="ticket-7")
        with pytest.raises(ConfigurationError, match="confirmed or failed"):
            await client.record(op, OperationState.UNKNOWN)
        await client.record(op, OperationState.FAILED)
        entry = client.journal.get(op.key)
    assert entry is not None
    assert entry.state is OperationState.FAILED
