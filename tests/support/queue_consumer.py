"""A RabbitMQ consumer of the queue test, each message's effect run once by its message id.

``python -m tests.support.queue_consumer QUEUE DATABASE_URL [CRASH]``: consumes QUEUE (aio-pika,
127.0.0.1:5672) one message at a time; each message inserts a row (its id) into the
``queue_effects`` table of DATABASE_URL, fenced, through
:class:`~idempotency_mw.IdempotentFunctions` on a SQLStore there, and is acked after. Prints
``effect ID`` once the effect is committed and ``acked ID`` once acked. With CRASH
(``in-body``: after the commit, before the function returns; ``before-ack``: after it
returned), the consumer stops there at its second message and waits to be killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import aio_pika
from sqlalchemy import Column, Integer, MetaData, String, Table, insert
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_mw import CommittedWithoutResult, IdempotentFunctions, SQLStore, fence
from idempotency_mw.stores.sql import async_url

BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"

metadata = MetaData()
effects = Table(
    "queue_effects",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", String(100), nullable=False),
)


async def main(queue_name: str, database_url: str, crash: str) -> None:
    engine = create_async_engine(async_url(database_url))
    # A crashed consumer's key lapses after its lease; a redelivery waits that long for it.
    protect = IdempotentFunctions(SQLStore(database_url), lease=1, wait=5)
    handled: list[str] = []

    @protect(key=lambda message_id: f"effect:{message_id}")
    async def handle(message_id: str) -> str:
        """The effect: a row, committed with the key's fence in one transaction."""
        async with engine.begin() as conn:
            await conn.execute(insert(effects).values(message_id=message_id))
            await fence(conn)
        print(f"effect {message_id}", flush=True)
        if crash == "in-body" and handled:
            await asyncio.Event().wait()  # killed here
        return message_id

    connection = await aio_pika.connect(BROKER_URL)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.declare_queue(queue_name, durable=True)
        async with queue.iterator() as messages:
            async for message in messages:
                message_id = message.message_id or ""
                # Committed without result: its effect is done, only its return value is lost.
                with contextlib.suppress(CommittedWithoutResult):
                    await handle(message_id)
                if crash == "before-ack" and handled:
                    await asyncio.Event().wait()  # killed here
                await message.ack()
                print(f"acked {message_id}", flush=True)
                handled.append(message_id)


if __name__ == "__main__":
    queue_name, database_url, *crash = sys.argv[1:]
    asyncio.run(main(queue_name, database_url, crash[0] if crash else ""))
