"""What a keyed MCP tool call leaves behind is what an HTTP request would, on the mcp SDK's own
client in process and over streamable HTTP with JSON and with SSE answers: a returned result or
a deliberate ``MCPError`` is recorded, a crash releases the key, a committed effect is never
reported as a failure, a client that leaves never stops a started tool, records are bound to
their caller's credentials, and keys are validated as HTTP keys are."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import anyio
import httpx2
import pytest
from asgi_lifespan import LifespanManager
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, Request, RequestParamsMeta, TextContent
from pydantic import AnyHttpUrl
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.requests import HTTPConnection

from idempotency_mw import RedisStore, SchemaError, SQLStore, Store, fence
from idempotency_mw.client import OperationState, RetryPolicy
from idempotency_mw.client.mcp import IdempotentToolCaller, key_meta
from idempotency_mw.engine.proofs import proof_metadata
from idempotency_mw.mcp import IDEMPOTENCY_ERROR, IdempotentMCPServer, IdempotentTools, Scope
from idempotency_mw.stores.sql import async_url
from idempotency_mw.testing import MemoryStore
from idempotency_mw.values.metrics import key_hash
from idempotency_mw.wire.mcp import LOOKUP_METHOD, RETRY_META, KeyLookupResult, LookupParams
from tests.support.faults import free_port, serve

pytestmark = pytest.mark.anyio

TRANSPORTS = ["in-process", "json", "sse"]
HTTP = ["json", "sse"]
PROBLEM = "urn:idempotency-mw:problem:"

effects_table = Table(
    "effects",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("ref", String(50)),
)


@dataclass
class Clock:
    """The MemoryStore's clock: moved forward, its records expire (the store forgets)."""

    now: float = field(default_factory=time.time)

    def __call__(self) -> float:
        return self.now


@dataclass
class Tools:
    """A server whose tools append to ``effects`` what they did; ``engine`` is the app's
    database, where ``ship`` commits its effect with ``fence()``."""

    engine: AsyncEngine
    clock: Clock = field(default_factory=Clock)
    effects: list[str] = field(default_factory=list)
    crashes: int = 1

    def server(
        self, store: Store | None = None, *, scope: Scope = "mcp", **options: Any
    ) -> MCPServer:
        protect = IdempotentTools(store or MemoryStore(clock=self.clock), ttl=120, scope=scope)
        server = IdempotentMCPServer(
            "tools", extensions=[protect], lifespan=protect.lifespan, **options
        )

        @server.tool()
        async def create(title: str) -> dict[str, object]:
            self.effects.append(title)
            return {"id": len(self.effects), "title": title}

        @server.tool()
        async def flaky(title: str) -> str:
            if self.crashes:  # a transient failure before any effect
                self.crashes -= 1
                raise ConnectionError("the database restarted")
            self.effects.append(title)
            return f"done {title}"

        @server.tool()
        async def charge(order: str, code: int) -> str:
            self.effects.append(order)
            raise MCPError(code, f"declined {order}")

        @server.tool()
        async def gateway(order: str) -> str:
            self.effects.append(order)
            # A deliberate error in a gateway's own words, which look like a crash's.
            raise ToolError("Error executing tool gateway")

        @server.tool()
        async def broken() -> str:
            raise RuntimeError("a nested tool crashed")

        @server.tool()
        async def relay(order: str) -> CallToolResult:
            self.effects.append(order)
            try:
                await server.call_tool("broken", {})
            except ToolError as exc:  # a crash of the tool it called, answered deliberately
                words = TextContent(type="text", text=f"relayed: {exc}")
                return CallToolResult(content=[words], is_error=True)
            return CallToolResult(content=[])

        @server.tool()
        async def says(order: str, words: str) -> CallToolResult:
            self.effects.append(order)
            return CallToolResult(content=[TextContent(type="text", text=words)], is_error=True)

        @server.tool()
        async def slow(title: str) -> str:
            await anyio.sleep(0.8)
            self.effects.append(title)
            return f"done {title}"

        @server.tool()
        async def ship(ref: str, crash: bool = False) -> str:
            async with self.engine.begin() as conn:
                await conn.execute(insert(effects_table).values(ref=ref))
                await fence(conn)
            self.effects.append(ref)
            if crash:
                raise RuntimeError("the mailer failed after the commit")
            return f"shipped {ref}"

        return server


@pytest.fixture
async def tools(tmp_path: Path) -> AsyncIterator[Tools]:
    engine = create_async_engine(async_url(f"sqlite:///{tmp_path / 'app.db'}"))
    async with engine.begin() as conn:
        await conn.run_sync(effects_table.metadata.create_all)
        await conn.run_sync(proof_metadata.create_all)
    yield Tools(engine)
    await engine.dispose()


Sessions = Callable[..., AbstractAsyncContextManager[Client]]


@asynccontextmanager
async def sessions(server: MCPServer, transport: str) -> AsyncIterator[Sessions]:
    """``server`` over ``transport``: a way to open a session, whose HTTP requests carry the
    headers given (``x_tenant=`` is ``x-tenant``)."""
    if transport == "in-process":

        @asynccontextmanager
        async def in_process() -> AsyncIterator[Client]:
            async with Client(server) as client:
                yield client

        yield in_process
        return
    app = server.streamable_http_app(json_response=transport == "json")
    async with serve(app) as base:

        @asynccontextmanager
        async def over_http(**given: str) -> AsyncIterator[Client]:
            headers = {name.replace("_", "-"): value for name, value in given.items()}
            async with (
                httpx2.AsyncClient(headers=headers, timeout=30) as http,
                Client(streamable_http_client(f"{base}/mcp", http_client=http)) as client,
            ):
                yield client

        yield over_http


def text(result: Any) -> str:
    first = result.content[0]
    assert isinstance(first, TextContent)
    return first.text


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_crash_before_the_effect_releases_the_key(tools: Tools, transport: str) -> None:
    async with sessions(tools.server(), transport) as session, session() as client:
        crashed = await client.call_tool("flaky", {"title": "t"}, meta=key_meta("k"))
        again = await client.call_tool("flaky", {"title": "t"}, meta=key_meta("k"))
        replayed = await client.call_tool("flaky", {"title": "t"}, meta=key_meta("k"))
    assert crashed.is_error
    assert text(crashed) == "Error executing tool flaky"
    assert (crashed.meta or {})[RETRY_META] is True  # nothing recorded: send it again
    assert not again.is_error
    assert text(again) == text(replayed) == "done t"
    assert tools.effects == ["t"]


#: Deliberate errors whose words are a crash's, an unknown tool's, a nested crash's, and one
#: answered after a tool the tool called crashed.
LOOK_ALIKES = [
    ("gateway", {"order": "o-1"}),
    ("says", {"order": "o-1", "words": "Error executing tool says"}),
    ("says", {"order": "o-1", "words": "Unknown tool: says"}),
    ("says", {"order": "o-1", "words": "Error executing tool says: Error executing tool x"}),
    ("relay", {"order": "o-1"}),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("tool", "arguments"), LOOK_ALIKES)
async def test_a_deliberate_error_in_a_crashs_words_is_recorded(
    tools: Tools, transport: str, tool: str, arguments: dict[str, Any], tmp_path: Path
) -> None:
    """The package's caller sends again what the server released: a deliberate error told
    apart by its words would run the effect once per attempt."""
    policy = RetryPolicy(backoff_base=0.0, read_timeout=10, max_attempts=6, deadline=60)
    async with (
        sessions(tools.server(), transport) as session,
        session() as client,
        IdempotentToolCaller(client, journal=tmp_path / "journal.sqlite3", policy=policy) as caller,
    ):
        op = await caller.operation(tool, ref="R-1")
        answered = await caller.send(op, arguments)
        replayed = await client.call_tool(tool, arguments, meta=key_meta(op.key))
    assert answered.is_error
    assert RETRY_META not in (answered.meta or {})
    assert text(replayed) == text(answered)
    assert tools.effects == ["o-1"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unknown_tool_or_invalid_arguments_release_the_key(
    tools: Tools, transport: str
) -> None:
    """Never reached, as FastAPI's 422 or an app's 404: the key's next call runs."""
    server = tools.server()
    async with sessions(server, transport) as session, session() as client:
        unknown = await client.call_tool("later", {"title": "t"}, meta=key_meta("u"))
        invalid = await client.call_tool("create", {"title": ["t"]}, meta=key_meta("i"))

        @server.tool()
        async def later(title: str) -> str:
            tools.effects.append(f"later {title}")
            return title

        ran = await client.call_tool("later", {"title": "t"}, meta=key_meta("u"))
        valid = await client.call_tool("create", {"title": "t"}, meta=key_meta("i"))
    assert unknown.is_error
    assert invalid.is_error
    assert not ran.is_error
    assert not valid.is_error
    assert tools.effects == ["later t", "t"]


async def test_a_plain_mcpserver_records_a_crash(
    tools: Tools, caplog: pytest.LogCaptureFixture
) -> None:
    """Without IdempotentMCPServer a crash cannot be told from a deliberate error: recorded
    (never run twice), and said once."""
    protect = IdempotentTools(MemoryStore())
    server = MCPServer("tools", extensions=[protect])
    crashes = [ConnectionError("the database restarted")]

    @server.tool()
    async def flaky(title: str) -> str:
        tools.effects.append(title)
        if crashes:
            raise crashes.pop()
        return title

    with caplog.at_level(logging.WARNING, "idempotency_mw"):
        async with Client(server) as client:
            first = await client.call_tool("flaky", {"title": "t"}, meta=key_meta("k"))
            again = await client.call_tool("flaky", {"title": "t"}, meta=key_meta("k"))
    assert first.is_error
    assert text(again) == text(first) == "Error executing tool flaky"
    assert tools.effects == ["t"]
    assert sum("IdempotentMCPServer" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_mcp_error_after_the_effect_is_recorded(tools: Tools, transport: str) -> None:
    async with sessions(tools.server(), transport) as session, session() as client:
        errors = []
        for code in (-32000, -32000, -32050, -32050):
            with pytest.raises(MCPError) as raised:
                await client.call_tool(
                    "charge", {"order": f"o{code}", "code": code}, meta=key_meta(f"c{code}")
                )
            errors.append((raised.value.code, raised.value.message))
    assert errors == [(-32000, "declined o-32000")] * 2 + [(-32050, "declined o-32050")] * 2
    assert tools.effects == ["o-32000", "o-32050"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_fenced_tool_retried_after_the_store_forgot_is_told_it_committed(
    tools: Tools, transport: str
) -> None:
    refused: list[MCPError] = []
    async with sessions(tools.server(), transport) as session, session() as client:
        first = await client.call_tool("ship", {"ref": "s-1"}, meta=key_meta("s"))
        tools.clock.now += 120  # the store forgot the key; the app's database did not
        for _ in range(2):
            with pytest.raises(MCPError) as raised:
                await client.call_tool("ship", {"ref": "s-1"}, meta=key_meta("s"))
            refused.append(raised.value)
        # A crash after the effect committed: that call and its retry are told so.
        for _ in range(2):
            with pytest.raises(MCPError) as raised:
                await client.call_tool("ship", {"ref": "s-2", "crash": True}, meta=key_meta("x"))
            refused.append(raised.value)
    assert text(first) == "shipped s-1"
    assert [(e.code, e.data["type"]) for e in refused] == [
        (IDEMPOTENCY_ERROR, PROBLEM + "committed-without-response")
    ] * 4
    assert tools.effects == ["s-1", "s-2"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_client_that_times_out_never_stops_the_tool(
    tools: Tools, transport: str, tmp_path: Path
) -> None:
    """The package's caller gives up on each attempt after 0.3 s, the tool runs 0.8 s."""
    policy = RetryPolicy(backoff_base=0.0, read_timeout=0.3, max_attempts=30, deadline=30)

    async def soon(seconds: float) -> None:
        await anyio.sleep(min(seconds, 0.1))

    async with (
        sessions(tools.server(), transport) as session,
        session() as client,
        IdempotentToolCaller(
            client, journal=tmp_path / "journal.sqlite3", policy=policy, sleep=soon
        ) as caller,
    ):
        op = await caller.operation("slow", ref="S-1")
        result = await caller.send(op, {"title": "t"})
        entry = caller.client.journal.get(op.key)
    assert text(result) == "done t"
    assert entry is not None
    assert entry.state is OperationState.CONFIRMED
    assert tools.effects == ["t"]


@pytest.mark.parametrize("transport", HTTP)
async def test_two_callers_with_one_key_get_no_shared_result(tools: Tools, transport: str) -> None:
    ticket, key = {"title": "t"}, key_meta("shared-key")
    async with sessions(tools.server(), transport) as session:
        async with session(authorization="Bearer alice") as alice:
            first = await alice.call_tool("create", ticket, meta=key)
        refusals: list[MCPError] = []
        for other in ({"authorization": "Bearer bob"}, {}):  # other credentials, or none
            async with session(**other) as bob:
                with pytest.raises(MCPError) as refused:
                    await bob.call_tool("create", ticket, meta=key)
            refusals.append(refused.value)
        async with session(authorization="Bearer alice") as alice:
            again = await alice.call_tool("create", ticket, meta=key)
    assert first.structured_content == again.structured_content == {"id": 1, "title": "t"}
    assert [e.data["type"] for e in refusals] == [PROBLEM + "credential-mismatch"] * 2
    assert tools.effects == ["t"]


def sigv4(key_id: str, day: str, signature: str) -> str:
    return (
        f"AWS4-HMAC-SHA256 Credential={key_id}/{day}/eu-west-1/execute-api/aws4_request, "
        f"SignedHeaders=host;x-amz-date, Signature={signature}"
    )


@pytest.mark.parametrize("transport", HTTP)
async def test_a_call_signed_anew_is_the_same_callers_and_another_key_id_is_not(
    tools: Tools, transport: str
) -> None:
    ticket, key = {"title": "t"}, key_meta("signed-key")
    async with sessions(tools.server(), transport) as session:
        async with session(authorization=sigv4("AKID1", "20261207", "0a1b")) as first_call:
            first = await first_call.call_tool("create", ticket, meta=key)
        async with session(authorization=sigv4("AKID1", "20261208", "2c3d")) as retry:
            again = await retry.call_tool("create", ticket, meta=key)
        async with session(authorization=sigv4("AKID2", "20261208", "2c3d")) as other:
            with pytest.raises(MCPError) as refused:
                await other.call_tool("create", ticket, meta=key)
    assert first.structured_content == again.structured_content == {"id": 1, "title": "t"}
    assert refused.value.data["type"] == PROBLEM + "credential-mismatch"
    assert tools.effects == ["t"]


class Tokens:
    """A token verifier: each token names its OAuth client and subject (a refreshed token of
    the same subject is another string)."""

    async def verify_token(self, token: str) -> AccessToken | None:
        subject, _, _ = token.partition("-token-")
        return AccessToken(token=token, client_id="agent", scopes=[], subject=subject)


@pytest.mark.parametrize("transport", HTTP)
async def test_records_are_bound_to_the_sdks_authenticated_client(
    tools: Tools, transport: str
) -> None:
    """With the SDK's auth, the principal it authenticated (not the bearer token, which a
    refresh changes) owns the record."""
    auth = AuthSettings(
        issuer_url=AnyHttpUrl("https://auth.example"),
        resource_server_url=AnyHttpUrl("http://127.0.0.1/mcp"),
        validate_token_resource=False,  # the verifier below checks nothing: a test's own
    )
    server = tools.server(auth=auth, token_verifier=Tokens())
    ticket, key = {"title": "t"}, key_meta("k")
    async with sessions(server, transport) as session:
        async with session(authorization="Bearer alice-token-1") as alice:
            first = await alice.call_tool("create", ticket, meta=key)
        async with session(authorization="Bearer alice-token-2") as alice:  # refreshed
            again = await alice.call_tool("create", ticket, meta=key)
        async with session(authorization="Bearer bob-token-1") as bob:
            with pytest.raises(MCPError) as refused:
                await bob.call_tool("create", ticket, meta=key)
    assert first.structured_content == again.structured_content
    assert refused.value.data["type"] == PROBLEM + "credential-mismatch"
    assert tools.effects == ["t"]


async def test_a_scope_callable_decides_whose_records_they_are(tools: Tools) -> None:
    """The callable's namespace alone decides: one for every caller shares records on purpose;
    a callable that fails refuses the call before the tool runs."""

    def tenant(ctx: ServerRequestContext[Any, Any]) -> str:
        assert isinstance(ctx.request, HTTPConnection)
        return ctx.request.headers["x-tenant"]

    async with sessions(tools.server(scope=tenant), "json") as session:
        async with session(authorization="Bearer alice", x_tenant="acme") as alice:
            first = await alice.call_tool("create", {"title": "t"}, meta=key_meta("k"))
        async with session(authorization="Bearer bob", x_tenant="acme") as bob:  # same tenant
            shared = await bob.call_tool("create", {"title": "t"}, meta=key_meta("k"))
    async with sessions(tools.server(scope=tenant), "in-process") as session, session() as client:
        with pytest.raises(MCPError) as failed:  # in process: no HTTP request to read
            await client.call_tool("create", {"title": "t"}, meta=key_meta("k"))
    assert first.structured_content == shared.structured_content
    assert failed.value.data["type"] == PROBLEM + "scope-failed"
    assert tools.effects == ["t"]


HOSTILE = ["a\x00b", "a\r\nb", "tab\there", "\x7f", "clé", "a b", "", "x" * 256, 7, ["k"]]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_hostile_keys_are_refused_before_anything_runs(tools: Tools, transport: str) -> None:
    async with sessions(tools.server(), transport) as session, session() as client:
        for key in HOSTILE:
            meta = cast(RequestParamsMeta, {"idempotencyKey": key})
            with pytest.raises(MCPError) as refused:
                await client.call_tool("create", {"title": "t"}, meta=meta)
            assert refused.value.code == INVALID_PARAMS, key
            assert "must be 1-255 visible ASCII characters" in refused.value.message
        accepted = await client.call_tool("create", {"title": "t"}, meta=key_meta("x" * 255))
    assert not accepted.is_error
    assert tools.effects == ["t"]


async def test_an_mcp_app_without_its_table_fails_to_start(tools: Tools, tmp_path: Path) -> None:
    store = SQLStore(f"sqlite:///{tmp_path / 'empty.db'}")
    server = tools.server(store)
    with pytest.raises(SchemaError, match="idempotency-mw migrate"):
        async with LifespanManager(server.streamable_http_app()):
            pass
    with pytest.raises(SchemaError, match="idempotency-mw migrate"):
        async with Client(server):  # in process and over stdio, each connection starts it
            pass
    await store.aclose()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_unwired_mcp_server_without_its_table_says_to_migrate(
    tools: Tools, tmp_path: Path, transport: str
) -> None:
    """No ``lifespan=protect.lifespan``: every keyed call and lookup is refused for good (not
    told to retry), with the words the wired server fails to start with."""
    store = SQLStore(f"sqlite:///{tmp_path / 'empty.db'}")
    protect = IdempotentTools(store)
    server = IdempotentMCPServer("tools", extensions=[protect])

    @server.tool()
    async def create(title: str) -> str:
        tools.effects.append(title)
        return title

    refused: list[MCPError] = []
    async with sessions(server, transport) as session, session() as client:
        for _ in range(2):
            with pytest.raises(MCPError) as raised:
                await client.call_tool("create", {"title": "t"}, meta=key_meta("k"))
            refused.append(raised.value)
        lookup = Request[LookupParams, str](method=LOOKUP_METHOD, params=LookupParams(key="k"))
        with pytest.raises(MCPError) as raised:
            await client.session.send_request(lookup, KeyLookupResult)
        refused.append(raised.value)
    await store.aclose()
    for error in refused:
        assert error.code == IDEMPOTENCY_ERROR
        assert error.data["type"] == PROBLEM + "store-not-ready"
        assert error.data["status"] == 500
        assert "retryAfter" not in error.data
        assert "idempotency-mw migrate" in error.data["detail"]
    assert tools.effects == []


async def test_a_store_failure_is_logged_with_the_keys_hash_never_the_key(
    tools: Tools, caplog: pytest.LogCaptureFixture
) -> None:
    key = "order-secret-1234"
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    caplog.set_level(logging.WARNING, "idempotency_mw")
    async with Client(tools.server(store)) as client:  # an unreachable store only warns
        with pytest.raises(MCPError) as refused:
            await client.call_tool("create", {"title": "t"}, meta=key_meta(key))
    await store.aclose()
    assert refused.value.data["type"] == PROBLEM + "store-unavailable"
    assert f"failed to claim key {key_hash('mcp', key)}" in caplog.text
    assert key not in caplog.text
    assert tools.effects == []
