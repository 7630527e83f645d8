"""One process of the event-loop tests: a service whose every request runs in a loop of its own.

``python -m tests.support.loops_agent STORE URL KEY...``: puts the middleware on ``STORE``
(``url``: a store made from URL; ``engine``: from an engine with SQLAlchemy's pool;
``engine-nullpool``:
from an engine without one) and sends one POST per KEY, each in ``asyncio.run`` of its own, as
a TestClient used without ``with`` does; a Redis store's keys go under the prefix
``LOOPS_REDIS_PREFIX`` names. Prints one JSON line: the statuses, how many times
the handler ran, and the store failures logged. A process of its own, because the connections
a closed loop leaves behind are collected whenever Python gets to them, warnings and all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import httpx
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from idempotency_mw import IdempotencyMiddleware, RedisStore, SQLStore, Store
from idempotency_mw.stores.sql import async_url


def store_of(kind: str, url: str) -> Store:
    if url.startswith("redis"):
        return RedisStore(url, prefix=os.environ["LOOPS_REDIS_PREFIX"])
    if kind == "url":
        return SQLStore(url)
    pool = {"poolclass": NullPool} if kind == "engine-nullpool" else {}
    return SQLStore(create_async_engine(async_url(url), **pool))


class Failures(logging.Handler):
    """The messages the middleware logs."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(kind: str, url: str, keys: list[str]) -> None:
    failures = Failures()
    logging.getLogger("idempotency_mw").addHandler(failures)
    runs: list[str] = []
    app = FastAPI()

    @app.post("/tickets", status_code=201)
    async def create_ticket() -> dict[str, int]:
        runs.append("ran")
        return {"id": len(runs)}

    # Records of a minute: the test's own go soon, in Redis too.
    app.add_middleware(IdempotencyMiddleware, store=store_of(kind, url), ttl=120)

    async def post(key: str) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post("/tickets", headers={"Idempotency-Key": key})
            return answer.status_code

    statuses = [asyncio.run(post(key)) for key in keys]
    print(json.dumps({"statuses": statuses, "runs": len(runs), "failures": failures.messages}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
