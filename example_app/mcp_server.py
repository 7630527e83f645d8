"""The example ticket service's tools over MCP, each keyed call run once.

``uvicorn example_app.mcp_server:app`` serves them over streamable HTTP at ``/mcp``;
``python -m example_app.mcp_server`` over stdio. ``EXAMPLE_DATABASE_URL`` picks the database
(the HTTP service's: the same ``example_tickets`` table and idempotency records), which is set
up at start.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Annotated

import anyio
from mcp.server.mcpserver import MCPServer
from pydantic import Field
from sqlalchemy import insert, select
from starlette.applications import Starlette

from example_app.app import DEFAULT_DATABASE_URL, Ticket, example_engine, metadata, tickets
from idempotency_mw import SQLStore, fence
from idempotency_mw.mcp import TOOL_META, IdempotentMCPServer, IdempotentTools
from idempotency_mw.stores.sql.migrate import upgrade

#: The database while the server serves: set up (migrations, the example's tables) before,
#: its connections and the store closed after.
Serving = Callable[[], AbstractAsyncContextManager[None]]

#: The caller column of the tickets the tools create (MCP carries no caller header).
CALLER = "mcp"


def create_server(database_url: str | None = None) -> tuple[MCPServer, Serving]:
    """The MCP server on ``database_url`` (default: ``EXAMPLE_DATABASE_URL`` or SQLite), and
    its database while it serves."""
    url = database_url or os.environ.get("EXAMPLE_DATABASE_URL", DEFAULT_DATABASE_URL)
    engine = example_engine(url)
    store = SQLStore(url)
    # A retry that finds the first call still running waits for its result a while.
    protect = IdempotentTools(store, tools={"create_ticket"}, lease=timedelta(seconds=10), wait=5)
    # Its lifespan checks the store when the server starts (after serving() migrated it).
    server = IdempotentMCPServer(
        "tickets", extensions=[protect], lifespan=protect.lifespan, log_level="WARNING"
    )

    @server.tool(meta=TOOL_META)
    async def create_ticket(
        title: Annotated[str, Field(min_length=1, max_length=200)],
        client_ref: Annotated[str | None, Field(max_length=100)] = None,
    ) -> Ticket:
        """Create a ticket; send it under ``_meta.idempotencyKey`` to create it once."""
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(tickets).values(caller=CALLER, title=title, client_ref=client_ref)
            )
            # The ticket and the key's "effect committed" mark: one transaction.
            await fence(conn)
        (ticket_id,) = result.inserted_primary_key or (0,)
        return Ticket(id=ticket_id, title=title, client_ref=client_ref)

    @server.tool()
    async def list_tickets() -> list[Ticket]:
        """The tickets the tools created."""
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(tickets.c.id, tickets.c.title, tickets.c.client_ref)
                .where(tickets.c.caller == CALLER)
                .order_by(tickets.c.id)
            )
            return [Ticket(id=r.id, title=r.title, client_ref=r.client_ref) for r in rows]

    @asynccontextmanager
    async def serving() -> AsyncIterator[None]:
        await upgrade(url)
        async with engine.begin() as conn:
            await conn.run_sync(metadata.create_all)
        try:
            yield
        finally:
            await protect.aclose()
            await store.aclose()
            await engine.dispose()

    return server, serving


def create_app(database_url: str | None = None, *, json_response: bool = True) -> Starlette:
    """The tools over streamable HTTP at ``/mcp`` (JSON answers unless ``json_response`` is
    false: SSE), the database set up when the app starts."""
    server, serving = create_server(database_url)
    app = server.streamable_http_app(json_response=json_response)
    sessions = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with serving(), sessions(app):
            yield

    app.router.lifespan_context = lifespan
    return app


async def main() -> None:
    """Serve the tools over stdio."""
    server, serving = create_server()
    async with serving():
        await server.run_stdio_async()


app = create_app()

if __name__ == "__main__":
    anyio.run(main)
