"""An MCP server of the MCP tests: its tools count their runs (in a table, so that runs in
several processes add up), protected by :class:`~idempotency_mw.mcp.IdempotentTools`.

``python -m tests.support.mcp_tools DATABASE_URL`` serves it over stdio, on a SQLStore and a run
counter in that SQLite database.
"""

from __future__ import annotations

import sys
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from idempotency_mw import SQLStore, Store
from idempotency_mw.mcp import TOOL_META, IdempotentMCPServer, IdempotentTools
from idempotency_mw.stores.sql import async_url

metadata = MetaData()
runs = Table(
    "mcp_tool_runs", metadata, Column("id", Integer, primary_key=True), Column("tool", String(50))
)


def tool_server(store: Store, engine: AsyncEngine, **options: Any) -> MCPServer:
    """The server, counting runs on ``engine``; every tool but ``echo`` is protected."""
    server = IdempotentMCPServer(
        "tickets",
        extensions=[IdempotentTools(store, tools={"create_ticket", "charge"}, **options)],
    )

    async def ran(tool: str) -> int:
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
            await conn.execute(insert(runs).values(tool=tool))
            count = await conn.scalar(
                select(func.count()).select_from(runs).where(runs.c.tool == tool)
            )
        return int(count or 0)

    @server.tool(meta=TOOL_META)
    async def create_ticket(title: str) -> dict[str, Any]:
        return {"id": await ran("create_ticket"), "title": title}

    @server.tool(meta=TOOL_META)
    async def charge(order: str) -> str:
        await ran("charge")
        raise ToolError(f"card declined for {order}")

    @server.tool()
    async def echo(text: str) -> str:
        await ran("echo")
        return text

    return server


if __name__ == "__main__":
    url = sys.argv[1]
    tool_server(SQLStore(url), create_async_engine(async_url(url))).run("stdio")
