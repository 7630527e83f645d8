"""The example ticket service: create tickets, send notification emails, list tickets; and
orders (inventory, payments, confirmation emails) from :mod:`example_app.orders`.

Run it with ``uvicorn example_app.app:app``; ``EXAMPLE_DATABASE_URL`` picks the database
(SQLite file ``./example.db`` by default). Tickets and the idempotency records share it.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Annotated

import httpx
from fastapi import APIRouter, FastAPI, Path, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from sqlalchemy import (
    Column,
    Connection,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from starlette.requests import HTTPConnection

from example_app.orders import add_order_routes, orders_metadata
from idempotency_mw import IdempotencyMiddleware, SQLStore, fence, idempotent
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.migrate import migration_lock, upgrade
from idempotency_mw.values.metrics import PrometheusMetrics

DEFAULT_DATABASE_URL = "sqlite:///./example.db"

metadata = MetaData()
tickets = Table(
    "example_tickets",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("caller", Text, nullable=False),
    Column("title", String(200), nullable=False),
    Column("client_ref", String(100), nullable=True),
    Column("created_at", String(40), nullable=False, server_default=func.current_timestamp()),
)
emails = Table(
    "example_emails",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ticket_id", Integer, nullable=False),
    Column("recipient", String(255), nullable=False),
)


# Text a database can store: PostgreSQL's text cannot hold a NUL character.
_NO_NUL = r"^[^\x00]*$"


class TicketIn(BaseModel):
    title: str = Field(min_length=1, max_length=200, pattern=_NO_NUL)
    client_ref: str | None = Field(default=None, max_length=100, pattern=_NO_NUL)


class Ticket(BaseModel):
    id: int
    title: str
    client_ref: str | None


class EmailIn(BaseModel):
    recipient: str = Field(min_length=3, max_length=255, pattern=_NO_NUL)


class Email(BaseModel):
    id: int
    ticket_id: int
    recipient: str


def caller_of(connection: HTTPConnection) -> str:
    """The caller's name; a stand-in for the identity an auth layer would provide."""
    return connection.headers.get("x-caller", "anonymous")


def create_app(
    database_url: str | None = None,
    *,
    ticket_ttl: timedelta = timedelta(hours=1),
    lease: timedelta = timedelta(seconds=10),
) -> FastAPI:
    """The ticket service on ``database_url`` (default: ``EXAMPLE_DATABASE_URL`` or SQLite),
    with the order routes of :mod:`example_app.orders`. ``ticket_ttl``: how long a ticket's
    response is replayed (longer than ``lease``, every route's)."""
    url = database_url or os.environ.get("EXAMPLE_DATABASE_URL", DEFAULT_DATABASE_URL)
    engine = example_engine(url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Workers started together each migrate: the lock makes them take turns.
        await upgrade(url)
        async with engine.connect() as conn:
            await conn.run_sync(_create_tables)
        yield
        await engine.dispose()

    app = FastAPI(title="Ticket service", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own answer echoes the input as UTF-8, which fails (a 500) on a lone
        # surrogate that a JSON body's \\ud800 escape smuggled in; ASCII escapes cannot fail.
        body = json.dumps({"detail": jsonable_encoder(exc.errors())}, ensure_ascii=True)
        return Response(body, status_code=422, media_type="application/json")

    # A registry of the app's own: several apps in one process (tests) each count their own.
    registry = CollectorRegistry()
    app.state.metrics = PrometheusMetrics(registry)
    app.add_middleware(
        IdempotencyMiddleware,
        store=SQLStore(url),
        scope=caller_of,
        lease=lease,
        on_event=app.state.metrics,
    )

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus metrics, in its text exposition format."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tickets", status_code=201)
    @idempotent(ttl=ticket_ttl, required=True)
    async def create_ticket(ticket: TicketIn, request: Request) -> Ticket:
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(tickets).values(
                    caller=caller_of(request), title=ticket.title, client_ref=ticket.client_ref
                )
            )
            # The ticket and the key's "effect committed" mark: one transaction.
            await fence(conn)
        (ticket_id,) = result.inserted_primary_key or (0,)
        return Ticket(id=ticket_id, title=ticket.title, client_ref=ticket.client_ref)

    @app.post("/tickets/{ticket_id}/emails", status_code=202)
    @idempotent(ttl=timedelta(minutes=10), required=True)
    async def send_email(
        ticket_id: Annotated[int, Path(ge=1, le=2**31 - 1)], email: EmailIn
    ) -> Email:
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(emails).values(ticket_id=ticket_id, recipient=email.recipient)
            )
            await fence(conn)
        (email_id,) = result.inserted_primary_key or (0,)
        return Email(id=email_id, ticket_id=ticket_id, recipient=email.recipient)

    @app.get("/tickets")
    async def list_tickets(request: Request) -> list[Ticket]:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(tickets.c.id, tickets.c.title, tickets.c.client_ref)
                .where(tickets.c.caller == caller_of(request))
                .order_by(tickets.c.id)
            )
            return [Ticket(id=r.id, title=r.title, client_ref=r.client_ref) for r in rows]

    orders = APIRouter(tags=["orders"])
    add_order_routes(orders, engine, caller_of)
    app.include_router(orders)
    return app


@asynccontextmanager
async def in_process(
    database_url: str | None = None, *, caller: str = "readme"
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the service run in this process (started and stopped around the
    block), calling as ``caller``: for examples that need a service but no server."""
    app = create_app(database_url)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://example-service",
            headers={"X-Caller": caller},
        ) as http,
    ):
        yield http


def _create_tables(connection: Connection) -> None:
    with migration_lock(connection):
        metadata.create_all(connection)
        orders_metadata.create_all(connection)
        connection.commit()


def example_engine(url: str) -> AsyncEngine:
    """The example's own engine on ``url`` (its tickets and orders; the store has its own)."""
    # Several workers share one SQLite file: wait for the write lock instead of failing.
    connect_args = {"timeout": 30} if async_url(url).get_backend_name() == "sqlite" else {}
    # pool_pre_ping: a connection the database closed (a restart, a reset) is replaced before
    # a handler or a tool gets it, instead of failing that call.
    return create_async_engine(async_url(url), connect_args=connect_args, pool_pre_ping=True)


app = create_app()
