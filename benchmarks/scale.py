"""How the store's claim latency holds up as the table grows, and what fingerprinting costs.

For each SQL store the table is filled with live (completed, unexpired) rows in bulk (sqlite3
executemany, PostgreSQL COPY, MariaDB multi-row INSERT), then timed: ``claim`` + ``complete`` of
fresh keys, and ``claim`` of random existing keys (a replay, reading a row that is likely not
cached). Default sizes 10k and 100k rows; ``--full`` adds 1M.

    python -m benchmarks.scale [--full] [--stores sqlite,postgresql,mariadb] [-n 500]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine

from benchmarks.common import (
    MARIADB_URL,
    POSTGRESQL_URL,
    Summary,
    fmt,
    markdown_table,
    now_us,
    prepare_sql,
    server_reachable,
    sqlite_url,
    write_json,
)
from idempotency_mw import SQLStore
from idempotency_mw.engine.fingerprint import request_fingerprint
from idempotency_mw.stores.sql import async_url
from idempotency_mw.values.records import ClaimOutcome, StoredResponse

COLUMNS = (
    "scope",
    "key",
    "request_hash",
    "status",
    "token",
    "created_at",
    "lease_expires_at",
    "expires_at",
    "response_status",
    "response_headers",
    "result_payload",
    "caller_binding",
)
FINGERPRINT = "0" * 64
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id": "abc"}')
TTL, LEASE = 86400.0, 60.0


def bulk_rows(start: int, stop: int) -> Iterator[tuple[Any, ...]]:
    now = int(time.time() * 1000)
    for i in range(start, stop):
        yield (
            "",
            f"bulk-{i:09d}",
            FINGERPRINT,
            "completed",
            "t" * 32,
            now,
            now,
            now + 7 * 86400 * 1000,
            201,
            b"",
            b'{"id": "bulk"}',
            "",
        )


async def fill(url: str, start: int, stop: int) -> float:
    """Add rows ``bulk-start`` .. ``bulk-stop`` to the table; returns seconds taken."""
    began = time.perf_counter()
    backend = async_url(url).get_backend_name()
    if backend == "sqlite":
        path = async_url(url).database
        assert path
        db = sqlite3.connect(path)
        with db:
            db.executemany(
                f"INSERT INTO idempotency_records ({', '.join(COLUMNS)}) "
                f"VALUES ({', '.join('?' for _ in COLUMNS)})",
                bulk_rows(start, stop),
            )
        db.close()
    elif backend == "postgresql":
        import asyncpg

        parsed = async_url(url)
        conn = await asyncpg.connect(
            host=parsed.host, port=parsed.port or 5432, user=parsed.username,
            database=parsed.database,
        )  # fmt: skip
        try:
            await conn.copy_records_to_table(
                "idempotency_records", records=bulk_rows(start, stop), columns=list(COLUMNS)
            )
            await conn.execute("ANALYZE idempotency_records")
        finally:
            await conn.close()
    else:
        engine = create_async_engine(async_url(url))
        statement = (
            f"INSERT INTO idempotency_records ({', '.join(f'`{c}`' for c in COLUMNS)}) "
            f"VALUES ({', '.join('%s' for _ in COLUMNS)})"
        )
        async with engine.begin() as conn:
            raw = await conn.get_raw_connection()
            cursor = raw.driver_connection.cursor()  # type: ignore[union-attr]
            rows = list(bulk_rows(start, stop))
            for offset in range(0, len(rows), 5000):
                await cursor.executemany(statement, rows[offset : offset + 5000])
            await cursor.close()
        await engine.dispose()
    return time.perf_counter() - began


@dataclass
class Point:
    store: str
    rows: int
    claim_first: Summary
    complete: Summary
    claim_replay: Summary
    fill_seconds: float


async def time_store(url: str, store_name: str, rows: int, n: int, fill_seconds: float) -> Point:
    store = SQLStore(url)
    try:
        await store.startup()
        for _ in range(20):  # warm the pool and the statement caches
            key = f"warm-{uuid.uuid4().hex}"
            claim = await store.claim("", key, FINGERPRINT, ttl=TTL, lease=LEASE)
            assert claim.token
            await store.complete("", key, claim.token, RESPONSE, ttl=TTL)
        claims, completes, replays = [], [], []
        for _ in range(n):
            key = f"fresh-{uuid.uuid4().hex}"
            started = now_us()
            claim = await store.claim("", key, FINGERPRINT, ttl=TTL, lease=LEASE)
            middle = now_us()
            assert claim.outcome is ClaimOutcome.ACQUIRED
            assert claim.token
            await store.complete("", key, claim.token, RESPONSE, ttl=TTL)
            claims.append(middle - started)
            completes.append(now_us() - middle)
        sample = random.Random(rows)
        for _ in range(n):
            key = f"bulk-{sample.randrange(rows):09d}"
            started = now_us()
            claim = await store.claim("", key, FINGERPRINT, ttl=TTL, lease=LEASE)
            replays.append(now_us() - started)
            assert claim.outcome is ClaimOutcome.REPLAY, claim
    finally:
        await store.aclose()
    return Point(
        store_name, rows, Summary.of(claims), Summary.of(completes), Summary.of(replays),
        fill_seconds,
    )  # fmt: skip


async def scale(stores: list[str], sizes: list[int], n: int, directory: Path) -> list[Point]:
    urls = {
        "sqlite": sqlite_url(directory, "scale.db"),
        "postgresql": POSTGRESQL_URL,
        "mariadb": MARIADB_URL,
    }
    points: list[Point] = []
    for store_name in stores:
        url = urls[store_name]
        if store_name != "sqlite" and not server_reachable(url):
            print(f"skipping {store_name}: no server", file=sys.stderr)
            continue
        await prepare_sql(url)
        filled = 0
        for size in sorted(sizes):
            print(f"… {store_name}: filling to {size:,} rows", file=sys.stderr, flush=True)
            seconds = await fill(url, filled, size)
            filled = size
            points.append(await time_store(url, store_name, size, n, seconds))
        if store_name != "sqlite":
            await prepare_sql(url)  # leave the bench database small
    return points


@dataclass
class FingerprintCost:
    size: int
    fingerprint: Summary
    sha256_only: Summary
    join_64k_chunks: Summary


def fingerprint_costs(sizes: list[int]) -> list[FingerprintCost]:
    out = []
    for size in sizes:
        body = random.Random(size).randbytes(size)
        chunks = [body[i : i + 65536] for i in range(0, size, 65536)]
        repeat = max(20, min(2000, (200 << 20) // max(size, 1) // 10))
        fp, sha, join = [], [], []
        for _ in range(repeat):
            started = now_us()
            request_fingerprint("POST", "/tickets", "/tickets", b"", [], body)
            fp.append(now_us() - started)
            started = now_us()
            hashlib.sha256(body).hexdigest()
            sha.append(now_us() - started)
            started = now_us()
            b"".join(chunks)
            join.append(now_us() - started)
        out.append(FingerprintCost(size, Summary.of(fp), Summary.of(sha), Summary.of(join)))
    return out


def tables(points: list[Point], costs: list[FingerprintCost]) -> str:
    claim_rows = [
        [
            p.store,
            f"{p.rows:,}",
            f"{fmt(p.claim_first.p50)} / {fmt(p.claim_first.p99)}",
            f"{fmt(p.complete.p50)} / {fmt(p.complete.p99)}",
            f"{fmt(p.claim_replay.p50)} / {fmt(p.claim_replay.p99)}",
            fmt(p.fill_seconds, 1),
        ]
        for p in points
    ]
    cost_rows = [
        [
            f"{c.size // 1024:,} KiB",
            f"{fmt(c.fingerprint.p50, 1)} / {fmt(c.fingerprint.p99, 1)}",
            fmt(c.size / c.fingerprint.p50 if c.fingerprint.p50 else None, 0),
            fmt(c.sha256_only.p50, 1),
            fmt(c.join_64k_chunks.p50, 1),
        ]
        for c in costs
    ]
    return (
        markdown_table(
            [
                "store",
                "live rows",
                "claim (new key) p50 / p99 µs",
                "complete p50 / p99 µs",
                "claim (replay, random row) p50 / p99 µs",
                "bulk fill s",
            ],
            claim_rows,
        )
        + "\n\n"
        + markdown_table(
            [
                "body",
                "request_fingerprint p50 / p99 µs",
                "MB/s",
                "bare sha256 p50 µs",
                "b''.join of 64 KiB chunks p50 µs",
            ],
            cost_rows,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="also 1M rows")
    parser.add_argument("--sizes", default="", help="row counts, comma-separated (overrides)")
    parser.add_argument("--stores", default="sqlite,postgresql,mariadb")
    parser.add_argument("-n", "--requests", type=int, default=500, help="timed ops per point")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown tables here")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [10_000, 100_000] + ([1_000_000] if args.full else [])
    stores = [s for s in args.stores.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="idem-bench-scale-") as directory:
        points = asyncio.run(scale(stores, sizes, args.requests, Path(directory)))
    costs = fingerprint_costs([1 << 10, 100 << 10, 1 << 20])
    text_out = tables(points, costs)
    print(text_out)
    if args.markdown:
        Path(args.markdown).write_text(text_out + "\n")
    write_json(args.json, {"claims": points, "fingerprint": costs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
