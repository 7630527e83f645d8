"""Versions of the library side by side in one sitting: the same harness run against each tree.

    python -m benchmarks.compare --tree base=/path/to/old/checkout --tree after=. \\
        [--rounds 2] [-n 2000] [--output FILE]
    python -m benchmarks.compare --under-load --tree base=... --tree after=. \\
        [--workers 4] [--connections 64] [--seconds 10] [--variants ours-redis,fik-redis]

The first form measures in process (``benchmarks.inprocess`` and ``benchmarks.overhead``);
``--under-load`` runs ``benchmarks.network`` instead: each tree's app under uvicorn with
``--workers`` processes, loaded by ``wrk`` from another process for ``--seconds`` per run, a
fresh key per request, with the server's CPU per request.

Each tree's ``idempotency_mw`` is imported through a scratch directory that links it beside
these benchmarks, so every version runs the same measurements. Variants alternate between the
trees (in reverse order every other round) and each figure is the median over the rounds. Each
tree gets its own PostgreSQL and MariaDB database (``<bench database>_<label>``): their schemas
differ between versions. The peers do not depend on our code, so they run once per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.apps import LABELS, OURS, PEERS
from benchmarks.common import (
    BENCH_DIR,
    MARIADB_URL,
    POSTGRESQL_URL,
    fmt,
    loadavg,
    machine_info,
    markdown_table,
)


def _run(tree: Path, scratch: Path, label: str, step: str, arguments: list[str], out: Path) -> Any:
    """``python -m benchmarks.<step>`` on ``tree``'s library; its JSON, or ``None``."""
    home = scratch / label
    if not home.exists():
        home.mkdir(parents=True)
        (home / "idempotency_mw").symlink_to(tree.resolve() / "idempotency_mw")
        (home / "benchmarks").symlink_to(BENCH_DIR)
    environment = {
        **os.environ,
        "BENCH_TREE": str(home),
        "BENCH_POSTGRESQL_URL": f"{POSTGRESQL_URL}_{label}",
        "BENCH_MARIADB_URL": f"{MARIADB_URL}_{label}",
        "PYTHONPATH": str(home),
    }
    command = [sys.executable, "-m", f"benchmarks.{step}", *arguments, "--json", str(out)]
    print(f"== {label}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=home, env=environment, check=False, timeout=1800)
    if done.returncode or not out.exists():
        print(f"   failed: exit {done.returncode}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def _run_variants(
    trees: dict[str, str],
    order: list[str],
    variants: list[str],
    scratch: Path,
    round_number: int,
    step: str,
    arguments: list[str],
    runs: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> None:
    """One round of ``step`` for each variant, on each tree in ``order`` (the peers, which do not
    depend on our code, on the first tree only, shown for every tree); adds to ``runs`` by
    (variant, mode, tree label)."""
    for variant in variants:
        for label in order if variant in OURS else order[:1]:
            out = scratch / f"{label}-{variant}-{round_number}.json"
            found = _run(
                Path(trees[label]), scratch, label, step, [*arguments, "--variants", variant], out
            )
            for run in found or []:
                if run.get("variant") == "bare":  # network's baseline runs
                    continue
                for each in list(trees) if variant in PEERS else [label]:
                    runs.setdefault((variant, run["mode"], each), []).append(run)


def _commit_of(tree: str) -> str:
    """The tree's commit, and whether its library has uncommitted changes."""

    def git(*arguments: str) -> str:
        done = subprocess.run(
            ["git", "-C", tree, *arguments], capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "idempotency_mw")
    return f"{commit} + uncommitted library changes" if dirty else commit


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def inprocess_table(
    labels: list[str], runs: dict[tuple[str, str, str], list[dict[str, Any]]]
) -> str:
    """Added µs over bare FastAPI (p50 / p99) of each variant and mode, one column per tree."""
    rows = []
    variants = list(dict.fromkeys(variant for variant, _, _ in runs))
    for variant in variants:
        for mode in ("first", "replay"):
            cells = []
            for label in labels:
                found = runs.get((variant, mode, label), [])
                p50 = _median([r["added_p50"] for r in found])
                p99 = _median([r["added_p99"] for r in found])
                spread = [r["added_p50"] for r in found if r["added_p50"] is not None]
                note = f" ({fmt(min(spread))}-{fmt(max(spread))})" if len(spread) > 1 else ""
                error = next((r["error"] for r in found if r.get("error")), None)
                reason = f" ({error.partition(': ')[2] or error})" if error else ""
                cells.append(f"{fmt(p50)} / {fmt(p99)}{note}" if p50 is not None else f"-{reason}")
            rows.append([LABELS[variant], mode, *cells])
    return markdown_table(
        ["variant", "mode", *[f"{label}: added p50 / p99 µs (p50 range)" for label in labels]],
        rows,
    )


def network_table(labels: list[str], runs: dict[tuple[str, str, str], list[dict[str, Any]]]) -> str:
    """Requests/s, server CPU µs per request and p99 of each variant and mode, one column per
    tree (medians over the rounds; the range of requests/s in brackets)."""
    rows = []
    for variant, mode in dict.fromkeys((variant, mode) for variant, mode, _ in runs):
        cells = []
        for label in labels:
            found = [r for r in runs.get((variant, mode, label), []) if r["rps"]]
            if not found:
                cells.append("-")
                continue
            rps = [r["rps"] for r in found]
            spread = f" ({fmt(min(rps))}-{fmt(max(rps))})" if len(rps) > 1 else ""
            cpu = _median([r.get("cpu_us") for r in found])
            p99 = _median([r["p99_us"] / 1000 for r in found])
            cells.append(f"{fmt(_median(list(rps)))}{spread}; {fmt(cpu)} µs; {fmt(p99, 1)} ms")
        rows.append([LABELS[variant], mode, *cells])
    return markdown_table(
        ["variant", "mode", *[f"{label}: req/s (range); CPU/req; p99" for label in labels]], rows
    )


def overhead_tables(labels: list[str], results: dict[str, list[dict[str, Any]]]) -> str:
    """Floors, the middleware's own CPU, the fence and the event hook, one column per tree."""
    floor_names = list(
        dict.fromkeys(name for runs in results.values() for r in runs for name in r["floors"])
    )
    floors = [
        [
            name,
            *[
                fmt(_median([r["floors"].get(name, {}).get("p50") for r in results[label]]))
                for label in labels
            ],
        ]
        for name in floor_names
    ]
    cpu_keys = list(
        dict.fromkeys(
            (row["variant"], row["mode"])
            for runs in results.values()
            for r in runs
            for row in r["cpu"]
        )
    )

    def cpu_cell(label: str, key: tuple[str, str]) -> str:
        rows = [
            row for r in results[label] for row in r["cpu"] if (row["variant"], row["mode"]) == key
        ]
        own = _median([row["own_us"] for row in rows])
        bare = _median([row["bare_cpu_us"] for row in rows])
        return "-" if own is None or bare is None else f"{fmt(own)} ({fmt(bare)})"

    cpu = [[*key, *[cpu_cell(label, key) for label in labels]] for key in cpu_keys]

    def fence_cell(label: str, database: str) -> str:
        rows = [row for r in results[label] for row in r["fence"] if row["database"] == database]
        if not rows:
            return "-"
        plain = _median([row["plain"]["p50"] for row in rows]) or 0.0
        fenced = _median([row["fenced"]["p50"] for row in rows]) or 0.0
        return (
            f"{fmt(plain)} → {fmt(fenced)} (+{fmt(fenced - plain)}); statements "
            f"{rows[0]['plain_statements']:.0f} → {rows[0]['fenced_statements']:.0f}, commits "
            f"{rows[0]['plain_commits']:.0f} → {rows[0]['fenced_commits']:.0f}"
        )

    fence = [
        [database, *[fence_cell(label, database) for label in labels]]
        for database in ("ours-sqlite", "ours-postgresql")
    ]

    def hook_cell(label: str, name: str, mode: str) -> str:
        value = _median([r["hook"].get(name, {}).get(mode, {}).get("p50") for r in results[label]])
        return fmt(value)

    hook = [
        [name, mode, *[hook_cell(label, name, mode) for label in labels]]
        for name in ("on_event=None", "no-op hook")
        for mode in ("first", "replay")
    ]
    return "\n".join(
        [
            "### Raw floors, wall p50 µs\n",
            markdown_table(["floor", *labels], floors),
            "\n### The middleware's own CPU per request outside store calls, µs "
            "(bare FastAPI's whole request)\n",
            markdown_table(["store", "mode", *labels], cpu),
            "\n### A first request whose handler inserts a row: plain → fenced, p50 µs\n",
            markdown_table(["database", *labels], fence),
            "\n### The event hook on MemoryStore, p50 µs per request\n",
            markdown_table(["on_event", "mode", *labels], hook),
        ]
    )


def under_load(args: argparse.Namespace) -> int:
    """The ``--under-load`` comparison: ``benchmarks.network`` on each tree, rounds alternating."""
    trees = dict(item.split("=", 1) for item in args.tree)
    labels = list(trees)
    variants = [v for v in args.variants.split(",") if v]
    load_notes = [f"start: {loadavg()}"]
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    network_arguments = [
        *("--workers", str(args.workers), "--connections", str(args.connections)),
        *("--duration", str(args.seconds), "--requests", "100000000", "--warmup", "2000"),
    ]
    with tempfile.TemporaryDirectory(prefix="idem-compare-") as name:
        scratch = Path(name)
        for round_number in range(args.rounds):
            order = labels if round_number % 2 == 0 else labels[::-1]
            _run_variants(
                trees, order, variants, scratch, round_number, "network", network_arguments, runs
            )
            load_notes.append(f"after round {round_number + 1}: {loadavg()}")
    _report(
        args,
        "versions side by side under load",
        f"`python -m benchmarks.compare --under-load`; uvicorn with {args.workers} workers, wrk "
        f"with {args.connections} connections in another process for {args.seconds:g} s per "
        "run, a fresh key per request (replay: one primed key); CPU is the server's processes' "
        "per request",
        trees,
        load_notes,
        [network_table(labels, runs)],
    )
    return 0


def _report(
    args: argparse.Namespace,
    title: str,
    how: str,
    trees: dict[str, str],
    load_notes: list[str],
    sections: list[str],
) -> None:
    """Write the comparison to ``args.output`` and print it: a title, how and where it was
    measured, then ``sections``."""
    info = machine_info()
    text = "\n".join(
        [
            f"# idempotency-mw: {title}",
            "",
            f"Written by {how}, on {info['date']}, {info['nproc']} cores of an {info['cpu']}, "
            f"Python {info['python']}; {args.rounds} rounds, medians over the rounds. Trees: "
            + ", ".join(f"{label} = {_commit_of(path)}" for label, path in trees.items())
            + ". Load average (1/5/15 min): "
            + "; ".join(load_notes)
            + ". The peers' figures do not depend on our code: one run per round, shown in "
            "every column.",
            "",
            *sections,
        ]
    )
    if args.output:
        Path(args.output).write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="label=path, in order")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-n", "--requests", type=int, default=2000)
    parser.add_argument("--variants", default=",".join((*OURS, *PEERS)))
    parser.add_argument("--output", help="also write the report to this file")
    parser.add_argument("--under-load", action="store_true", help="uvicorn and wrk, see above")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.under_load:
        return under_load(args)
    trees = dict(item.split("=", 1) for item in args.tree)
    labels = list(trees)
    variants = [v for v in args.variants.split(",") if v]
    load_notes = [f"start: {loadavg()}"]
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    overhead: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    inprocess_arguments = ["-n", str(args.requests), "--warmup", "300"]
    with tempfile.TemporaryDirectory(prefix="idem-compare-") as name:
        scratch = Path(name)
        for round_number in range(args.rounds):
            order = labels if round_number % 2 == 0 else labels[::-1]
            _run_variants(
                trees,
                order,
                variants,
                scratch,
                round_number,
                "inprocess",
                inprocess_arguments,
                runs,
            )
            for label in order:
                out = scratch / f"{label}-overhead-{round_number}.json"
                arguments = ["-n", str(args.requests)]
                found = _run(Path(trees[label]), scratch, label, "overhead", arguments, out)
                if found:
                    overhead[label].append(found)
            load_notes.append(f"after round {round_number + 1}: {loadavg()}")
    _report(
        args,
        "versions side by side",
        f"`python -m benchmarks.compare`, {args.requests:,} requests per figure",
        trees,
        load_notes,
        [
            "## In process: µs added per request over bare FastAPI",
            "",
            inprocess_table(labels, runs),
            "",
            "## Floors and the middleware's own costs",
            "",
            overhead_tables(labels, overhead),
            "",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
