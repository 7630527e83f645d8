"""A RabbitMQ consumer killed between its effect and its ack: the message is redelivered to
the next consumer, and its effect happens once (``tests/support/queue_consumer.py``)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from asyncio.subprocess import PIPE, Process
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw.stores.sql import async_url
from tests.conftest import _missing, fresh_sql_store
from tests.support.queue_consumer import BROKER_URL, effects, metadata

pytestmark = pytest.mark.anyio

MESSAGES = ["m-1", "m-2", "m-3"]


@pytest.fixture
async def queue() -> AsyncIterator[str]:
    """A durable queue of the test's own with three messages, deleted after."""
    try:
        connection = await aio_pika.connect(BROKER_URL)
    except (OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
        _missing(f"no RabbitMQ at 127.0.0.1:5672 ({exc})")
    name = f"test-idem-{uuid.uuid4().hex}"
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True)
        for message_id in MESSAGES:
            await channel.default_exchange.publish(
                aio_pika.Message(b"{}", message_id=message_id), routing_key=name
            )
        yield name
        await channel.queue_delete(name)


async def consumer(queue: str, database: str, crash: str = "") -> Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.queue_consumer", queue, database, crash, stdout=PIPE
    )


async def until(process: Process, wanted: str) -> list[str]:
    """The lines ``process`` prints up to and including ``wanted``."""
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(30):
        while not lines or lines[-1] != wanted:
            line = await process.stdout.readline()
            assert line, f"the consumer ended before printing {wanted!r}: {lines}"
            lines.append(line.decode().strip())
    return lines


@pytest.mark.parametrize("crash", ["in-body", "before-ack"])
async def test_a_consumer_killed_before_its_ack_is_redelivered_and_the_effect_happens_once(
    queue: str, tmp_path: Path, crash: str
) -> None:
    database = f"sqlite:///{tmp_path / 'consumer.db'}"
    await (await fresh_sql_store(database)).aclose()
    engine = create_async_engine(async_url(database))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    first = await consumer(queue, database, crash)
    try:
        # m-1 goes through; the consumer dies after m-2's effect, before its ack.
        assert await until(first, "effect m-2") == ["effect m-1", "acked m-1", "effect m-2"]
    finally:
        first.kill()
        await first.wait()
    second = await consumer(queue, database)
    try:
        seen = await until(second, "acked m-3")
    finally:
        second.kill()
        await second.wait()
    assert seen == ["acked m-2", "effect m-3", "acked m-3"]  # m-2 redelivered, not re-run
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(effects.c.message_id, func.count()).group_by(effects.c.message_id)
        )
        counts: dict[str, int] = dict(rows.all())
    await engine.dispose()
    assert counts == {"m-1": 1, "m-2": 1, "m-3": 1}
