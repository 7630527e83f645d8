"""The order routes of the example service: inventory, payments and confirmation emails.

Each is one step of an order saga in ``example_app.saga_demo``, with its compensation
(release a reservation, refund a charge). Like most real APIs, none of them is idempotent by
itself: every request that runs reserves, charges, releases, refunds or mails once more, so
only the ``Idempotency-Key`` keeps a retry from doing it twice. A charge goes through a card
network (a table standing in for a provider such as Stripe) that honours an idempotency key of
its own: the charge sends it ``downstream_key("card-network")``, so a charge that runs twice for
one request (its worker died after the network charged) is charged by the network once. Mail to
the domain
``bounce.example`` is refused, and so is the refund of a charge of
:data:`REFUND_APPROVAL_CENTS` or more (a person has to approve it): 422 problems of the
service's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import Column, Integer, MetaData, Row, String, Table, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from starlette.requests import HTTPConnection

from idempotency_mw import downstream_key, idempotent

UNDELIVERABLE_DOMAIN = "bounce.example"
MAILBOX_UNAVAILABLE = "urn:example:problem:mailbox-unavailable"
REFUND_APPROVAL_CENTS = 100_000
REFUND_NEEDS_APPROVAL = "urn:example:problem:refund-needs-approval"

orders_metadata = MetaData()
reservations = Table(
    "example_reservations",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("caller", String(100), nullable=False),
    Column("order_ref", String(100), nullable=False),
    Column("sku", String(50), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("status", String(16), nullable=False),  # reserved | released
)
releases = Table(
    "example_releases",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("reservation_id", Integer, nullable=False),
)
charges = Table(
    "example_charges",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("caller", String(100), nullable=False),
    Column("order_ref", String(100), nullable=False),
    Column("amount_cents", Integer, nullable=False),
    Column("status", String(16), nullable=False),  # captured | refunded
)
#: The card network's own record of what it charged: one row per idempotency key.
card_network = Table(
    "example_card_network",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("idempotency_key", String(64), nullable=False, unique=True),
    Column("caller", String(100), nullable=False),
    Column("order_ref", String(100), nullable=False),
    Column("amount_cents", Integer, nullable=False),
)
refunds = Table(
    "example_refunds",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("charge_id", Integer, nullable=False),
)
order_emails = Table(
    "example_order_emails",
    orders_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("caller", String(100), nullable=False),
    Column("order_ref", String(100), nullable=False),
    Column("recipient", String(255), nullable=False),
)

_REF = r"^[\x20-\x7e]+$"
Id = Annotated[int, Path(ge=1, le=2**31 - 1)]


class ReservationIn(BaseModel):
    order: str = Field(min_length=1, max_length=100, pattern=_REF)
    sku: str = Field(min_length=1, max_length=50, pattern=_REF)
    quantity: int = Field(ge=1, le=1000)


class Reservation(ReservationIn):
    id: int
    status: str


class ChargeIn(BaseModel):
    order: str = Field(min_length=1, max_length=100, pattern=_REF)
    amount_cents: int = Field(ge=1, le=10**8)


class Charge(ChargeIn):
    id: int
    status: str


class OrderEmailIn(BaseModel):
    order: str = Field(min_length=1, max_length=100, pattern=_REF)
    recipient: str = Field(min_length=3, max_length=255, pattern=_REF)


class OrderEmail(OrderEmailIn):
    id: int


def add_order_routes(
    router: APIRouter, engine: AsyncEngine, caller_of: Callable[[HTTPConnection], str]
) -> None:
    """Add the order routes to ``router``, on the tables of :data:`orders_metadata` in
    ``engine``'s database."""

    @router.post("/inventory/reservations", status_code=201)
    @idempotent(required=True)
    async def reserve(reservation: ReservationIn, request: Request) -> Reservation:
        values = {**reservation.model_dump(), "status": "reserved"}
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(reservations).values(
                    caller=caller_of(request),
                    order_ref=values.pop("order"),
                    **values,
                )
            )
        (new_id,) = result.inserted_primary_key or (0,)
        return Reservation(id=new_id, status="reserved", **reservation.model_dump())

    @router.post("/inventory/reservations/{reservation_id}/release")
    @idempotent(required=True)
    async def release(reservation_id: Id, request: Request) -> Reservation:
        async with engine.begin() as conn:
            row = await _mine(conn, reservations, reservation_id, caller_of(request))
            await conn.execute(insert(releases).values(reservation_id=reservation_id))
            await conn.execute(
                update(reservations)
                .where(reservations.c.id == reservation_id)
                .values(status="released")
            )
        return Reservation(
            id=row.id, order=row.order_ref, sku=row.sku, quantity=row.quantity, status="released"
        )

    @router.post("/payments/charges", status_code=201)
    @idempotent(required=True)
    async def charge(payment: ChargeIn, request: Request) -> Charge:
        await _charge_card(engine, downstream_key("card-network"), caller_of(request), payment)
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(charges).values(
                    caller=caller_of(request),
                    order_ref=payment.order,
                    amount_cents=payment.amount_cents,
                    status="captured",
                )
            )
        (new_id,) = result.inserted_primary_key or (0,)
        return Charge(id=new_id, status="captured", **payment.model_dump())

    @router.post("/payments/charges/{charge_id}/refund", response_model=Charge)
    @idempotent(required=True)
    async def refund(charge_id: Id, request: Request) -> Charge | JSONResponse:
        async with engine.begin() as conn:
            row = await _mine(conn, charges, charge_id, caller_of(request))
            if row.amount_cents >= REFUND_APPROVAL_CENTS:
                return _problem(
                    REFUND_NEEDS_APPROVAL, "Refund needs approval", "a person must approve it"
                )
            await conn.execute(insert(refunds).values(charge_id=charge_id))
            await conn.execute(
                update(charges).where(charges.c.id == charge_id).values(status="refunded")
            )
        return Charge(
            id=row.id, order=row.order_ref, amount_cents=row.amount_cents, status="refunded"
        )

    @router.get("/payments/charges")
    async def find_charges(order: str, request: Request) -> list[Charge]:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(charges)
                .where(charges.c.caller == caller_of(request), charges.c.order_ref == order)
                .order_by(charges.c.id)
            )
            return [
                Charge(id=r.id, order=r.order_ref, amount_cents=r.amount_cents, status=r.status)
                for r in rows
            ]

    @router.post("/emails", status_code=202, response_model=OrderEmail)
    @idempotent(required=True)
    async def send_order_email(email: OrderEmailIn, request: Request) -> OrderEmail | JSONResponse:
        if email.recipient.endswith("@" + UNDELIVERABLE_DOMAIN):
            return _problem(
                MAILBOX_UNAVAILABLE, "Mailbox unavailable", "the recipient's server refuses mail"
            )
        async with engine.begin() as conn:
            result = await conn.execute(
                insert(order_emails).values(
                    caller=caller_of(request), order_ref=email.order, recipient=email.recipient
                )
            )
        (new_id,) = result.inserted_primary_key or (0,)
        return OrderEmail(id=new_id, **email.model_dump())


async def _charge_card(engine: AsyncEngine, key: str, caller: str, payment: ChargeIn) -> None:
    """The card network's charge: once per idempotency key, as a provider's API keeps it."""
    async with engine.begin() as conn:
        done = await conn.scalar(
            select(card_network.c.id).where(card_network.c.idempotency_key == key)
        )
        if done is None:
            await conn.execute(
                insert(card_network).values(
                    idempotency_key=key,
                    caller=caller,
                    order_ref=payment.order,
                    amount_cents=payment.amount_cents,
                )
            )


def _problem(kind: str, title: str, detail: str) -> JSONResponse:
    """A 422 problem of the service's own (not the middleware's)."""
    body = {"type": kind, "title": title, "status": 422, "detail": detail}
    return JSONResponse(body, status_code=422, media_type="application/problem+json")


async def _mine(conn: AsyncConnection, table: Table, row_id: int, caller: str) -> Row[Any]:
    """The row ``row_id`` of ``table`` if it is ``caller``'s, else a 404."""
    found = await conn.execute(select(table).where(table.c.id == row_id, table.c.caller == caller))
    row = found.first()
    if row is None:
        raise HTTPException(404, f"no such {table.name.removeprefix('example_')[:-1]}")
    return row
