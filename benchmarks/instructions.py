"""Instructions per keyed first request, counted by valgrind: a measure a loaded machine
cannot skew the way it skews wall-clock and CPU time.

Each variant runs twice under valgrind (``--tool=cachegrind --cache-sim=no``), with ``-n``
and with ``2n`` requests after the same warm-up; the difference over ``n`` is what one more
request costs, start-up and warm-up left out. Every request runs in a task of its own, as
under a server, with a fresh key (``--replay``: one key, run once before).

    python -m benchmarks.instructions [-n 300] [--variants bare,ours-memory,ours-redis,fik-redis]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from benchmarks.apps import BODY, LABELS, PATH, build_app, prepare, unavailable
from benchmarks.common import Lifespan, call, markdown_table, wipe_redis

WARMUP = 200


async def _requests(variant: str, n: int, replay: bool) -> None:
    prefix = f"idem-instructions-{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory() as directory:
        sqlite_dir = Path(directory)
        await prepare(variant, sqlite_dir)
        built = build_app(variant, sqlite_dir=sqlite_dir, redis_prefix=prefix)
        try:
            async with Lifespan(built.app):
                keys = [f"{prefix}{i}" for i in range(WARMUP + n)]
                if replay:
                    keys = [keys[0]] * len(keys)
                for key in keys:
                    reply = await asyncio.create_task(call(built.app, PATH, BODY, key=key))
                    if reply.status != 201:
                        raise RuntimeError(f"{variant}: {reply.status} {reply.body!r}")
        finally:
            if "redis" in variant:
                await wipe_redis(prefix=prefix)


def _counted(variant: str, n: int, replay: bool) -> int:
    """Instructions of one child process running ``n`` requests (after the warm-up)."""
    command = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "benchmarks.instructions",
        "--child",
        variant,
        "-n",
        str(n),
        *(["--replay"] if replay else []),
    ]
    # A fixed hash seed: with a random one, dicts and sets differ from run to run by more
    # than the changes measured.
    environment = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode or found is None:
        raise RuntimeError(f"{variant}: {done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--variants", default="bare,ours-memory,ours-redis,fik-redis")
    parser.add_argument("--replay", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_requests(args.child, args.n, args.replay))
        return
    rows = []
    for variant in args.variants.split(","):
        reason = unavailable(variant)
        if reason:
            rows.append((LABELS.get(variant, variant), "-", reason))
            continue
        twice, once = (_counted(variant, n, args.replay) for n in (2 * args.n, args.n))
        per_request = (twice - once) / args.n
        rows.append((LABELS.get(variant, variant), f"{per_request / 1000:,.0f}k", ""))
        print(f"{variant}: {per_request:,.0f}", file=sys.stderr, flush=True)
    mode = "replay" if args.replay else "first"
    print(markdown_table(("variant", f"instructions per {mode} request", "notes"), rows))


if __name__ == "__main__":
    main()
