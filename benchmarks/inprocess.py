"""Per-request latency of each variant, driven in process: hand-built ASGI, no sockets.

For every variant the bare app is measured right before it (so drift hits both alike), then the
variant with a fresh key per request ("first") and with one key repeated ("replay": the key's
first run happens before the clock starts). Figures are µs per request, sequential requests.

    python -m benchmarks.inprocess [-n 2000] [--warmup 200] [--variants ours-sqlite,...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.apps import BODY, LABELS, PATH, VARIANTS, build_app, prepare, unavailable
from benchmarks.common import (
    ASGIApp,
    Lifespan,
    Summary,
    call,
    fmt,
    loadavg,
    markdown_table,
    now_us,
    status_summary,
    write_json,
)


@dataclass
class Run:
    """One timed loop of one variant in one mode."""

    variant: str
    mode: str  # "first" | "replay"
    summary: Summary | None = None
    to_response: Summary | None = None  # until the last body chunk is sent
    cpu_us: float | None = None  # process CPU time per request, all threads
    statuses: Counter[int] = field(default_factory=Counter)
    wrong_bodies: int = 0
    bare: Summary | None = None
    bare_to_response: Summary | None = None
    bare_cpu_us: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def added_p50(self) -> float | None:
        return None if not (self.summary and self.bare) else self.summary.p50 - self.bare.p50

    @property
    def added_p99(self) -> float | None:
        return None if not (self.summary and self.bare) else self.summary.p99 - self.bare.p99

    @property
    def added_to_response_p50(self) -> float | None:
        if not (self.to_response and self.bare_to_response):
            return None
        return self.to_response.p50 - self.bare_to_response.p50


async def time_first(
    app: ASGIApp, n: int, warmup: int, to_response: list[float] | None = None
) -> tuple[list[float], Counter[int], float]:
    """``n`` requests, each with a key never seen before; also CPU µs per request."""
    tag = uuid.uuid4().hex[:8]
    for i in range(warmup):
        await call(app, PATH, BODY, key=f"warm-{tag}-{i}")
    keys = [f"first-{tag}-{i}" for i in range(n)]
    statuses: Counter[int] = Counter()
    samples: list[float] = []
    gc.collect()
    cpu = time.process_time()
    for key in keys:
        started = now_us()
        reply = await call(app, PATH, BODY, key=key)
        samples.append(now_us() - started)
        if to_response is not None:
            to_response.append(reply.responded_us - started)
        statuses[reply.status] += 1
    return samples, statuses, (time.process_time() - cpu) / n * 1e6


async def time_replay(
    app: ASGIApp, n: int, warmup: int, to_response: list[float] | None = None
) -> tuple[list[float], Counter[int], int, list[str], float]:
    """``n`` repeats of one key whose first run has already happened."""
    key = f"replay-{uuid.uuid4().hex[:8]}"
    original = await call(app, PATH, BODY, key=key)
    notes = [] if original.status == 201 else [f"first run answered {original.status}"]
    for _ in range(warmup):
        await call(app, PATH, BODY, key=key)
    statuses: Counter[int] = Counter()
    wrong = 0
    samples: list[float] = []
    gc.collect()
    cpu = time.process_time()
    for _ in range(n):
        started = now_us()
        reply = await call(app, PATH, BODY, key=key)
        samples.append(now_us() - started)
        if to_response is not None:
            to_response.append(reply.responded_us - started)
        statuses[reply.status] += 1
        if reply.status != original.status or reply.body != original.body:
            wrong += 1
    return samples, statuses, wrong, notes, (time.process_time() - cpu) / n * 1e6


async def time_bare(n: int, warmup: int, sqlite_dir: Path) -> tuple[Summary, float, Summary]:
    built = build_app("bare", sqlite_dir=sqlite_dir)
    responded: list[float] = []
    async with Lifespan(built.app):
        samples, _, cpu = await time_first(built.app, n, warmup, responded)
    return Summary.of(samples), cpu, Summary.of(responded)


async def measure_variant(variant: str, n: int, warmup: int, sqlite_dir: Path) -> list[Run]:
    runs = [Run(variant, "first"), Run(variant, "replay")]
    reason = unavailable(variant)
    if reason:
        for run in runs:
            run.error = reason
        return runs
    bare, bare_cpu, bare_responded = await time_bare(n, warmup, sqlite_dir)
    for run in runs:
        run.bare, run.bare_cpu_us, run.bare_to_response = bare, bare_cpu, bare_responded
    try:
        await prepare(variant, sqlite_dir)
        built = build_app(variant, sqlite_dir=sqlite_dir)
        for run in runs:
            run.notes += built.notes
        async with Lifespan(built.app):
            responded: list[float] = []
            samples, runs[0].statuses, runs[0].cpu_us = await time_first(
                built.app, n, warmup, responded
            )
            runs[0].summary = Summary.of(samples)
            runs[0].to_response = Summary.of(responded)
            responded = []
            (
                samples,
                runs[1].statuses,
                runs[1].wrong_bodies,
                notes,
                runs[1].cpu_us,
            ) = await time_replay(built.app, n, warmup, responded)
            runs[1].summary = Summary.of(samples)
            runs[1].to_response = Summary.of(responded)
            runs[1].notes += notes
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        traceback.print_exc(file=sys.stderr)
        for run in runs:
            if run.summary is None:
                run.error = error
    return runs


def expected(run: Run) -> bool:
    return set(run.statuses) <= {201} and run.wrong_bodies == 0


def table(runs: list[Run]) -> str:
    headers = [
        "variant",
        "mode",
        "p50 µs",
        "p99 µs",
        "bare p50 / p99",
        "added p50",
        "added p99",
        "added p50, to response",
        "CPU µs/req (bare)",
        "statuses",
        "notes",
    ]
    rows = []
    for run in runs:
        note = run.error or "; ".join(run.notes)
        if run.summary and run.mode == "replay" and run.wrong_bodies:
            note = f"{run.wrong_bodies} replies differ from the first run's; " + note
        statuses = status_summary(run.statuses) if run.statuses else "-"
        if run.statuses and not expected(run):
            statuses = f"**{statuses}**"
        rows.append(
            [
                LABELS[run.variant],
                run.mode,
                fmt(run.summary.p50 if run.summary else None),
                fmt(run.summary.p99 if run.summary else None),
                f"{fmt(run.bare.p50)} / {fmt(run.bare.p99)}" if run.bare else "-",
                fmt(run.added_p50),
                fmt(run.added_p99),
                fmt(run.added_to_response_p50),
                f"{fmt(run.cpu_us)} ({fmt(run.bare_cpu_us)})" if run.cpu_us else "-",
                statuses,
                note,
            ]
        )
    return markdown_table(headers, rows)


async def main_async(args: argparse.Namespace) -> list[Run]:
    variants = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS)
    variants = [v for v in variants if v != "bare"]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="idem-bench-") as directory:
        for variant in variants:
            print(f"… {variant}", file=sys.stderr, flush=True)
            runs += await measure_variant(variant, args.requests, args.warmup, Path(directory))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--requests", type=int, default=2000, help="timed requests per run")
    parser.add_argument("--warmup", type=int, default=200, help="untimed requests before each")
    parser.add_argument("--variants", default="", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the Markdown table here")
    args = parser.parse_args(argv)
    load_before = loadavg()
    runs = asyncio.run(main_async(args))
    text = table(runs) + f"\n\nLoad average before / after: {load_before} / {loadavg()}.\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    write_json(
        args.json,
        [
            {
                "variant": run.variant,
                "mode": run.mode,
                "summary": run.summary,
                "bare": run.bare,
                "added_p50": run.added_p50,
                "added_p99": run.added_p99,
                "added_to_response_p50": run.added_to_response_p50,
                "cpu_us": run.cpu_us,
                "bare_cpu_us": run.bare_cpu_us,
                "statuses": dict(run.statuses),
                "wrong_bodies": run.wrong_bodies,
                "error": run.error,
                "notes": run.notes,
            }
            for run in runs
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
