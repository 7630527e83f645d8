"""Every benchmark at a reduced size, one after the other; writes ``benchmarks/RESULTS.md``.

    python -m benchmarks.run_all [--skip network,scale] [--output benchmarks/RESULTS.md]

and the summary tables of the docs' results page (``--docs``, docs/performance/results.md).

Each benchmark runs as its own process (a fresh interpreter and event loop). Figures depend on
what else the machine is doing: the load average is recorded before and after each step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.apps import LABELS, PEERS, STORE_OF
from benchmarks.common import BENCH_DIR, fmt, loadavg, machine_info, markdown_table, wait_for_quiet

#: Added µs over bare FastAPI, in process, that the project set as targets (first, replay);
#: SQLite's were set when the store switched every file to WAL with synchronous=NORMAL.
TARGETS = {
    "ours-redis": (250, 60),
    "ours-sqlite-normal": (350, 60),
    "ours-postgresql": (800, 170),
}
#: Slowdown under uvicorn against bare FastAPI (bare req/s over ours), the targets.
NETWORK_TARGETS = {
    "ours-redis": (1.9, 1.15),
    "ours-sqlite-normal": (2.5, 1.5),
    "ours-postgresql": (3.5, 2.0),
}
#: The raw floor each store's first request is compared with (overhead.py's names).
FLOOR_OF = {
    "ours-sqlite": "SQLite, 3 statements (WAL, FULL)",
    "ours-sqlite-normal": "SQLite, 3 statements (WAL, NORMAL)",
    "ours-postgresql": "PostgreSQL, 2 statements (asyncpg)",
    "ours-redis": "Redis, 2 commands (redis-py)",
}
#: The store's own statements through its engine (overhead.py's names): what the schema, the
#: SQL and SQLAlchemy's engine cost over the floor's bare table, for reference.
STORE_SQL_OF = {
    "ours-sqlite": "SQLite, the store's 3 statements (aiosqlite, WAL, FULL)",
    "ours-sqlite-normal": "SQLite, the store's 3 statements (aiosqlite, WAL, NORMAL)",
    "ours-postgresql": "PostgreSQL, the store's 2 statements (asyncpg)",
}
RESULTS_START = "<!-- benchmark results: written by python -m benchmarks.run_all -->"
RESULTS_END = "<!-- end of benchmark results -->"

STEPS: dict[str, tuple[str, list[str]]] = {
    "inprocess": ("In process: µs per request", ["-n", "2000", "--warmup", "300"]),
    "overhead": ("Raw floors and the middleware's own costs", ["-n", "2000"]),
    "correctness": ("Correctness: 50 concurrent requests, one key, 100 ms handler", []),
    "scale": (
        "Scale: claim latency against table size; fingerprint cost",
        ["--full", "-n", "300"],
    ),
    "network": (
        "Under uvicorn, loaded by wrk (16 connections, 1 thread)",
        ["--requests", "10000", "--connections", "16", "--workers", "1,2"],
    ),
}


def library_digest() -> str:
    """A digest of the library's sources: the tree is not committed, so name what was run."""
    digest = hashlib.sha256()
    for path in sorted((BENCH_DIR.parent / "idempotency_mw").rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _split_label(variant: str) -> list[str]:
    layer, _, store = LABELS[variant].partition(", ")
    return [layer, store]


def _answers(statuses: dict[str, int]) -> str:
    return ", ".join(f"{status}x{count}" for status, count in sorted(statuses.items()))


def goals(inprocess: list[dict[str, Any]], overhead: dict[str, Any]) -> str:
    """Issue 14's goals against this run: cheaper than every peer, first requests within 1.5x
    of the store's raw floor, the middleware's own CPU at most bare FastAPI's whole request."""
    added = {(r["variant"], r["mode"]): r["added_p50"] for r in inprocess}
    floors = overhead.get("floors", {})
    rows = []
    for variant, floor_name in FLOOR_OF.items():
        first = added.get((variant, "first"))
        floor = floors.get(floor_name, {}).get("p50")
        if first is None or floor is None:
            continue
        peers = [peer for peer in PEERS if STORE_OF[peer] == STORE_OF[variant]]
        cpu = _row(overhead.get("cpu", []), variant, "first")
        store_sql = floors.get(STORE_SQL_OF.get(variant, ""), {}).get("p50")
        rows.append(
            [
                LABELS[variant],
                fmt(first),
                f"{fmt(floor)} ({floor_name})",
                f"{first / floor:.2f}x",
                "met" if first <= 1.5 * floor else "**missed**",
                "-" if store_sql is None else f"{fmt(store_sql)} ({first / store_sql:.2f}x)",
                *[_cheaper(added, variant, peers, mode) for mode in ("first", "replay")],
                "-" if cpu is None else f"{fmt(cpu['own_us'])} / {fmt(cpu['bare_cpu_us'])}",
            ]
        )
    return markdown_table(
        [
            "store",
            "first request, added p50 µs",
            "raw floor p50 µs",
            "ratio",
            "within 1.5x",
            "the store's own SQL through its engine, p50 µs (first request against it)",
            "first cheaper than the peers on this store",
            "replay cheaper than the peers",
            "middleware's own CPU / bare FastAPI's request, µs",
        ],
        rows,
    )


def _row(rows: list[dict[str, Any]], variant: str, mode: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["variant"] == variant and r["mode"] == mode), None)


def _cheaper(
    added: dict[tuple[str, str], float | None], variant: str, peers: list[str], mode: str
) -> str:
    ours = added.get((variant, mode))
    theirs = [added[(peer, mode)] for peer in peers if added.get((peer, mode)) is not None]
    if ours is None or not theirs:
        return "-"
    return "met" if ours < min(t for t in theirs if t is not None) else "**missed**"


def results_summary(
    info: dict[str, str],
    seconds: float,
    inprocess: list[dict[str, Any]],
    network: list[dict[str, Any]],
    overhead: dict[str, Any],
) -> str:
    """The docs' results: the machine, then in-process and uvicorn figures of every layer."""
    bare_us = [run["bare"]["p50"] for run in inprocess if run.get("bare")]
    lines = [
        f"Measured on {info['date']} by `python -m benchmarks.run_all` ({seconds:.0f} s; every "
        "table, with correctness bursts and scale, is in "
        "`benchmarks/RESULTS.md` of the repository), at commit "
        f"{info['git']}, on {info['nproc']} cores of an {info['cpu']} with Python "
        f"{info['python']}, starlette {info['starlette']}, fastapi {info['fastapi']}, "
        f"SQLAlchemy {info['sqlalchemy']}, asyncpg {info['asyncpg']}, asyncmy "
        f"{info['asyncmy']}, redis-py {info['redis']} with hiredis {info['hiredis']}, uvicorn "
        f"{info['uvicorn']} (no uvloop, no httptools); {info['PostgreSQL server']}, MariaDB "
        f"{info['MariaDB server']}, Redis {info['Redis server']} and SQLite "
        f"{info['SQLite library']}, all on the same machine (127.0.0.1).",
        "",
        f"In process (the ASGI app called directly, {inprocess[0]['summary']['n']:,} "
        f"sequential requests per row; bare FastAPI takes {min(bare_us, default=0):.0f} µs per "
        "request): µs added per request over bare FastAPI, p50 / p99.",
        "",
    ]
    rows = []
    for first, replay in zip(inprocess[::2], inprocess[1::2], strict=True):
        target = TARGETS.get(first["variant"])
        rows.append(
            [
                *_split_label(first["variant"]),
                f"{fmt(first['added_p50'])} / {fmt(first['added_p99'])}",
                f"{fmt(replay['added_p50'])} / {fmt(replay['added_p99'])}",
                f"{target[0]} / {target[1]}" if target else "-",
                _answers(replay["statuses"]),
            ]
        )
    lines += [
        markdown_table(
            ["layer", "store", "first request", "replay", "target", "replay answers"], rows
        ),
        "",
    ]
    if overhead:
        memory = _row(overhead.get("cpu", []), "ours-memory", "first")
        lines += [
            "The store switches a SQLite file to WAL with `synchronous=FULL`: the SQLite row's "
            "commits wait for the disk; the NORMAL row opts in to "
            '`SQLStore(url, sqlite_synchronous="NORMAL")`, whose commits do not. Each first '
            "request "
            "against its store's raw floor (the same store work without the middleware, "
            "measured in the same run: `benchmarks/overhead.py`), and the middleware's own CPU "
            "per first request outside store calls"
            + (
                f" (on `MemoryStore`: {fmt(memory['own_us'])} µs against bare FastAPI's "
                f"{fmt(memory['bare_cpu_us'])} µs)"
                if memory
                else ""
            )
            + ":",
            "",
            goals(inprocess, overhead),
            "",
        ]
    one_worker = [row for row in network if row["workers"] == 1 and row["variant"] != "bare"]
    if one_worker:
        bare_rps = [row["bare_rps"] for row in one_worker if row.get("bare_rps")]
        lines += [
            f"Under uvicorn (1 worker; wrk in another process, {_option('--connections')} "
            f"connections, {int(_option('--requests')):,} requests per run, a fresh key per "
            "request or one key replayed; bare FastAPI, measured between the "
            f"variants, serves {min(bare_rps, default=0):,.0f}-{max(bare_rps, default=0):,.0f} "
            "requests/s): requests/s, and the slowdown against bare FastAPI.",
            "",
        ]
        rows = []
        for first, replay in zip(one_worker[::2], one_worker[1::2], strict=True):
            slowdowns = NETWORK_TARGETS.get(first["variant"])
            rows.append(
                [
                    *_split_label(first["variant"]),
                    _slowdown(first),
                    _slowdown(replay),
                    f"{slowdowns[0]}x / {slowdowns[1]}x" if slowdowns else "-",
                    _answers(replay["statuses"] or {}),
                ]
            )
        lines.append(
            markdown_table(
                ["layer", "store", "first request", "replay", "target", "replay answers"], rows
            )
        )
    return "\n".join(lines)


def _option(name: str) -> str:
    """The value the network step is given for ``name``."""
    arguments = STEPS["network"][1]
    return arguments[arguments.index(name) + 1]


def _slowdown(row: dict[str, Any]) -> str:
    if not row.get("rps") or not row.get("ratio"):
        return row.get("error") or "-"
    return f"{row['rps']:,.0f}/s, {1 / row['ratio']:.2f}x"


def update_results_page(path: Path, summary: str) -> bool:
    """Put ``summary`` between the page's markers; whether they were found."""
    text = path.read_text()
    start, end = text.find(RESULTS_START), text.find(RESULTS_END)
    if start < 0 or end < start:
        return False
    path.write_text(f"{text[: start + len(RESULTS_START)]}\n{summary}\n{text[end:]}")
    return True


def targets_table(inprocess: list[dict[str, Any]]) -> str:
    rows = []
    for run in inprocess:
        target = TARGETS.get(run["variant"])
        if target is None:
            continue
        wanted = target[0] if run["mode"] == "first" else target[1]
        added = run["added_p50"]
        verdict = "-" if added is None else ("met" if added <= wanted else "**missed**")
        rows.append(
            [
                run["variant"],
                run["mode"],
                fmt(added),
                fmt(run["added_p99"]),
                fmt(run.get("added_to_response_p50")),
                wanted,
                verdict,
                "-" if added is None else f"{added / wanted:.1f}x",
            ]
        )
    return markdown_table(
        [
            "store",
            "mode",
            "added p50 µs",
            "added p99 µs",
            "added p50 to response µs",
            "target µs",
            "verdict (p50)",
            "vs target",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="", help=f"comma-separated steps of {list(STEPS)}")
    parser.add_argument("--output", default=str(BENCH_DIR / "RESULTS.md"))
    parser.add_argument(
        "--docs",
        default=str(BENCH_DIR.parent / "docs" / "performance" / "results.md"),
        help="update the results between this file's markers ('' to leave it alone)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each step, wait up to this many seconds for the 1-minute load to drop "
        "under 1.5 (default: don't wait)",
    )
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    info = machine_info()
    info["idempotency_mw sources sha256"] = library_digest()
    started = time.monotonic()
    sections: list[str] = []
    load_notes: list[str] = []
    inprocess: list[dict[str, Any]] = []
    network: list[dict[str, Any]] = []
    overhead: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="idem-bench-all-") as name:
        for step, (title, extra) in STEPS.items():
            if step in skip:
                continue
            load = wait_for_quiet(args.wait_quiet, 1.5) if args.wait_quiet else loadavg()
            json_path = Path(name) / f"{step}.json"
            md_path = Path(name) / f"{step}.md"
            command = [
                sys.executable,
                "-m",
                f"benchmarks.{step}",
                *extra,
                "--json",
                str(json_path),
                "--markdown",
                str(md_path),
            ]
            print(f"== {step}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
            began = time.monotonic()
            done = subprocess.run(command, cwd=BENCH_DIR.parent, check=False, timeout=1800)
            seconds = time.monotonic() - began
            digest = library_digest()
            changed = "" if digest == info["idempotency_mw sources sha256"] else (
                f"; **library sources changed during the run: now {digest}**"
            )  # fmt: skip
            load_notes.append(
                f"{step}: load {load} before, {loadavg()} after, {seconds:.0f} s{changed}"
            )
            body = md_path.read_text() if md_path.exists() else f"(failed: exit {done.returncode})"
            sections.append(
                f"## {title}\n\n`python -m benchmarks.{step} {' '.join(extra)}`\n\n{body}"
            )
            if step == "inprocess" and json_path.exists():
                inprocess = json.loads(json_path.read_text())
            if step == "network" and json_path.exists():
                network = json.loads(json_path.read_text())
            if step == "overhead" and json_path.exists():
                overhead = json.loads(json_path.read_text())
    header = [
        "# idempotency-mw benchmarks",
        "",
        f"Written by `python -m benchmarks.run_all` in {time.monotonic() - started:.0f} s "
        "(reduced sizes; run each script with `--help` for full ones).",
        "",
        markdown_table(["", ""], [[k, v] for k, v in info.items()]),
        "",
        "Load average (1/5/15 min) per step: the machine is shared, and other work running at "
        "the same time inflates every figure; compare rows of one run, not runs.",
        "",
        *[f"- {note}" for note in load_notes],
        "",
    ]
    if inprocess:
        header += [
            "## Targets: added µs over bare FastAPI, in process (p50)",
            "",
            targets_table(inprocess),
            "",
        ]
    Path(args.output).write_text("\n".join(header) + "\n" + "\n\n".join(sections))
    print(f"wrote {args.output}", file=sys.stderr)
    if args.docs and inprocess and "inprocess" not in skip:
        summary = results_summary(info, time.monotonic() - started, inprocess, network, overhead)
        if update_results_page(Path(args.docs), summary):
            print(f"updated the results in {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
