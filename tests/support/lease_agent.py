"""One agent process of the lease tests.

``python -m tests.support.lease_agent JOURNAL PREFIX URL NAME REF``: journals the operation NAME for
REF (printing its key as a JSON line), sends it as a ticket to the service at URL, and prints
the outcome as a JSON line. JOURNAL is a database or ``redis://`` URL; PREFIX names the Redis
keys. Leases last a second.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta

from idempotency_mw.client import (
    IdempotentClient,
    Journal,
    RedisJournal,
    RetryPolicy,
    SQLJournal,
)

LEASE = timedelta(seconds=1)


async def main(journal: Journal, url: str, name: str, ref: str) -> None:
    policy = RetryPolicy(read_timeout=60.0, deadline=60.0)
    async with IdempotentClient(
        base_url=url, journal=journal, policy=policy, lease=LEASE
    ) as client:
        operation = await client.operation(name, ref=ref)
        print(json.dumps({"key": operation.key}), flush=True)
        response = await client.send(
            operation,
            "POST",
            "/tickets",
            json={"title": "leased", "client_ref": ref},
            headers={"X-Caller": "lease-test"},
        )
        outcome = {"status": response.status_code, "body": response.json()}
        print(json.dumps(outcome), flush=True)
    journal.close()


if __name__ == "__main__":
    where, prefix, url, name, ref = sys.argv[1:]
    journal: Journal = (
        RedisJournal(where, prefix=prefix) if where.startswith("redis") else SQLJournal(where)
    )
    asyncio.run(main(journal, url, name, ref))
