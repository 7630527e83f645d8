"""MCP tool calls after a timeout, on SQLite, PostgreSQL and Redis, with the mcp SDK's own
client: a call first sent longer ago than its key is kept runs nothing, a caller looks its key
up with the extension's method, and a tool's downstream keys are the same on every run."""

from __future__ import annotations

import time
from dataclasses import replace
from email.utils import formatdate
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from mcp.client.client import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, Request, RequestParamsMeta

from idempotency_mw import Store, downstream_key
from idempotency_mw.client import OperationState
from idempotency_mw.client.mcp import IdempotentToolCaller, key_meta
from idempotency_mw.mcp import IDEMPOTENCY_ERROR, IdempotentMCPServer, IdempotentTools
from idempotency_mw.testing import MemoryStore
from idempotency_mw.wire.mcp import LOOKUP_METHOD, REPLAYED_META, KeyLookupResult, LookupParams
from tests.middleware.test_after_a_timeout import UNPARSABLE_FIRST_SENT

pytestmark = pytest.mark.anyio

RETENTION = 2.0


@pytest.fixture
def store(backend_store: Store) -> Store:
    """SQLite, PostgreSQL and Redis in turn."""
    return backend_store


def tickets(store: Store, runs: list[str], **options: Any) -> MCPServer:
    """``create_ticket`` (its runs in ``runs``) and ``charge`` (which answers its downstream
    key, and crashes on its first run), protected with a 2 s retention."""
    protect = IdempotentTools(store, ttl=RETENTION, lease=RETENTION / 2, **options)
    server = IdempotentMCPServer("tickets", extensions=[protect])

    @server.tool()
    async def create_ticket(title: str) -> str:
        runs.append(title)
        return f"T-{len(runs)}"

    @server.tool()
    async def charge(order: str) -> str:
        runs.append(downstream_key("provider"))
        if len(runs) == 1:
            raise RuntimeError("the worker died after calling the provider")
        return runs[-1]

    return server


async def look_up(client: Client, key: str) -> KeyLookupResult:
    request = Request[LookupParams, str](method=LOOKUP_METHOD, params=LookupParams(key=key))
    return await client.session.send_request(request, KeyLookupResult)


def sent_at(key: str, seconds: float) -> RequestParamsMeta:
    return key_meta(key, formatdate(seconds, usegmt=True))


async def test_a_call_first_sent_before_the_retention_and_the_purge_runs_nothing(
    store: Store,
) -> None:
    runs: list[str] = []
    first_sent = time.time()
    async with Client(tickets(store, runs)) as client:
        first = await client.call_tool(
            "create_ticket", {"title": "a"}, meta=sent_at("k", first_sent)
        )
        assert not first.is_error
        await anyio.sleep(RETENTION + 0.2)
        await store.purge_expired(batch_size=100)
        with pytest.raises(MCPError) as refused:
            await client.call_tool("create_ticket", {"title": "a"}, meta=sent_at("k", first_sent))
        assert (await look_up(client, "k")).state == "unknown"  # no record left behind
        fresh = await client.call_tool(
            "create_ticket", {"title": "b"}, meta=sent_at("k2", time.time())
        )
        with pytest.raises(MCPError) as unparsable:
            await client.call_tool(
                "create_ticket",
                {"title": "c"},
                meta=cast(
                    RequestParamsMeta, {"idempotencyKey": "k3", "idempotencyFirstSent": "yesterday"}
                ),
            )
    assert refused.value.error.code == IDEMPOTENCY_ERROR
    problem = refused.value.error.data
    assert isinstance(problem, dict)
    assert (problem["type"], problem["status"]) == ("urn:idempotency-mw:problem:expired-key", 412)
    assert not fresh.is_error
    assert unparsable.value.error.code == INVALID_PARAMS
    assert runs == ["a", "b"]


async def test_an_unparsable_first_sent_time_is_invalid_params_and_runs_nothing() -> None:
    runs: list[str] = []
    async with Client(tickets(MemoryStore(), runs)) as client:
        for n, value in enumerate([*UNPARSABLE_FIRST_SENT, "99999999999-01-01T00:00:00+00:00"]):
            meta = {"idempotencyKey": f"k{n}", "idempotencyFirstSent": value}
            with pytest.raises(MCPError) as refused:
                await client.call_tool(
                    "create_ticket", {"title": "a"}, meta=cast(RequestParamsMeta, meta)
                )
            assert refused.value.error.code == INVALID_PARAMS, value
            assert "idempotencyFirstSent" in refused.value.error.message
    assert runs == []


async def test_a_caller_looks_its_key_up_without_calling_the_tool(store: Store) -> None:
    runs: list[str] = []
    async with Client(tickets(store, runs)) as client:
        before = await look_up(client, "k")
        await client.call_tool("create_ticket", {"title": "a"}, meta=key_meta("k"))
        after = await look_up(client, "k")
        with pytest.raises(MCPError) as bad:
            await look_up(client, "")
    assert before.state == "unknown"
    assert before.expires_at is None
    assert (after.state, after.replayable) == ("completed", True)
    assert after.expires_at is not None
    assert bad.value.error.code == INVALID_PARAMS
    assert runs == ["a"]
    # Another caller (here: another scope) is told what a key never seen tells.
    async with Client(tickets(store, runs, scope=lambda ctx: "another")) as client:
        assert (await look_up(client, "k")).state == "unknown"


async def test_a_tools_downstream_key_is_the_same_on_every_run(store: Store) -> None:
    runs: list[str] = []
    async with Client(tickets(store, runs)) as client:
        crashed = await client.call_tool("charge", {"order": "o-1"}, meta=key_meta("c"))
        assert crashed.is_error  # released, like a 500: the retry runs the tool again
        charged = await client.call_tool("charge", {"order": "o-1"}, meta=key_meta("c"))
    assert not charged.is_error
    assert runs[0] == runs[1]
    assert len(runs[0]) == 64


async def test_the_caller_sends_its_first_sent_time_and_confirms_a_refused_retry(
    store: Store, tmp_path: Path
) -> None:
    """A call journaled as sent an hour ago, its key unknown to the server (which keeps keys
    2 s): refused, so the caller asks for confirmation instead of running it again."""
    runs: list[str] = []
    async with (
        Client(tickets(store, runs)) as session,
        IdempotentToolCaller(session, journal=tmp_path / "journal.sqlite3") as caller,
    ):
        op = await caller.operation("create_ticket")
        entry = caller.client.protocol.prepare(
            op, "POST", "/tools/create_ticket", {"json": {"title": "a"}}, False
        )
        caller.client.journal.save(
            replace(entry, state=OperationState.UNKNOWN, first_sent_at=time.time() - 3600)
        )
        [settled] = await caller.client.reconcile()
    assert settled.state is OperationState.NEEDS_CONFIRMATION
    assert runs == []


class LosesTheFirstAnswer:
    """A session whose first ``tools/call`` reaches the server (the tool runs) and whose
    answer is lost on the way back, as a broken connection loses it."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.calls = 0

    async def call_tool(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        read_timeout_seconds: float | None = None,
        progress_callback: Any = None,
        *,
        meta: Any = None,
    ) -> CallToolResult:
        self.calls += 1
        result = await self.client.call_tool(name, arguments, meta=meta)
        if self.calls == 1:
            raise anyio.BrokenResourceError
        return result


class LookingUp(LosesTheFirstAnswer):
    """The same, with the session a lookup goes through."""

    @property
    def session(self) -> Any:
        return self.client.session


@pytest.mark.parametrize("session", [LookingUp, LosesTheFirstAnswer])
async def test_the_caller_looks_a_lost_answer_up_instead_of_calling_again(
    store: Store, tmp_path: Path, session: type[LosesTheFirstAnswer]
) -> None:
    runs: list[str] = []
    async with Client(tickets(store, runs)) as client:
        lossy = session(client)
        async with IdempotentToolCaller(lossy, journal=tmp_path / "journal.sqlite3") as caller:
            result = await caller.call_tool("create_ticket", {"title": "a"})
    # The lookup answered: the tool was not called again (without a lookup, it was: replayed).
    assert lossy.calls == (1 if session is LookingUp else 2)
    assert runs == ["a"]
    assert (result.meta or {}).get(REPLAYED_META) is True
    assert result.structured_content == {"result": "T-1"}
