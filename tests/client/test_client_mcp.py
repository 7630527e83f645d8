"""MCP tool calls through IdempotentToolCaller against an mcp SDK server whose tools record
the ``_meta`` key they receive: one key per logical call, across timeouts, broken and new
sessions, restarts, and in sagas."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.client.client import Client
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    REQUEST_TIMEOUT,
    CallToolResult,
    TextContent,
)

from idempotency_mw import ConfigurationError
from idempotency_mw.client import (
    CommittedWithoutResponse,
    IdempotencyKeyMismatch,
    OperationState,
    OutcomeUnknown,
    RetryPolicy,
    Saga,
    SagaState,
    StepState,
)
from idempotency_mw.client.mcp import (
    IdempotentToolCaller,
    ToolCallError,
    ToolSession,
    ToolStep,
    tool_result,
)
from idempotency_mw.mcp import IDEMPOTENCY_ERROR, IdempotentMCPServer, IdempotentTools
from idempotency_mw.testing import MemoryStore
from tests.support.client_support import FakeTime

pytestmark = pytest.mark.anyio

#: Attempts time out after 0.3 s; retries go at once.
POLICY = RetryPolicy(backoff_base=0.0, read_timeout=0.3)
#: For calls that must not time out, however loaded the machine.
PATIENT = RetryPolicy(backoff_base=0.0, read_timeout=10)


@dataclass
class Tools:
    """An MCP server whose tools record (tool, _meta key) per run; ``slow`` runs sleep."""

    server: MCPServer = field(default_factory=lambda: MCPServer("tickets"))
    runs: list[tuple[str, str | None]] = field(default_factory=list)
    slow: int = 0

    def __post_init__(self) -> None:
        @self.server.tool()
        async def create_ticket(title: str, ctx: Context) -> str:
            await self._run("create_ticket", ctx)
            return f"ticket {len(self.runs)}: {title}"

        @self.server.tool()
        async def reserve(order: str, ctx: Context) -> str:
            await self._run("reserve", ctx)
            return f"reserved {order}"

        @self.server.tool()
        async def release(order: str, ctx: Context) -> str:
            await self._run("release", ctx)
            return f"released {order}"

        @self.server.tool()
        async def charge(order: str, ctx: Context) -> str:
            await self._run("charge", ctx)
            raise ToolError("card declined")

    async def _run(self, tool: str, ctx: Context) -> None:
        meta = ctx.request_context.meta or {}
        key = meta.get("idempotencyKey")
        self.runs.append((tool, key if isinstance(key, str) else None))
        if self.slow:
            self.slow -= 1
            await anyio.sleep(2)

    def keys(self, tool: str) -> list[str | None]:
        return [key for name, key in self.runs if name == tool]


@asynccontextmanager
async def calling(
    tools: Tools, path: Path, fake_time: FakeTime, policy: RetryPolicy = POLICY
) -> AsyncIterator[IdempotentToolCaller]:
    """A caller on a session of ``tools``' server, journaling in ``path``."""
    async with (
        Client(tools.server) as session,
        IdempotentToolCaller(
            session, journal=path / "journal.sqlite3", policy=policy, sleep=fake_time.sleep
        ) as caller,
    ):
        yield caller


def text(result: CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


async def settle(
    caller: IdempotentToolCaller, tool: str, ref: str, arguments: dict[str, Any]
) -> tuple[str, CallToolResult, OperationState]:
    """One logical call of ``tool`` sent until settled: its key, result and journaled state."""
    op = await caller.operation(tool, ref=ref)
    result = await caller.send(op, arguments)
    entry = caller.client.journal.get(op.key)
    assert entry is not None
    return op.key, result, entry.state


async def test_a_call_that_timed_out_is_retried_under_its_key(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    tools = Tools(slow=1)
    async with calling(tools, tmp_path, fake_time) as caller:
        key, result, state = await settle(
            caller, "create_ticket", "T-1", {"title": "printer on fire"}
        )
    assert text(result) == "ticket 2: printer on fire"
    assert tools.keys("create_ticket") == [key, key]
    assert state is OperationState.CONFIRMED


class Breaks:
    """A session whose connection breaks after the server got the call (the answer is lost)."""

    def __init__(self, inner: ToolSession) -> None:
        self.inner = inner

    async def call_tool(self, name: str, arguments: Any = None, *args: Any, **kw: Any) -> Any:
        await self.inner.call_tool(name, arguments, *args, **kw)
        raise MCPError(CONNECTION_CLOSED, "Connection closed")


async def test_a_broken_session_is_replaced_and_the_call_keeps_its_key(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    tools = Tools()
    opened: list[Client] = []

    @asynccontextmanager
    async def connect() -> AsyncIterator[ToolSession]:
        async with Client(tools.server) as client:
            opened.append(client)
            yield Breaks(client.session) if len(opened) == 1 else client.session

    async with IdempotentToolCaller(
        connect=connect, journal=tmp_path / "journal.sqlite3", policy=POLICY, sleep=fake_time.sleep
    ) as caller:
        result = await caller.call_tool("create_ticket", {"title": "t"}, ref="T-1")
    assert not result.is_error
    assert len(opened) == 3  # a new session for the lookup of the key, and for the retry
    keys = tools.keys("create_ticket")
    assert len(keys) == 2
    assert keys[0] is not None
    assert keys[0] == keys[1]


async def test_after_a_restart_the_same_call_is_sent_under_its_key_then_not_again(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    tools = Tools(slow=1)
    journal = tmp_path / "journal.sqlite3"
    once = RetryPolicy(max_attempts=1, read_timeout=0.3)
    async with (
        Client(tools.server) as session,
        IdempotentToolCaller(session, journal=journal, policy=once) as caller,
    ):
        with pytest.raises(OutcomeUnknown) as caught:
            await caller.call_tool("create_ticket", {"title": "t"}, ref="T-9")
        with pytest.raises(IdempotencyKeyMismatch):  # same call, other arguments
            await caller.call_tool("create_ticket", {"title": "other"}, ref="T-9")
    key = caught.value.key

    async with (  # another process, another session, the same journal
        Client(tools.server) as session,
        IdempotentToolCaller(session, journal=journal, policy=POLICY) as caller,
    ):
        resumed = await caller.call_tool("create_ticket", {"title": "t"}, ref="T-9")
        again = await caller.call_tool("create_ticket", {"title": "t"}, ref="T-9")
        settled = await caller.client.reconcile()
    assert tools.keys("create_ticket") == [key, key]  # the journal answered the third call
    assert text(again) == text(resumed)
    assert settled == []


async def test_a_tools_error_is_its_final_answer(tmp_path: Path, fake_time: FakeTime) -> None:
    tools = Tools()
    async with calling(tools, tmp_path, fake_time) as caller:
        key, result, state = await settle(caller, "charge", "O-1", {"order": "O-1"})
    assert result.is_error
    assert "card declined" in text(result)
    assert tools.keys("charge") == [key]  # not retried
    assert state is OperationState.FAILED


async def test_a_saga_of_tool_calls_compensates_under_its_steps_keys(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    tools = Tools()
    async with calling(tools, tmp_path, fake_time) as caller:
        saga = (
            Saga(caller.client, "order", ref="O-7")
            .step(
                "reserve",
                ToolStep("reserve", {"order": "O-7"}),
                compensate=ToolStep("release", {"order": "O-7"}),
            )
            .step("charge", ToolStep("charge", {"order": "O-7"}))
        )
        outcome = await saga.run()
        journaled = {e.name: e.key for e in caller.client.journal.unsettled()}
        rerun = await saga.run()
    assert outcome.state is SagaState.COMPENSATED
    assert [s.state for s in outcome.steps] == [StepState.COMPENSATED, StepState.FAILED]
    reserved = outcome.step("reserve")
    assert reserved.response is not None
    assert text(tool_result(reserved.response)) == "reserved O-7"
    assert journaled == {}
    assert [name for name, _ in tools.runs] == ["reserve", "charge", "release"]
    assert len({key for _, key in tools.runs}) == 3
    assert all(key is not None and key.startswith("op-saga:order.") for _, key in tools.runs)
    # Settled in the journal: running it again calls nothing.
    assert [s.state for s in rerun.steps] == [s.state for s in outcome.steps]
    assert len(tools.runs) == 3


def test_a_caller_needs_one_way_to_a_session() -> None:
    with pytest.raises(ConfigurationError, match="connect="):
        IdempotentToolCaller(journal=":memory:")


@pytest.mark.parametrize("code", [-32050, CONNECTION_CLOSED, INTERNAL_ERROR, REQUEST_TIMEOUT])
async def test_a_servers_jsonrpc_error_is_its_final_answer(
    tmp_path: Path, fake_time: FakeTime, code: int
) -> None:
    """Any code, even one the SDK also uses for a connection it lost: the server answered."""
    tools = Tools()

    @tools.server.tool()
    async def refund(order: str, ctx: Context) -> str:
        await tools._run("refund", ctx)
        raise MCPError(code, f"refund of {order} refused", data={"order": order})

    async with calling(tools, tmp_path, fake_time, PATIENT) as caller:
        op = await caller.operation("refund", ref="R-1")
        with pytest.raises(ToolCallError) as answered:
            await caller.send(op, {"order": "o-1"})
        entry = caller.client.journal.get(op.key)
    assert answered.value.error.code == code
    assert answered.value.error.message == "refund of o-1 refused"
    assert answered.value.error.data == {"order": "o-1"}
    assert answered.value.key == op.key
    assert tools.keys("refund") == [op.key]  # not sent again
    assert entry is not None
    assert entry.state is OperationState.FAILED


async def test_a_tool_that_crashed_and_was_released_is_sent_again(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """As an HTTP 500: the server recorded nothing, and the retry under the key runs it."""
    tools = Tools(
        server=IdempotentMCPServer("tickets", extensions=[IdempotentTools(MemoryStore())])
    )
    crashes = [ConnectionError("the database restarted")]

    @tools.server.tool()
    async def book(room: str, ctx: Context) -> str:
        await tools._run("book", ctx)
        if crashes:
            raise crashes.pop()
        return f"booked {room}"

    async with calling(tools, tmp_path, fake_time, PATIENT) as caller:
        key, result, state = await settle(caller, "book", "B-1", {"room": "r-1"})
    assert text(result) == "booked r-1"
    assert tools.keys("book") == [key, key]
    assert state is OperationState.CONFIRMED


@pytest.mark.parametrize("code", [IDEMPOTENCY_ERROR, -32030], ids=["current", "older-server"])
async def test_a_refusal_is_read_by_its_problem_type_whatever_its_code(
    tmp_path: Path, fake_time: FakeTime, code: int
) -> None:
    """Servers of earlier versions refused with -32030: the caller reads ``data.type``."""
    tools = Tools()

    @tools.server.tool()
    async def pay(order: str, ctx: Context) -> str:
        await tools._run("pay", ctx)
        problem = "urn:idempotency-mw:problem:committed-without-response"
        data = {"type": problem, "title": "Committed", "status": 409, "detail": "it took effect"}
        raise MCPError(code, "Committed: it took effect", data=data)

    async with calling(tools, tmp_path, fake_time, PATIENT) as caller:
        op = await caller.operation("pay", ref="P-1")
        with pytest.raises(CommittedWithoutResponse):
            await caller.send(op, {"order": "o-1"})
        entry = caller.client.journal.get(op.key)
    assert tools.keys("pay") == [op.key]
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
