"""Burst test: 50 concurrent requests with one key against a handler that sleeps 100 ms.

For each variant it counts how often the handler ran (1 is right), what the burst was answered,
whether later repeats of the key replay the first run's status and body byte for byte, and what
a repeat with the same key and a different body gets (a refusal is right; a 201 means the layer
did not notice). Done twice: in process (50 tasks into one ASGI app), and against uvicorn with
2 workers on 127.0.0.1 (50 connections at once, executions counted through a file), where only
the store can keep the workers apart.

    python -m benchmarks.correctness [--burst 50] [--delay 0.1] [--no-network]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.apps import BODY, LABELS, PATH, VARIANTS, build_app, prepare, unavailable
from benchmarks.common import Lifespan, Reply, call, markdown_table, write_json

OTHER_BODY = b'{"title": "a different ticket", "priority": 1}'


@dataclass
class Outcome:
    variant: str
    where: str
    executions: int | None = None
    burst: Counter[int] = field(default_factory=Counter)
    burst_bodies_differ: int = 0
    replays: list[tuple[int, bool]] = field(default_factory=list)  # (status, same as original)
    mismatch_status: int | None = None
    mismatch_effect: str = ""
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.error:
            return "error"
        problems = []
        if self.executions != 1:
            problems.append(f"handler ran {self.executions}x")
        if not self.replays or not all(same for _, same in self.replays):
            problems.append("replay differs")
        if self.burst_bodies_differ:
            problems.append("burst answers differ")
        if self.mismatch_status is None or 200 <= self.mismatch_status < 300:
            problems.append("reused key with another body accepted")
        return "ok" if not problems else "; ".join(problems)


def judge(outcome: Outcome, replies: list[Reply], replays: list[Reply], mismatch: Reply) -> None:
    outcome.burst = Counter(reply.status for reply in replies)
    successes = [reply for reply in replies if 200 <= reply.status < 300]
    original = successes[0] if successes else None
    outcome.burst_bodies_differ = sum(
        1 for reply in successes if original and reply.body != original.body
    )
    outcome.replays = [
        (
            reply.status,
            original is not None
            and (reply.status, reply.body)
            == (
                original.status,
                original.body,
            ),
        )
        for reply in replays
    ]
    outcome.mismatch_status = mismatch.status
    if original is not None and mismatch.body == original.body:
        outcome.mismatch_effect = "replayed the first request's response"


async def in_process(variant: str, burst: int, delay: float, sqlite_dir: Path) -> Outcome:
    outcome = Outcome(variant, "in process")
    await prepare(variant, sqlite_dir)
    built = build_app(variant, sqlite_dir=sqlite_dir, delay=delay)
    outcome.notes += built.notes
    async with Lifespan(built.app):
        key = f"burst-{uuid.uuid4().hex[:12]}"
        replies = await asyncio.gather(
            *(call(built.app, PATH, BODY, key=key) for _ in range(burst))
        )
        replays = [await call(built.app, PATH, BODY, key=key) for _ in range(3)]
        outcome.executions = built.app.state.executions
        mismatch = await call(built.app, PATH, OTHER_BODY, key=key)
        ran_again = built.app.state.executions - outcome.executions
    judge(outcome, list(replies), replays, mismatch)
    if ran_again:
        outcome.mismatch_effect = "ran the handler again"
    return outcome


async def http_post(port: int, key: str, body: bytes, wait: float = 10.0) -> Reply:
    """One POST over a fresh connection to 127.0.0.1 (Connection: close), parsed by hand.

    A connection the server broke is answered as status 0 with the error as body.
    """
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nIdempotency-Key: {key}\r\nConnection: close\r\n\r\n"
    )
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), wait)
        writer.write(head.encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), wait)
        writer.close()
    except (OSError, TimeoutError) as exc:
        return Reply(0, [], repr(exc).encode())
    if not raw:
        return Reply(0, [], b"connection closed without a response")
    header_block, _, payload = raw.partition(b"\r\n\r\n")
    lines = header_block.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = [tuple(line.split(b": ", 1)) for line in lines[1:] if b": " in line]
    return Reply(status, [(k.lower(), v) for k, v in headers], payload)


def over_network(variant: str, burst: int, delay: float, sqlite_dir: Path) -> Outcome:
    from benchmarks.network import uvicorn_server

    outcome = Outcome(variant, "uvicorn, 2 workers")
    asyncio.run(prepare(variant, sqlite_dir))
    counts = sqlite_dir / f"count-{variant}.txt"
    env = {"BENCH_HANDLER_DELAY": str(delay), "BENCH_COUNT_FILE": str(counts)}
    key = f"burst-{uuid.uuid4().hex[:12]}"

    async def drive(port: int) -> tuple[list[Reply], list[Reply]]:
        replies = await asyncio.gather(
            *(http_post(port, key, BODY) for _ in range(burst)), return_exceptions=True
        )
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            outcome.notes.append(f"{len(failed)} connections failed: {failed[0]!r}")
        replays = [await http_post(port, key, BODY) for _ in range(3)]
        return [r for r in replies if isinstance(r, Reply)], replays

    with uvicorn_server(variant, 2, sqlite_dir, env_extra=env) as server:
        port = server.port
        counts.write_text("")  # the readiness probe (no key) ran the handler once
        replies, replays = asyncio.run(drive(port))
        pids = counts.read_text().split()
        mismatch = asyncio.run(http_post(port, key, OTHER_BODY))
        ran_again = len(counts.read_text().split()) - len(pids)
    outcome.executions = len(pids)
    if len(set(pids)) > 1:
        outcome.notes.append(f"ran in {len(set(pids))} different workers")
    judge(outcome, replies, replays, mismatch)
    if ran_again:
        outcome.mismatch_effect = "ran the handler again"
    return outcome


def table(outcomes: list[Outcome]) -> str:
    headers = [
        "variant",
        "where",
        "handler runs",
        "burst answers",
        "3 replays (status, = original)",
        "same key, other body",
        "verdict",
        "notes",
    ]
    rows = []
    for o in outcomes:
        rows.append(
            [
                LABELS[o.variant],
                o.where,
                "-" if o.executions is None else o.executions,
                ", ".join(f"{s}x{n}" for s, n in sorted(o.burst.items())) or "-",
                ", ".join(f"{s} {'yes' if same else 'NO'}" for s, same in o.replays) or "-",
                f"{o.mismatch_status or '-'} {o.mismatch_effect}".strip(),
                o.verdict if o.verdict == "ok" else f"**{o.verdict}**",
                o.error or "; ".join(o.notes),
            ]
        )
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=50, help="concurrent requests, one key")
    parser.add_argument("--delay", type=float, default=0.1, help="handler sleep, seconds")
    parser.add_argument("--no-network", action="store_true", help="in process only")
    parser.add_argument("--variants", default="", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown table here")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS)
    variants = [v for v in variants if v != "bare"]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="idem-bench-burst-") as directory:
        sqlite_dir = Path(directory)
        for variant in variants:
            reason = unavailable(variant)
            wheres = ["in process"] + ([] if args.no_network else ["uvicorn, 2 workers"])
            for where in wheres:
                print(f"… {variant}, {where}", file=sys.stderr, flush=True)
                if reason:
                    outcomes.append(Outcome(variant, where, error=reason))
                    continue
                try:
                    if where == "in process":
                        outcome = asyncio.run(
                            in_process(variant, args.burst, args.delay, sqlite_dir)
                        )
                    else:
                        outcome = over_network(variant, args.burst, args.delay, sqlite_dir)
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    outcome = Outcome(variant, where, error=f"{type(exc).__name__}: {exc}"[:300])
                outcomes.append(outcome)
    text = table(outcomes)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    write_json(
        args.json,
        [
            {
                "variant": o.variant,
                "where": o.where,
                "executions": o.executions,
                "burst": dict(o.burst),
                "replays": o.replays,
                "mismatch_status": o.mismatch_status,
                "mismatch_effect": o.mismatch_effect,
                "verdict": o.verdict,
                "error": o.error,
                "notes": o.notes,
            }
            for o in outcomes
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
