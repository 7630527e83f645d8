"""Two services in a chain: orders (A) charges through payments (B), with the package's client
inside its protected handler, so the charge's key is derived from the order's.

Both log to :class:`~tests.support.reliability_app.Effects`: payments a ``charged`` step per
charge it makes, orders an ``order-charged`` step per run of its handler that got B's answer.
Under uvicorn (``uvicorn --factory tests.support.chain_app:create_orders``) orders is
configured by the environment: ``CHAIN_STORE`` and ``CHAIN_REDIS_PREFIX`` (its store),
``CHAIN_PAYMENTS`` (B's base URL), ``CHAIN_EFFECTS``, ``CHAIN_JOURNAL`` (its client's journal),
``CHAIN_LEASE`` and ``CHAIN_DELAY`` (how long a run sleeps once B answered).
"""

from __future__ import annotations

import os
from typing import Any

import anyio
from fastapi import FastAPI, Request

from idempotency_mw import IdempotencyMiddleware, Store, idempotent
from idempotency_mw.client import IdempotentClient
from tests.support.reliability_app import KEY_HEADER, Effects, store_from_url

LOOKUP = "/idempotency-keys"


def create_payments(store: Store, effects: Effects) -> FastAPI:
    """Service B: ``POST /charges`` makes a charge (its effect, logged) once per key."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, lookup_path=LOOKUP)

    @app.post("/charges", status_code=201)
    @idempotent(required=True)
    async def charge(request: Request, body: dict[str, Any]) -> dict[str, Any]:
        charge_id = await effects.alog("charges", request.headers[KEY_HEADER], "charged")
        return {"charge": charge_id, "amount": body["amount"]}

    return app


def chain_env(
    store_url: str,
    redis_prefix: str,
    payments_url: str,
    effects: Effects,
    journal: str,
    *,
    lease: float,
    delay: float,
) -> dict[str, str]:
    """The environment that configures orders under uvicorn."""
    return {
        "CHAIN_STORE": store_url,
        "CHAIN_REDIS_PREFIX": redis_prefix,
        "CHAIN_PAYMENTS": payments_url,
        "CHAIN_EFFECTS": effects.path,
        "CHAIN_JOURNAL": journal,
        "CHAIN_LEASE": str(lease),
        "CHAIN_DELAY": str(delay),
    }


def create_orders(
    store: Store | None = None,
    *,
    payments_url: str | None = None,
    effects: Effects | None = None,
    journal: str | None = None,
    lease: float | None = None,
    delay: float | None = None,
) -> FastAPI:
    """Service A; what is not given comes from the environment (see the module's doc)."""
    env = os.environ
    store = store or store_from_url(env["CHAIN_STORE"], env["CHAIN_REDIS_PREFIX"])
    payments = payments_url or env["CHAIN_PAYMENTS"]
    log = effects or Effects(env["CHAIN_EFFECTS"])
    journal_path = journal or env["CHAIN_JOURNAL"]
    pause = float(env["CHAIN_DELAY"]) if delay is None else delay
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        lease=float(env["CHAIN_LEASE"]) if lease is None else lease,
    )

    @app.get("/health")
    async def health() -> dict[str, int]:
        return {"pid": os.getpid()}

    @app.post("/orders", status_code=201)
    @idempotent(required=True)
    async def order(request: Request, body: dict[str, Any]) -> dict[str, Any]:
        async with IdempotentClient(
            base_url=payments, journal=journal_path, lookup_path=LOOKUP
        ) as client:
            charged = await client.post("/charges", operation="charge", json=body)
        await log.alog("orders", request.headers[KEY_HEADER], "order-charged")
        await anyio.sleep(pause)
        return {
            "charge": charged.json(),
            "replayed": charged.headers.get("idempotent-replayed") == "true",
            "pid": os.getpid(),
        }

    return app
