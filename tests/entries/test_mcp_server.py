"""MCP tool calls once per key with the mcp SDK's own client and server: in process, over
streamable HTTP (JSON and SSE answers, uvicorn on 127.0.0.1) and stdio (a subprocess)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import cast

import anyio
import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, RequestParamsMeta, TextContent
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.client import IdempotencyKeyMismatch, RetryPolicy
from idempotency_mw.client.mcp import IdempotentToolCaller, key_meta
from idempotency_mw.mcp import IDEMPOTENCY_ERROR, IdempotentTools
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import MemoryStore
from idempotency_mw.wire.mcp import REPLAYED_META
from tests.conftest import fresh_sql_store
from tests.support.faults import serve
from tests.support.mcp_tools import runs, tool_server

pytestmark = pytest.mark.anyio

Connect = Callable[[], AbstractAsyncContextManager[Client]]


async def count(url: str, tool: str) -> int:
    engine = create_async_engine(async_url(url))
    async with engine.connect() as conn:
        value = await conn.scalar(select(func.count()).select_from(runs).where(runs.c.tool == tool))
    await engine.dispose()
    return int(value or 0)


def text(result: CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


@pytest.fixture
def database(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tools.db'}"


@pytest.fixture
async def server(database: str) -> AsyncIterator[MCPServer]:
    engine = create_async_engine(async_url(database))
    yield tool_server(MemoryStore(), engine)
    await engine.dispose()


async def test_a_retry_in_the_same_session_gets_the_first_result(
    server: MCPServer, database: str
) -> None:
    async with Client(server) as client:
        first = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k1"))
        again = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k1"))
        other = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k2"))
    assert first.structured_content == again.structured_content == {"id": 1, "title": "t"}
    assert (again.meta or {}).get(REPLAYED_META) is True
    assert REPLAYED_META not in (first.meta or {})
    assert other.structured_content == {"id": 2, "title": "t"}
    assert await count(database, "create_ticket") == 2


async def test_a_retry_in_a_new_session_gets_the_first_result(
    server: MCPServer, database: str
) -> None:
    async with Client(server) as client:
        first = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k"))
    async with Client(server) as client:
        again = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k"))
    assert first.structured_content == again.structured_content
    assert await count(database, "create_ticket") == 1


async def test_the_same_key_with_other_arguments_is_a_jsonrpc_error(
    server: MCPServer, database: str
) -> None:
    async with Client(server) as client:
        await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("k"))
        with pytest.raises(MCPError) as refused:
            await client.call_tool("create_ticket", {"title": "other"}, meta=key_meta("k"))
        with pytest.raises(MCPError):
            await client.call_tool("charge", {"order": "t"}, meta=key_meta("k"))  # another tool
    assert refused.value.code == IDEMPOTENCY_ERROR
    assert refused.value.data["type"] == "urn:idempotency-mw:problem:mismatch"
    assert "other" in refused.value.message or "different" in refused.value.message.lower()
    assert await count(database, "create_ticket") == 1


async def test_a_tool_error_is_recorded_like_any_result(server: MCPServer, database: str) -> None:
    async with Client(server) as client:
        results = [
            await client.call_tool("charge", {"order": "o-1"}, meta=key_meta("c")) for _ in range(2)
        ]
    assert all(result.is_error for result in results)
    assert text(results[0]) == text(results[1])
    assert await count(database, "charge") == 1


async def test_calls_without_a_key_and_unprotected_tools_are_untouched(
    server: MCPServer, database: str
) -> None:
    async with Client(server) as client:
        for _ in range(2):
            await client.call_tool("create_ticket", {"title": "t"})
            await client.call_tool("echo", {"text": "hi"}, meta=key_meta("e"))
        # A key that is not a string, as a client without types may send it.
        bad = cast(RequestParamsMeta, {"idempotencyKey": 7})
        with pytest.raises(MCPError, match="idempotencyKey"):
            await client.call_tool("create_ticket", {"title": "t"}, meta=bad)
    assert await count(database, "create_ticket") == 2
    assert await count(database, "echo") == 2


async def test_protection_is_advertised(server: MCPServer) -> None:
    async with Client(server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        extensions = client.server_capabilities.extensions or {}
    assert (tools["create_ticket"].meta or {})["idempotency"] == {"key": "_meta.idempotencyKey"}
    assert "idempotency" not in (tools["echo"].meta or {})
    assert extensions[IdempotentTools.identifier] == {
        "key": "_meta.idempotencyKey",
        "firstSent": "_meta.idempotencyFirstSent",
        "lookup": "idempotency/lookup",
        "tools": ["charge", "create_ticket"],
    }


@asynccontextmanager
async def serving(server: MCPServer, *, json_response: bool) -> AsyncIterator[str]:
    """``server`` over streamable HTTP on uvicorn; yields its URL."""
    async with serve(server.streamable_http_app(json_response=json_response)) as base:
        yield f"{base}/mcp"


@pytest.mark.parametrize("json_response", [True, False], ids=["json", "sse"])
async def test_streamable_http_retries_in_the_same_and_a_new_session(
    server: MCPServer, database: str, json_response: bool
) -> None:
    async with serving(server, json_response=json_response) as url:
        async with Client(url) as client:
            first = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("h"))
            again = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("h"))
        async with Client(url) as client:
            later = await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("h"))
            with pytest.raises(MCPError):
                await client.call_tool("create_ticket", {"title": "x"}, meta=key_meta("h"))
    assert first.structured_content == again.structured_content == later.structured_content
    assert await count(database, "create_ticket") == 1


async def test_refusals_over_http_in_the_sdks_default_mode_are_read_by_the_caller(
    server: MCPServer, database: str, tmp_path: Path
) -> None:
    """The SDK's Client as it comes (mode="auto": MCP 2026-07-28, stateless) over streamable
    HTTP: the refusal's code is outside JSON-RPC's reserved range, and the caller reads it."""
    policy = RetryPolicy(backoff_base=0.0, read_timeout=5.0)
    async with (
        serving(server, json_response=True) as url,
        Client(url) as session,
        IdempotentToolCaller(
            session, journal=tmp_path / "journal.sqlite3", policy=policy
        ) as caller,
    ):
        version = session.protocol_version
        op = await caller.operation("create_ticket", ref="T-1")
        await caller.send(op, {"title": "t"})
        with pytest.raises(MCPError) as refused:
            await session.call_tool("create_ticket", {"title": "x"}, meta=key_meta(op.key))
        with pytest.raises(IdempotencyKeyMismatch):
            await caller.client.send(op, "POST", "/tools/create_ticket", json={"title": "x"})
    assert version == "2026-07-28"
    assert refused.value.code == IDEMPOTENCY_ERROR
    assert not -32768 <= refused.value.code <= -32000
    assert refused.value.data["type"] == "urn:idempotency-mw:problem:mismatch"
    assert await count(database, "create_ticket") == 1


async def test_stdio_retries_in_a_new_server_process(database: str) -> None:
    await (await fresh_sql_store(database)).aclose()
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "tests.support.mcp_tools", database], cwd=Path.cwd()
    )
    results = []
    for _ in range(2):  # each session is a process of its own
        async with Client(params) as client:
            results.append(
                await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("s"))
            )
    assert results[0].structured_content == results[1].structured_content == {"id": 1, "title": "t"}
    assert await count(database, "create_ticket") == 1


async def test_the_tool_caller_end_to_end(server: MCPServer, database: str, tmp_path: Path) -> None:
    policy = RetryPolicy(backoff_base=0.0, read_timeout=5.0)
    async with (
        Client(server) as session,
        IdempotentToolCaller(
            session, journal=tmp_path / "journal.sqlite3", policy=policy
        ) as caller,
    ):
        op = await caller.operation("create_ticket", ref="T-1")
        first = await caller.send(op, {"title": "t"})
        # The same operation's key sent again with other arguments: the server says no, final.
        with pytest.raises(IdempotencyKeyMismatch):
            await caller.client.send(op, "POST", "/tools/create_ticket", json={"title": "x"})
        again = await session.call_tool("create_ticket", {"title": "t"}, meta=key_meta(op.key))
    assert first.structured_content == again.structured_content == {"id": 1, "title": "t"}
    assert await count(database, "create_ticket") == 1


def slow_server(runs: list[str]) -> MCPServer:
    """A server whose protected tool takes 0.6 s; a duplicate does not wait for it."""
    server = MCPServer("slow", extensions=[IdempotentTools(MemoryStore())])

    @server.tool()
    async def slow(title: str) -> str:
        runs.append(title)
        await anyio.sleep(0.6)
        return f"done {title}"

    return server


async def test_a_duplicate_while_the_first_runs_is_told_to_retry_later() -> None:
    runs: list[str] = []
    server = slow_server(runs)
    refused: list[MCPError] = []
    async with Client(server) as client, anyio.create_task_group() as group:
        group.start_soon(partial(client.call_tool, "slow", {"title": "t"}, meta=key_meta("p")))
        await anyio.sleep(0.2)
        with pytest.raises(MCPError) as caught:
            await client.call_tool("slow", {"title": "t"}, meta=key_meta("p"))
        refused.append(caught.value)
    (error,) = refused
    assert error.code == IDEMPOTENCY_ERROR
    assert error.data["type"] == "urn:idempotency-mw:problem:in-progress"
    assert error.data["retryAfter"] > 0
    assert runs == ["t"]


async def test_the_tool_caller_retries_a_call_in_progress_until_its_result(
    tmp_path: Path,
) -> None:
    runs: list[str] = []
    server = slow_server(runs)
    policy = RetryPolicy(backoff_base=0.0, read_timeout=5, max_attempts=20, deadline=30)
    async with (
        Client(server) as other,
        Client(server) as session,
        IdempotentToolCaller(
            session, journal=tmp_path / "journal.sqlite3", policy=policy, sleep=slept
        ) as caller,
        anyio.create_task_group() as group,
    ):
        op = await caller.operation("slow", ref="S-1")
        # Another session runs the call under the operation's key: the caller finds it in
        # progress, retries after the server's retryAfter, and gets its result.
        group.start_soon(partial(other.call_tool, "slow", {"title": "t"}, meta=key_meta(op.key)))
        await anyio.sleep(0.2)
        result = await caller.send(op, {"title": "t"})
    assert text(result) == "done t"
    assert runs == ["t"]


async def slept(seconds: float) -> None:
    await anyio.sleep(min(seconds, 0.1))
