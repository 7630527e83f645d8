"""Rows purged per second on each database: ``python -m benchmarks.purge [--rows N]``.

Fills the table with expired rows (plus a few live ones) and times ``cleanup.purge`` over it.
Uses the ``idempotency_bench`` databases on PostgreSQL and MariaDB, never ``test``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from sqlalchemy import delete, insert
from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.common import MARIADB_URL, POSTGRESQL_URL, ensure_database
from idempotency_mw import SQLStore
from idempotency_mw.engine.cleanup import purge
from idempotency_mw.stores.sql import async_url
from idempotency_mw.stores.sql.schema import metadata, records


async def fill(url: str, expired: int, live: int) -> None:
    engine = create_async_engine(async_url(url))
    now = int(time.time() * 1000)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        await conn.execute(delete(records))
    rows = [
        {
            "scope": "",
            "key": f"{'old' if i < expired else 'live'}-{i}",
            "request_hash": "f" * 64,
            "status": "completed",
            "token": "t" * 32,
            "created_at": now - 7_200_000,
            "lease_expires_at": now - 3_600_000,
            "expires_at": now - 3_600_000 if i < expired else now + 3_600_000,
            "response_status": 201,
            "response_headers": b"",
            "result_payload": b'{"id": 1}',
            "caller_binding": "",
        }
        for i in range(expired + live)
    ]
    async with engine.begin() as conn:
        for start in range(0, len(rows), 10_000):
            await conn.execute(insert(records), rows[start : start + 10_000])
    await engine.dispose()


async def measure(name: str, url: str, rows: int, batch_size: int) -> str:
    await ensure_database(url)
    await fill(url, rows, rows // 100)
    store = SQLStore(url)
    try:
        report = await purge(store, batch_size=batch_size)
    finally:
        await store.aclose()
    rate = report.deleted / report.seconds
    return (
        f"| {name} | {report.deleted:,} | {report.batches} | {report.seconds:.2f} | {rate:,.0f} |"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000, help="expired rows to purge")
    parser.add_argument("--batch-size", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        targets = {
            "SQLite": f"sqlite:///{Path(tmp) / 'purge.db'}",
            "PostgreSQL": POSTGRESQL_URL,
            "MariaDB": MARIADB_URL,
        }
        print(f"batch size {args.batch_size}")
        print("| database | rows purged | batches | seconds | rows/s |")
        print("|---|---|---|---|---|")
        for name, url in targets.items():
            print(await measure(name, url, args.rows, args.batch_size), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
