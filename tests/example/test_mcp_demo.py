"""The example's MCP server (streamable HTTP and stdio, on an empty database) and the MCP
duplicate-ticket demo, end to end on local sockets and processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

import anyio.to_thread
import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters

from example_app import mcp_demo
from example_app.demo import DemoConfig, DemoSummary, serve
from example_app.mcp_server import create_app, create_server
from idempotency_mw.client.mcp import key_meta
from tests.support.faults import PostgreSQLServer

pytestmark = pytest.mark.anyio

#: The demo's calls in the test.
OPERATIONS = 30


@pytest.mark.parametrize("json_response", [True, False], ids=["json", "sse"])
async def test_create_ticket_over_streamable_http_once_per_key(
    tmp_path: Path, json_response: bool
) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'example.db'}", json_response=json_response)
    arguments = {"title": "printer on fire", "client_ref": "T-1"}
    async with serve(app) as port:
        url = f"http://127.0.0.1:{port}/mcp"
        async with Client(url) as client:
            first = await client.call_tool("create_ticket", arguments, meta=key_meta("k"))
            plain = await client.call_tool("create_ticket", arguments)  # no key: runs
        async with Client(url) as client:
            again = await client.call_tool("create_ticket", arguments, meta=key_meta("k"))
            listed = await client.call_tool("list_tickets", {})
    assert first.structured_content == {"id": 1, "title": "printer on fire", "client_ref": "T-1"}
    assert again.structured_content == first.structured_content
    assert plain.structured_content is not None
    assert plain.structured_content["id"] == 2
    assert listed.structured_content is not None
    assert [ticket["id"] for ticket in listed.structured_content["result"]] == [1, 2]


async def test_create_ticket_over_stdio(tmp_path: Path) -> None:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "example_app.mcp_server"],
        env={"EXAMPLE_DATABASE_URL": f"sqlite:///{tmp_path / 'example.db'}"},
        cwd=Path.cwd(),
    )
    results = []
    for _ in range(2):
        async with Client(params) as client:
            results.append(
                await client.call_tool("create_ticket", {"title": "t"}, meta=key_meta("s"))
            )
    assert results[0].structured_content == results[1].structured_content
    assert results[0].structured_content == {"id": 1, "title": "t", "client_ref": None}


async def test_create_ticket_after_a_postgresql_restart(own_postgresql: PostgreSQLServer) -> None:
    # The restart kills every pooled connection: the tool's own engine replaces them
    # (pool_pre_ping), as the store does, instead of failing the first call after it.
    server, serving = create_server(own_postgresql.create_database("example"))
    async with serving(), Client(server) as client:
        before = await client.call_tool("create_ticket", {"title": "a"}, meta=key_meta("a"))
        await anyio.to_thread.run_sync(own_postgresql.stop)
        await anyio.to_thread.run_sync(own_postgresql.start)
        after = await client.call_tool("create_ticket", {"title": "b"}, meta=key_meta("b"))
    assert not before.is_error
    assert not after.is_error, after.content
    assert after.structured_content == {"id": 2, "title": "b", "client_ref": None}


def test_demo_exits_0_when_the_protected_run_created_every_ticket_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    summaries: list[DemoSummary] = []
    run_demo = mcp_demo.run_demo

    async def recorded(config: DemoConfig, progress: TextIO | None = None) -> DemoSummary:
        summary = await run_demo(config, progress)
        summaries.append(summary)
        return summary

    monkeypatch.setattr(mcp_demo, "run_demo", recorded)
    # Fewer calls than the demo's 200: each opens a session, and the suite runs on few cores.
    assert mcp_demo.main(["--operations", str(OPERATIONS), "--seed", "3"]) == 0
    (summary,) = summaries
    naive, idempotent = summary.naive, summary.idempotent
    assert naive.duplicates > 0
    assert idempotent.duplicates == 0
    assert idempotent.tickets == idempotent.confirmed == idempotent.operations == OPERATIONS
    assert sum(idempotent.faults.values()) > 0
    out, _ = capsys.readouterr()
    assert out.rstrip().splitlines()[-1].startswith("OK:")
